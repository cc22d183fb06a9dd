//! The engine interface generated engines implement, and the weights view they read.

use crate::codecs;
use crate::role::Role;

/// A failure inside an engine step; every variant names what was wrong.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("weight {role:?} (layer {layer:?}) is missing")]
    MissingWeight { role: Role, layer: Option<u32> },
    #[error("weight {role:?} (layer {layer:?}) has {got} elements, expected {expected}")]
    WeightSize { role: Role, layer: Option<u32>, expected: usize, got: usize },
    #[error("weight {role:?} (layer {layer:?}) cannot be read: {reason}")]
    BadWeight { role: Role, layer: Option<u32>, reason: String },
    #[error("weight {role:?} (layer {layer:?}) is stored as {dtype}; a norm vector must be f32 or bf16")]
    NormType { role: Role, layer: Option<u32>, dtype: &'static str },
    #[error("token {token} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { token: u32, vocab: usize },
    #[error("context is full: position {pos} reaches max_seq {max_seq}")]
    ContextFull { pos: usize, max_seq: usize },
    #[error("prefill needs at least one token")]
    EmptyPrompt,
    #[error("backend: {0}")]
    Backend(String),
    #[error("shape fingerprint mismatch: engine {engine}, archive {archive}")]
    Fingerprint { engine: String, archive: String },
    #[error("layer {layer} is not a layer of this model ({layers} layers)")]
    NoSuchLayer { layer: usize, layers: usize },
    #[error("{what}: {got} values, expected a whole number of rows of {row} (at most {max_rows} rows)")]
    RowShape { what: &'static str, got: usize, row: usize, max_rows: usize },
}

/// A monomorphized decode loop for one architecture. The logits it returns are its own buffer,
/// valid until the next call: no step allocates.
pub trait Engine {
    /// Run every prompt token through the model; returns the logits after the last one.
    fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32], EngineError>;
    /// Run one token at the next position; returns its logits.
    fn decode_step(&mut self, token: u32) -> Result<&[f32], EngineError>;
    /// Forget the KV cache and start again at position 0.
    fn reset(&mut self);
}

/// A boxed engine is an engine (the CLI picks one at run time).
impl<E: Engine + ?Sized> Engine for Box<E> {
    fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32], EngineError> {
        (**self).prefill(tokens)
    }
    fn decode_step(&mut self, token: u32) -> Result<&[f32], EngineError> {
        (**self).decode_step(token)
    }
    fn reset(&mut self) {
        (**self).reset()
    }
}

/// The CPU engine one layer at a time, on a residual stream it is handed: what a GPU engine
/// calls for the layers `--residency hybrid` keeps in host memory. Each layer computes exactly as
/// inside the whole engine (the same generated function, the same KV cache of that layer), so a
/// model run layer by layer through this equals the engine's own forward pass bit for bit.
pub trait HostLayers {
    fn num_layers(&self) -> usize;
    /// Positions each layer's KV cache holds.
    fn max_seq(&self) -> usize;
    /// Layer `layer`'s decode step on the residual `x` (`[hidden]`, updated in place) of the token
    /// at `pos`; its K and V are written into this engine's cache of that layer.
    fn layer_step(&mut self, layer: usize, x: &mut [f32], pos: usize) -> Result<(), EngineError>;
    /// Layer `layer` over prompt rows `x` (`[rows, hidden]`, in place) at positions `pos..`.
    fn layer_prompt(&mut self, layer: usize, x: &mut [f32], pos: usize) -> Result<(), EngineError>;
}

