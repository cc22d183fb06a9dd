//! The engine interface generated engines implement, and the weights view they read.

use crate::role::Role;

/// A failure inside an engine step; every variant names what was wrong.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("weight {role:?} (layer {layer:?}) is missing")]
    MissingWeight { role: Role, layer: Option<u32> },
    #[error("weight {role:?} (layer {layer:?}) has {got} elements, expected {expected}")]
    WeightSize { role: Role, layer: Option<u32>, expected: usize, got: usize },
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

/// A borrowed tensor in the element type it is stored in.
#[derive(Debug, Clone, Copy)]
pub enum WeightView<'a> {
    F32(&'a [f32]),
    Bf16(&'a [half::bf16]),
}

impl WeightView<'_> {
    pub fn len(&self) -> usize {
        match self {
            WeightView::F32(w) => w.len(),
            WeightView::Bf16(w) => w.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i` as f32.
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            WeightView::F32(w) => w[i],
            WeightView::Bf16(w) => w[i].to_f32(),
        }
    }

    /// Elements `start..end` (one expert of a stacked MoE tensor).
    pub fn slice(&self, start: usize, end: usize) -> WeightView<'_> {
        match self {
            WeightView::F32(w) => WeightView::F32(&w[start..end]),
            WeightView::Bf16(w) => WeightView::Bf16(&w[start..end]),
        }
    }

    /// Copy out as f32 (norm vectors are small; the hot matvecs read the view directly).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self {
            WeightView::F32(w) => w.to_vec(),
            WeightView::Bf16(w) => w.iter().map(|x| x.to_f32()).collect(),
        }
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

    fn get(&self, role: Role, layer: Option<u32>) -> Option<WeightView<'_>> {
        self.find(role, layer).map(|h| self.at(h))
    }

    /// The handle of (role, layer), its element count checked once here.
    fn bind(&self, role: Role, layer: Option<u32>, expected: usize) -> Result<usize, EngineError> {
        let h = self.find(role, layer).ok_or(EngineError::MissingWeight { role, layer })?;
        let got = self.at(h).len();
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
        // A tensor whose pages or type the engine cannot read is empty here, so `bind` refuses it
        // by its size; a bound handle reads the same bytes every time (the mmap is immutable).
        self.tensor_view(handle).unwrap_or(WeightView::F32(&[]))
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
}

// ---------------------------------------------------------------------------------------------
// Opening: which compiled-in engine fits an archive.

/// One architecture description thin-codegen knows, compiled into this binary or not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnownArch {
    /// The description's file stem, which is also its cargo feature (`smollm2-135m`).
    pub name: &'static str,
    pub family: crate::arch::Family,
    /// `ShapeDims::fingerprint()` of the description's dims.
    pub fingerprint: &'static str,
}

/// An engine compiled into this binary, and how to build it over weights of type `W`.
pub struct CompiledEngine<W> {
    pub arch: &'static str,
    pub family: crate::arch::Family,
    pub fingerprint: &'static str,
    /// Bind the engine's weights (a missing or misshapen tensor is an error here, not mid-token).
    pub open: fn(W) -> Result<Box<dyn Engine + Send>, EngineError>,
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
    let dims = manifest.arch.shape_dims();
    let fp = dims.fingerprint();
    if fp != manifest.shape_fingerprint {
        return Err(OpenError::InconsistentFingerprint { recorded: manifest.shape_fingerprint.clone(), computed: fp });
    }
    if let Some(e) = compiled.iter().find(|e| e.fingerprint == fp) {
        return Ok(e);
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
    use crate::format::testkit::{tiny_arch, tiny_manifest};

    fn engine(arch: &'static str, family: Family, fingerprint: &'static str) -> CompiledEngine<()> {
        fn open(_: ()) -> Result<Box<dyn Engine + Send>, EngineError> {
            unreachable!("selection never opens")
        }
        CompiledEngine { arch, family, fingerprint, open }
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
            KnownArch { name: "tiny-2", family: Family::Llama, fingerprint: fp },
            KnownArch { name: "tiny-3", family: Family::Llama, fingerprint: other },
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
}