/// A borrowed tensor in the format it is stored in: the matvec of each format decodes its rows in
/// registers ([`crate::cpu::matvec`] picks the format's kernel once per call, not per element).
/// Quantized views hold whole rows of `cols` values; their lengths are checked when the view is
/// made ([`crate::format::Archive::tensor_view`]).
#[derive(Debug, Clone, Copy)]
pub enum WeightView<'a> {
    F32(&'a [f32]),
    Bf16(&'a [half::bf16]),
    /// FP8 e4m3 codes, one f32 scale per row.
    F8E4m3 { values: &'a [u8], scales: &'a [f32], cols: usize },
    /// MXFP4 e2m1 codes two a byte, an e8m0 exponent per 32 values, optionally a bf16 row postscale.
    Mxfp4 { values: &'a [u8], scales: &'a [u8], postscale: Option<&'a [half::bf16]>, cols: usize },
    /// GGUF Q8_0 blocks (34 bytes per 32 values).
    Q8_0 { blocks: &'a [u8], cols: usize },
    /// GGUF Q4_1 blocks (20 bytes per 32 values).
    Q4_1 { blocks: &'a [u8], cols: usize },
}

impl<'a> WeightView<'a> {
    /// Number of values.
    pub fn len(&self) -> usize {
        match *self {
            WeightView::F32(w) => w.len(),
            WeightView::Bf16(w) => w.len(),
            WeightView::F8E4m3 { values, .. } => values.len(),
            WeightView::Mxfp4 { values, .. } => values.len() * 2,
            WeightView::Q8_0 { blocks, .. } => blocks.len() / codecs::q8_0::BLOCK_BYTES * 32,
            WeightView::Q4_1 { blocks, .. } => blocks.len() / codecs::q4_1::BLOCK_BYTES * 32,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The storage type's name (`bf16`, `f8_e4m3`, ...).
    pub fn dtype(&self) -> crate::dtype::DType {
        use crate::dtype::DType;
        match self {
            WeightView::F32(_) => DType::F32,
            WeightView::Bf16(_) => DType::Bf16,
            WeightView::F8E4m3 { .. } => DType::F8E4m3,
            WeightView::Mxfp4 { .. } => DType::Mxfp4,
            WeightView::Q8_0 { .. } => DType::Q8_0,
            WeightView::Q4_1 { .. } => DType::Q4_1,
        }
    }

    /// Rows `r0..r1` of rows of `n` values (`n` is the row length: for quantized views it must
    /// be their `cols`).
    pub fn rows(&self, r0: usize, r1: usize, n: usize) -> WeightView<'a> {
        match *self {
            WeightView::F32(w) => WeightView::F32(&w[r0 * n..r1 * n]),
            WeightView::Bf16(w) => WeightView::Bf16(&w[r0 * n..r1 * n]),
            WeightView::F8E4m3 { values, scales, cols } => {
                assert_eq!(n, cols, "fp8 rows are {cols} values");
                WeightView::F8E4m3 { values: &values[r0 * cols..r1 * cols], scales: &scales[r0..r1], cols }
            }
            WeightView::Mxfp4 { values, scales, postscale, cols } => {
                assert_eq!(n, cols, "mxfp4 rows are {cols} values");
                WeightView::Mxfp4 {
                    values: &values[r0 * cols / 2..r1 * cols / 2],
                    scales: &scales[r0 * cols / 32..r1 * cols / 32],
                    postscale: postscale.map(|p| &p[r0..r1]),
                    cols,
                }
            }
            WeightView::Q8_0 { blocks, cols } => {
                assert_eq!(n, cols, "q8_0 rows are {cols} values");
                let b = cols / 32 * codecs::q8_0::BLOCK_BYTES;
                WeightView::Q8_0 { blocks: &blocks[r0 * b..r1 * b], cols }
            }
            WeightView::Q4_1 { blocks, cols } => {
                assert_eq!(n, cols, "q4_1 rows are {cols} values");
                let b = cols / 32 * codecs::q4_1::BLOCK_BYTES;
                WeightView::Q4_1 { blocks: &blocks[r0 * b..r1 * b], cols }
            }
        }
    }

    /// Values `start..end`, whole rows of a quantized view (one expert of a stacked MoE tensor).
    pub fn slice(&self, start: usize, end: usize) -> WeightView<'a> {
        let n = self.row_len().unwrap_or(1);
        assert!(start % n == 0 && end % n == 0, "a slice of a quantized view must be whole rows of {n}");
        self.rows(start / n, end / n, n)
    }

    /// The row length of a quantized view (plain views have no fixed one).
    pub fn row_len(&self) -> Option<usize> {
        match *self {
            WeightView::F32(_) | WeightView::Bf16(_) => None,
            WeightView::F8E4m3 { cols, .. } | WeightView::Mxfp4 { cols, .. } | WeightView::Q8_0 { cols, .. } | WeightView::Q4_1 { cols, .. } => Some(cols),
        }
    }

    /// Row `r` of rows of `out.len()` values, decoded to f32 (an embedding lookup).
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        let n = out.len();
        let ok = match self.rows(r, r + 1, n) {
            WeightView::F32(w) => {
                out.copy_from_slice(w);
                Ok(())
            }
            WeightView::Bf16(w) => {
                out.iter_mut().zip(w).for_each(|(o, v)| *o = v.to_f32());
                Ok(())
            }
            WeightView::F8E4m3 { values, scales, .. } => codecs::fp8::dequantize_row(values, scales[0], out),
            WeightView::Mxfp4 { values, scales, postscale, .. } => codecs::mxfp4::dequantize_row(values, scales, postscale.map(|p| p[0]), out),
            WeightView::Q8_0 { blocks, .. } => codecs::q8_0::dequantize_row(blocks, out),
            WeightView::Q4_1 { blocks, .. } => codecs::q4_1::dequantize_row(blocks, out),
        };
        ok.expect("a view's rows were checked when it was made");
    }

    /// Copy out as f32 (norm vectors, tests; the hot matvecs read the view directly).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let n = self.row_len().unwrap_or(self.len().max(1));
        let mut out = vec![0.0; self.len()];
        for (r, o) in out.chunks_exact_mut(n).enumerate() {
            self.row_into(r, o);
        }
        out
    }
}

/// Tensors by role and layer: implemented by the archive reader and by in-memory test weights.
/// An engine binds each tensor it reads once, at load ([`Weights::bind`]), and reads it by its
/// handle afterwards ([`Weights::at`]): no lookup per op.
pub trait Weights {
    /// A handle to tensor (role, layer), or `None` if there is none.
    fn find(&self, role: Role, layer: Option<u32>) -> Option<usize>;

    /// The tensor behind a handle from [`Weights::find`] (empty if the handle is not one).
    fn at(&self, handle: usize) -> WeightView<'_>;

    /// The tensor behind a handle, or why it cannot be read (checked once, at [`Weights::bind`]).
    fn try_at(&self, handle: usize) -> Result<WeightView<'_>, String> {
        Ok(self.at(handle))
    }

    fn get(&self, role: Role, layer: Option<u32>) -> Option<WeightView<'_>> {
        self.find(role, layer).map(|h| self.at(h))
    }

    /// The handle of (role, layer), its format and element count checked once here.
    fn bind(&self, role: Role, layer: Option<u32>, expected: usize) -> Result<usize, EngineError> {
        let h = self.find(role, layer).ok_or(EngineError::MissingWeight { role, layer })?;
        let view = self.try_at(h).map_err(|reason| EngineError::BadWeight { role, layer, reason })?;
        if role.is_norm() && view.row_len().is_some() {
            return Err(EngineError::NormType { role, layer, dtype: view.dtype().name() });
        }
        let got = view.len();
        if got != expected {
            return Err(EngineError::WeightSize { role, layer, expected, got });
        }
        Ok(h)
    }
}

/// Weights held in memory as f32, keyed by (role, layer): for tests and tiny random models (a
/// handle is the position in key order; [`Weights::at`] walks to it).
#[derive(Debug, Default, Clone)]
pub struct MemWeights {
    pub tensors: std::collections::BTreeMap<(Role, Option<u32>), Vec<f32>>,
}

impl Weights for MemWeights {
    fn find(&self, role: Role, layer: Option<u32>) -> Option<usize> {
        self.tensors.keys().position(|k| *k == (role, layer))
    }
    fn at(&self, handle: usize) -> WeightView<'_> {
        WeightView::F32(self.tensors.values().nth(handle).map_or(&[], |v| v.as_slice()))
    }
}

/// An opened archive serves its tensors in place: the views borrow the mmap, no copy. A handle is
/// the tensor's index in the manifest.
impl Weights for crate::format::Archive {
    fn find(&self, role: Role, layer: Option<u32>) -> Option<usize> {
        self.manifest().tensors.iter().position(|t| t.role == role && t.layer == layer)
    }
    fn at(&self, handle: usize) -> WeightView<'_> {
        // `bind` has read this handle through `try_at` without error, and the mmap is immutable,
        // so a bound handle never lands here empty.
        self.tensor_view(handle).unwrap_or(WeightView::F32(&[]))
    }
    fn try_at(&self, handle: usize) -> Result<WeightView<'_>, String> {
        self.check_tensor(handle).map_err(|e| e.to_string())
    }
}

/// Weights shared by several owners: the CLI keeps the archive (tokenizer, manifest) while the
/// boxed engine holds it too.
impl<T: Weights + ?Sized> Weights for std::sync::Arc<T> {
    fn find(&self, role: Role, layer: Option<u32>) -> Option<usize> {
        (**self).find(role, layer)
    }
    fn at(&self, handle: usize) -> WeightView<'_> {
        (**self).at(handle)
    }
    fn try_at(&self, handle: usize) -> Result<WeightView<'_>, String> {
        (**self).try_at(handle)
    }
}

// ---------------------------------------------------------------------------------------------
// Opening: which compiled-in engine fits an archive.

/// One architecture description thin-codegen knows, compiled into this binary or not.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KnownArch {
    /// The description's file stem, which is also its cargo feature (`smollm2-135m`).
    pub name: &'static str,
    pub family: crate::arch::Family,
    /// `ShapeDims::fingerprint()` of the description's dims.
    pub fingerprint: &'static str,
    /// The constants the description's engine is compiled with.
    pub math: MathConstants,
    /// The description's `[tensors]`: how importers name the family's tensors.
    pub tensors: crate::names::TensorNames,
}

/// An engine compiled into this binary, and how to build it over weights of type `W`.
pub struct CompiledEngine<W> {
    pub arch: &'static str,
    pub family: crate::arch::Family,
    pub fingerprint: &'static str,
    /// The constants baked into the engine; an archive that records others is refused at open.
    pub math: MathConstants,
    /// Positions its KV cache holds (the generated module's `consts::MAX_SEQ`).
    pub max_seq: usize,
    /// Bind the engine's weights (a missing or misshapen tensor is an error here, not mid-token).
    pub open: fn(W) -> Result<Box<dyn Engine + Send>, EngineError>,
    /// The same engine as [`HostLayers`], for the layers a GPU engine keeps on the host.
    pub open_host: fn(W) -> Result<Box<dyn HostLayers + Send>, EngineError>,
}

/// Llama 3 RoPE frequency scaling as a description states it (static twin of
/// [`crate::arch::RopeScaling`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeScalingConstants {
    pub rope_type: &'static str,
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: u64,
}

/// The math constants a generated engine bakes in. The shape fingerprint does not cover them, so
/// two models with equal shapes but another RoPE base (say) would otherwise run on the wrong engine
/// and produce plausible garbage; [`MathConstants::mismatches`] compares them with the manifest.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MathConstants {
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// RoPE base of sliding-window layers, where it differs.
    pub rope_local_theta: Option<f64>,
    pub rope_scaling: Option<RopeScalingConstants>,
    /// Layers that apply no RoPE, ascending.
    pub no_rope_layers: &'static [u64],
    pub attn_logit_softcap: Option<f64>,
    pub final_logit_softcap: Option<f64>,
    pub sliding_window: Option<u64>,
    /// Factor on the token embedding (1 or `sqrt(hidden)`).
    pub embedding_scale: f64,
    /// Factor on the attention logits (`head_dim^-0.5` or `query_pre_attn_scalar^-0.5`).
    pub attention_scale: f64,
}

/// One constant that differs between an archive and an engine, both sides rendered for the message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MathMismatch {
    pub constant: &'static str,
    pub archive: String,
    pub engine: String,
}

impl std::fmt::Display for MathMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: the archive has {}, the engine {}", self.constant, self.archive, self.engine)
    }
}

/// Relative tolerance of float constants. Manifests record what the source wrote: GGUF metadata
/// holds f32 (1e-5 arrives as 9.99999974738e-6), config.json holds decimal text, descriptions f64;
/// an f32 round trip is off by at most 2^-24 (6e-8) relative, so 1e-6 accepts every rounding of
/// the same constant and refuses any real difference (the closest real ones differ by percents).
pub const MATH_REL_TOLERANCE: f64 = 1e-6;

fn close(a: f64, b: f64) -> bool {
    a == b || (a - b).abs() <= MATH_REL_TOLERANCE * a.abs().max(b.abs())
}

fn show_f(v: Option<f64>) -> String {
    v.map_or_else(|| "none".to_string(), |x| x.to_string())
}

fn show_u(v: Option<u64>) -> String {
    v.map_or_else(|| "none".to_string(), |x| x.to_string())
}

impl MathConstants {
    /// Every constant on which `arch` (a manifest's record) and this engine differ, in a fixed order.
    pub fn mismatches(&self, arch: &crate::arch::ArchConfig) -> Vec<MathMismatch> {
        let mut out = Vec::new();
        let mut float = |constant: &'static str, archive: Option<f64>, engine: Option<f64>| {
            let same = match (archive, engine) {
                (Some(a), Some(e)) => close(a, e),
                (None, None) => true,
                _ => false,
            };
            if !same {
                out.push(MathMismatch { constant, archive: show_f(archive), engine: show_f(engine) });
            }
        };
        float("rms norm eps", Some(arch.rms_norm_eps), Some(self.rms_norm_eps));
        float("rope theta", Some(arch.rope.theta), Some(self.rope_theta));
        float("rope local theta", arch.rope.local_theta, self.rope_local_theta);
        // An archive that records no RoPE scaling is not compared on it: llama.cpp's GGUF files of
        // Llama 3 models carry the llama3 frequency factors as a `rope_freqs` tensor, not as
        // metadata, so "none" there means "not recorded" (HF configs always record it).
        let (a, e) = (arch.rope.scaling.as_ref(), self.rope_scaling.as_ref().filter(|_| arch.rope.scaling.is_some()));
        float("rope scaling factor", a.map(|s| s.factor), e.map(|s| s.factor));
        float("rope scaling low_freq_factor", a.map(|s| s.low_freq_factor), e.map(|s| s.low_freq_factor));
        float("rope scaling high_freq_factor", a.map(|s| s.high_freq_factor), e.map(|s| s.high_freq_factor));
        float("attention logit softcap", arch.attn_logit_softcap, self.attn_logit_softcap);
        float("final logit softcap", arch.final_logit_softcap, self.final_logit_softcap);
        float("embedding scale", Some(arch.embedding_scale()), Some(self.embedding_scale));
        float("attention scale", Some(arch.attention_scale()), Some(self.attention_scale));
        let mut exact = |constant: &'static str, archive: String, engine: String| {
            if archive != engine {
                out.push(MathMismatch { constant, archive, engine });
            }
        };
        exact("rope scaling type", a.map_or("none".into(), |s| s.rope_type.clone()), e.map_or("none".into(), |s| s.rope_type.to_string()));
        exact(
            "rope scaling original_max_position_embeddings",
            show_u(a.map(|s| s.original_max_position_embeddings)),
            show_u(e.map(|s| s.original_max_position_embeddings)),
        );
        exact("layers without rope", format!("{:?}", arch.no_rope_layers), format!("{:?}", self.no_rope_layers));
        exact("sliding window", show_u(arch.sliding_window), show_u(self.sliding_window));
        out
    }
}

/// Why no compiled-in engine fits an archive. Every variant names what the archive is and what
/// this binary has, so the message says what to rebuild or convert.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(
        "this `thin` was built without any architecture engine, and the archive is {archive}; \
         architecture features: {available}; rebuild with `cargo build --release --features {suggest}`"
    )]
    NoEngines { archive: String, available: String, suggest: String },
    #[error(
        "the archive is {archive}, but this `thin` was built for {compiled}; \
         rebuild with `cargo build --release --features {archive}`"
    )]
    NotCompiled { archive: String, compiled: String },
    #[error(
        "shape fingerprint mismatch: the archive is a {family} model with shape fingerprint {archive_fingerprint} \
         ({dims}), but this `thin`'s {family} engines are {engines}; no description in archs/ has the \
         archive's shapes (see archs/README.md, \"Adding an architecture\")"
    )]
    Fingerprint { family: &'static str, archive_fingerprint: String, dims: String, engines: String },
    #[error(
        "the archive is a {family} model (shape fingerprint {archive_fingerprint}) that no description in archs/ \
         matches, and this `thin` was built for {compiled}"
    )]
    UnknownArch { family: &'static str, archive_fingerprint: String, compiled: String },
    #[error("the manifest records shape fingerprint {recorded}, but its own dims give {computed}: the archive is inconsistent")]
    InconsistentFingerprint { recorded: String, computed: String },
    #[error("binding the archive's weights: {0}")]
    Weights(#[from] EngineError),
    #[error(
        "the archive has the shapes of {arch}, but its math constants differ from that engine's: {}; \
         convert the model again or describe it in archs/ (see archs/README.md)",
        mismatches.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
    )]
    MathConstants { arch: &'static str, mismatches: Vec<MathMismatch> },
}

/// For backends that pick their engine by fingerprint alone (the CUDA path through
/// `thin_generated::cuda_arch`): refuse an archive whose math constants differ from every known
/// description with its shapes. Shapes no description has pass here; selection reports those.
pub fn check_known_math(manifest: &crate::manifest::Manifest, known: &[KnownArch]) -> Result<(), OpenError> {
    let fits: Vec<&KnownArch> = known.iter().filter(|k| k.fingerprint == manifest.shape_fingerprint).collect();
    if fits.is_empty() || fits.iter().any(|k| k.math.mismatches(&manifest.arch).is_empty()) {
        return Ok(());
    }
    Err(OpenError::MathConstants { arch: fits[0].name, mismatches: fits[0].math.mismatches(&manifest.arch) })
}

fn list_engines<W>(engines: &[&CompiledEngine<W>]) -> String {
    engines.iter().map(|e| format!("{} (shape fingerprint {})", e.arch, e.fingerprint)).collect::<Vec<_>>().join(", ")
}

/// The compiled engine whose shape fingerprint equals the archive's (recomputed from the manifest's
/// dims and checked against the recorded one), or an error naming both sides.
/// `known` is every description codegen saw; `compiled` the engines built into this binary.
pub fn select_engine<'e, W>(
    manifest: &crate::manifest::Manifest,
    known: &[KnownArch],
    compiled: &'e [CompiledEngine<W>],
) -> Result<&'e CompiledEngine<W>, OpenError> {
    let dims = manifest.arch.dims.clone();
    let fp = dims.fingerprint();
    if fp != manifest.shape_fingerprint {
        return Err(OpenError::InconsistentFingerprint { recorded: manifest.shape_fingerprint.clone(), computed: fp });
    }
    // Equal shapes are not enough: the engine's baked-in constants must be the archive's too.
    let fits: Vec<&CompiledEngine<W>> = compiled.iter().filter(|e| e.fingerprint == fp).collect();
    if let Some(e) = fits.iter().find(|e| e.math.mismatches(&manifest.arch).is_empty()) {
        return Ok(e);
    }
    if let Some(e) = fits.first() {
        return Err(OpenError::MathConstants { arch: e.arch, mismatches: e.math.mismatches(&manifest.arch) });
    }
    let known_arch = known.iter().find(|k| k.fingerprint == fp);
    let family = dims.family.name();
    if compiled.is_empty() {
        let archive = match known_arch {
            Some(k) => k.name.to_string(),
            None => format!("a {family} model (shape fingerprint {fp}) that no description in archs/ matches"),
        };
        let available = known.iter().map(|k| k.name).collect::<Vec<_>>().join(", ");
        let suggest = known_arch.map_or("<arch>", |k| k.name).to_string();
        return Err(OpenError::NoEngines { archive, available, suggest });
    }
    let all: Vec<&CompiledEngine<W>> = compiled.iter().collect();
    if let Some(k) = known_arch {
        return Err(OpenError::NotCompiled { archive: k.name.to_string(), compiled: list_engines(&all) });
    }
    let same_family: Vec<&CompiledEngine<W>> = compiled.iter().filter(|e| e.family == dims.family).collect();
    if !same_family.is_empty() {
        return Err(OpenError::Fingerprint {
            family,
            archive_fingerprint: fp,
            dims: dims.normalized(),
            engines: list_engines(&same_family),
        });
    }
    Err(OpenError::UnknownArch { family, archive_fingerprint: fp, compiled: list_engines(&all) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::Family;
    use crate::arch::ArchConfig;
    use crate::format::testkit::{tiny_arch, tiny_manifest};

    /// The constants of [`tiny_arch`]: a Llama without scaling, eps 1e-5, theta 10000, head_dim 8.
    const TINY_MATH: MathConstants = MathConstants {
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_local_theta: None,
        rope_scaling: None,
        no_rope_layers: &[],
        attn_logit_softcap: None,
        final_logit_softcap: None,
        sliding_window: None,
        embedding_scale: 1.0,
        attention_scale: 0.353_553_390_593_273_8, // 8^-0.5
    };

    const NO_NAMES: crate::names::TensorNames = crate::names::TensorNames {
        roles: &[],
        hf_ignore: &[],
        gguf_ignore: &[],
        hf_ignore_prefixes: &[],
        hf_prefix_aliases: &[],
    };

    fn engine(arch: &'static str, family: Family, fingerprint: &'static str) -> CompiledEngine<()> {
        fn open(_: ()) -> Result<Box<dyn Engine + Send>, EngineError> {
            unreachable!("selection never opens")
        }
        fn open_host(_: ()) -> Result<Box<dyn HostLayers + Send>, EngineError> {
            unreachable!("selection never opens")
        }
        CompiledEngine { arch, family, fingerprint, math: TINY_MATH, max_seq: 64, open, open_host }
    }

    fn known(name: &'static str, fingerprint: &'static str) -> KnownArch {
        KnownArch { name, family: Family::Llama, fingerprint, math: TINY_MATH, tensors: NO_NAMES }
    }

    fn leak(s: String) -> &'static str {
        Box::leak(s.into_boxed_str())
    }

    #[test]
    fn selection_names_both_sides() {
        let m = tiny_manifest(tiny_arch(2, true));
        let fp = leak(m.shape_fingerprint.clone());
        let other = leak(tiny_manifest(tiny_arch(3, true)).shape_fingerprint);
        let known = [
            known("tiny-2", fp),
            known("tiny-3", other),
        ];

        let fits = [engine("tiny-3", Family::Llama, other), engine("tiny-2", Family::Llama, fp)];
        assert_eq!(select_engine(&m, &known, &fits).map(|e| e.arch).ok(), Some("tiny-2"));

        let e = select_engine(&m, &known, &fits[..1]).err().expect("not compiled").to_string();
        assert!(e.contains("the archive is tiny-2") && e.contains("built for tiny-3") && e.contains("--features tiny-2"), "{e}");

        let e = select_engine(&m, &known[1..], &fits[..1]).err().expect("unknown shapes").to_string();
        assert!(e.contains(fp) && e.contains(other) && e.contains("tiny-3"), "{e}");

        let gemma = [engine("g", Family::Gemma3, other)];
        let e = select_engine(&m, &known[1..], &gemma).err().expect("other family").to_string();
        assert!(e.contains("llama model") && e.contains("built for g"), "{e}");

        let e = select_engine::<()>(&m, &known, &[]).err().expect("no engines").to_string();
        assert!(e.contains("tiny-2, tiny-3") && e.contains("cargo build --release --features tiny-2"), "{e}");

        let mut bad = m.clone();
        bad.shape_fingerprint = other.to_string();
        assert!(matches!(select_engine(&bad, &known, &fits), Err(OpenError::InconsistentFingerprint { .. })));
    }

    /// One mutation of the manifest per constant: the constant's name in the message, and the
    /// archive's value before the engine's.
    fn math_mutations() -> Vec<(&'static str, &'static str, Box<dyn Fn(&mut ArchConfig)>)> {
        use crate::arch::RopeScaling;
        vec![
            ("rms norm eps", "the archive has 0.000001, the engine 0.00001", Box::new(|a| a.rms_norm_eps = 1e-6)),
            ("rope theta", "the archive has 100000, the engine 10000", Box::new(|a| a.rope.theta = 100000.0)),
            ("rope local theta", "the archive has 10000, the engine none", Box::new(|a| a.rope.local_theta = Some(10000.0))),
            (
                "rope scaling factor",
                "the archive has 8, the engine none",
                Box::new(|a| {
                    a.rope.scaling = Some(RopeScaling {
                        rope_type: "llama3".into(),
                        factor: 8.0,
                        low_freq_factor: 1.0,
                        high_freq_factor: 4.0,
                        original_max_position_embeddings: 8192,
                    })
                }),
            ),
            ("layers without rope", "the archive has [1], the engine []", Box::new(|a| a.no_rope_layers = vec![1])),
            ("attention logit softcap", "the archive has 50, the engine none", Box::new(|a| a.attn_logit_softcap = Some(50.0))),
            ("final logit softcap", "the archive has 30, the engine none", Box::new(|a| a.final_logit_softcap = Some(30.0))),
            ("sliding window", "the archive has 512, the engine none", Box::new(|a| a.sliding_window = Some(512))),
            ("attention scale", "the archive has 0.25, the engine 0.3535533905932738", Box::new(|a| a.query_pre_attn_scalar = Some(16.0))),
        ]
    }

    #[test]
    fn every_math_constant_is_checked_at_open() {
        let m = tiny_manifest(tiny_arch(2, true));
        let fp = leak(m.shape_fingerprint.clone());
        let fits = [engine("tiny-2", Family::Llama, fp)];
        let known = [known("tiny-2", fp)];
        assert_eq!(select_engine(&m, &known, &fits).map(|e| e.arch).ok(), Some("tiny-2"));
        assert!(check_known_math(&m, &known).is_ok());
        for (constant, values, mutate) in math_mutations() {
            let mut bad = m.clone();
            mutate(&mut bad.arch);
            assert_eq!(bad.shape_fingerprint, bad.arch.shape_fingerprint(), "{constant}: math is not shape");
            let e = select_engine(&bad, &known, &fits).err().unwrap_or_else(|| panic!("{constant} not refused"));
            let OpenError::MathConstants { arch, mismatches } = &e else { panic!("{constant}: {e}") };
            assert_eq!(*arch, "tiny-2");
            assert_eq!(mismatches[0].constant, constant, "{e}");
            let msg = e.to_string();
            assert!(msg.contains(&format!("{constant}: {values}")), "{msg}");
            assert!(check_known_math(&bad, &known).is_err(), "{constant}: the CUDA-path check refuses it too");
        }
        // Each scaling field alone.
        let scaled = |f: &dyn Fn(&mut crate::arch::RopeScaling)| {
            let mut s = crate::arch::RopeScaling {
                rope_type: "llama3".into(),
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            };
            f(&mut s);
            s
        };
        let mut engine_math = TINY_MATH;
        engine_math.rope_scaling = Some(RopeScalingConstants {
            rope_type: "llama3",
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        });
        for (constant, f) in [
            ("rope scaling factor", Box::new(|s: &mut crate::arch::RopeScaling| s.factor = 32.0) as Box<dyn Fn(&mut _)>),
            ("rope scaling low_freq_factor", Box::new(|s: &mut crate::arch::RopeScaling| s.low_freq_factor = 2.0)),
            ("rope scaling high_freq_factor", Box::new(|s: &mut crate::arch::RopeScaling| s.high_freq_factor = 8.0)),
            ("rope scaling type", Box::new(|s: &mut crate::arch::RopeScaling| s.rope_type = "linear".into())),
            ("rope scaling original_max_position_embeddings", Box::new(|s: &mut crate::arch::RopeScaling| s.original_max_position_embeddings = 4096)),
        ] {
            let mut a = tiny_arch(2, true);
            a.rope.scaling = Some(scaled(&|_| {}));
            assert!(engine_math.mismatches(&a).is_empty());
            a.rope.scaling = Some(scaled(&*f));
            let got = engine_math.mismatches(&a);
            assert_eq!(got.iter().map(|m| m.constant).collect::<Vec<_>>(), vec![constant]);
        }
        // An archive with no scaling recorded (a GGUF of Llama 3 carries it as a rope_freqs
        // tensor) is not refused by an engine that scales.
        let mut a = tiny_arch(2, true);
        a.rope.scaling = None;
        assert!(engine_math.mismatches(&a).is_empty(), "{:?}", engine_math.mismatches(&a));
        // Embedding scale follows the family: a Gemma manifest against a Llama-constant engine.
        let mut g = tiny_arch(2, true);
        g.dims.family = Family::Gemma3;
        let got = TINY_MATH.mismatches(&g);
        assert_eq!(got.iter().map(|m| m.constant).collect::<Vec<_>>(), vec!["embedding scale"]);
        assert_eq!(got[0].to_string(), "embedding scale: the archive has 4, the engine 1");
    }

    #[test]
    fn float_constants_survive_an_f32_round_trip() {
        let mut a = tiny_arch(2, true);
        // GGUF stores f32: these are what a manifest converted from GGUF records.
        a.rms_norm_eps = f64::from(1e-5f32);
        a.rope.theta = f64::from(10000.0f32);
        assert!(TINY_MATH.mismatches(&a).is_empty());
        a.rms_norm_eps = 1e-5 * (1.0 + 2e-6);
        assert_eq!(TINY_MATH.mismatches(&a).len(), 1, "2e-6 relative is past the tolerance");
    }

    #[test]
    fn an_engine_with_matching_math_wins_among_equal_shapes() {
        let m = tiny_manifest(tiny_arch(2, true));
        let fp = leak(m.shape_fingerprint.clone());
        let mut other = engine("tiny-2-theta", Family::Llama, fp);
        other.math.rope_theta = 500000.0;
        let fits = [other, engine("tiny-2", Family::Llama, fp)];
        assert_eq!(select_engine(&m, &[], &fits).map(|e| e.arch).ok(), Some("tiny-2"));
        let e = select_engine(&m, &[], &fits[..1]).err().expect("theta differs").to_string();
        assert!(e.contains("tiny-2-theta") && e.contains("rope theta: the archive has 10000, the engine 500000"), "{e}");
    }
}
