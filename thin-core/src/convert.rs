//! `thin convert`: source model -> quantization plan -> folded, re-laid-out tensors -> `.thin` archive.
//!
//! Everything that can fail on the source (names, shapes, missing tensors, dtypes) is checked
//! before the output file is created, so a bad source never leaves anything behind.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use rayon::prelude::*;

use crate::arch::{ArchConfig, Family};
use crate::codec::{self, CodecError};
use crate::dtype::SourceDType;
use crate::format::{ArchiveWriter, FormatError};
use crate::gguf::{GgufError, GgufFile};
use crate::manifest::{BackendHints, Manifest, SourceInfo, TensorEntry, Validation, MANIFEST_FORMAT};
use crate::engine::KnownArch;
use crate::names::{NameError, NameMatch, NameTable};
use crate::codecs;
use crate::quant::{plan_quantization, PlanInput, Profile, QuantMethod, QuantizationDescriptor};
use crate::weight_format::WeightLayout;
use crate::role::Role;
use crate::safetensors_dir::{HfDir, SafetensorsError};
use crate::source::{SourceKind, SourceModel, SourceTensor};

/// Page alignment the archive writer uses (DESIGN: 4 KiB at least); recorded as a backend hint.
pub const PAGE_ALIGNMENT: u64 = 4096;

/// Elements decoded per rayon task: large enough to amortise scheduling, small enough to spread
/// a single tensor over every core.
const CHUNK_ELEMS: u64 = 1 << 16;

#[derive(Debug, Clone)]
pub struct ConvertOptions {
    pub profile: Profile,
    /// Let a profile quantize tensors the source stores as quantized blocks (llama-quantize's flag).
    pub allow_requantize: bool,
    pub progress: bool,
    /// Every description codegen knows (`thin_generated::KNOWN_ARCHS`): the source's tensor names
    /// are resolved with the `[tensors]` table of its family's descriptions.
    pub archs: &'static [KnownArch],
}

#[derive(Debug, Clone)]
pub struct ConvertReport {
    pub output: PathBuf,
    pub tensors: usize,
    /// Bytes of tensor data written.
    pub bytes_written: u64,
    pub seconds: f64,
    pub gb_per_s: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    #[error("{path}: no such file or directory")]
    SourceNotFound { path: PathBuf },
    #[error("{path}: neither a .gguf file nor a Hugging Face model directory")]
    UnknownSource { path: PathBuf },
    #[error("the output {out} is the source file {input} (or links to it): writing it would replace the model being read")]
    OutputIsInput { out: PathBuf, input: PathBuf },
    #[error(transparent)]
    Safetensors(#[from] SafetensorsError),
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Name(#[from] NameError),
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error("the source's tokenizer: {0}")]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    #[error("tensor `{tensor}`: decoding {dtype}: {source}")]
    Codec { tensor: String, dtype: &'static str, source: CodecError },
    #[error("tensor `{tensor}` ({role} layer {layer:?}): shape {got:?}, the config says {expected:?}")]
    Shape { tensor: String, role: &'static str, layer: Option<u32>, expected: Vec<u64>, got: Vec<u64> },
    #[error("tensors `{first}` and `{second}` both map to {canonical}")]
    DuplicateRole { canonical: String, first: String, second: String },
    #[error("tensor `{tensor}`: layer {layer} is past num_layers {num_layers}")]
    LayerOutOfRange { tensor: String, layer: u32, num_layers: u64 },
    #[error("missing tensor {canonical} ({family} needs it)")]
    MissingTensor { canonical: String, family: &'static str },
    #[error("the config declares {declared} {what}, but the source's tensors hold {present}")]
    DeclaredCount { what: &'static str, declared: u64, present: u64 },
    #[error("{canonical}: experts {missing:?} missing (num_experts {num_experts})")]
    MissingExperts { canonical: String, missing: Vec<u32>, num_experts: u64 },
    #[error("{canonical}: experts mix dtypes/shapes ({first} vs {other})")]
    MixedExperts { canonical: String, first: String, other: String },
    #[error("tensor `{tensor}`: {what}")]
    Transform { tensor: String, what: String },
    #[error(transparent)]
    Quant(#[from] crate::quant::QuantError),
    #[error("rope_freqs.weight: {0}")]
    RopeFreqs(String),
}

/// A constant transform applied on f32 values after decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transform {
    None,
    /// Gemma `(1 + w)` norm weights, folded once so the engine multiplies by `w` only.
    AddOne,
    /// Undo llama.cpp's rotary row interleave on Q/K (`n_head` heads).
    UnpermuteRows {
        n_head: u64,
    },
}

/// One tensor of the archive, with the source tensors it is made from.
#[derive(Debug)]
struct Job<'s, 'a> {
    canonical: String,
    role: Role,
    layer: Option<u32>,
    shape: Vec<u64>,
    source_dtype: SourceDType,
    source_name: String,
    /// One tensor, or one per expert (in expert order) when experts are stacked.
    parts: Vec<&'s SourceTensor<'a>>,
    transform: Transform,
}

/// Inverse of llama.cpp's `permute`: `w.reshape(n_head, 2, rows/n_head/2, cols).swapaxes(1, 2)`.
/// GGUF row `h*hd + 2j + i` holds HF row `h*hd + i*hd/2 + j`.
/// `cols` is the row's length in `T`s: f32 values, or the bytes of a row of GGUF blocks (moving
/// whole rows of blocks is exact).
pub fn unpermute_qk_rows<T: Copy + Default + Send + Sync>(w: &[T], rows: usize, cols: usize, n_head: usize) -> Result<Vec<T>, String> {
    if n_head == 0 || rows % (2 * n_head) != 0 || w.len() != rows * cols {
        return Err(format!("cannot unpermute {rows}x{cols} rows over {n_head} heads"));
    }
    let hd = rows / n_head;
    let half = hd / 2;
    let mut out = vec![T::default(); w.len()];
    out.par_chunks_mut(cols.max(1)).enumerate().for_each(|(hf_row, dst)| {
        let (h, r) = (hf_row / hd, hf_row % hd);
        let (i, j) = (r / half, r % half);
        let src = h * hd + 2 * j + i;
        dst.copy_from_slice(&w[src * cols..(src + 1) * cols]);
    });
    Ok(out)
}

/// Gemma 3 RMSNorm multiplies by `1 + w`; store the sum.
pub fn fold_add_one(w: &mut [f32]) {
    w.iter_mut().for_each(|x| *x += 1.0);
}

/// The shape a role must have under `arch`, when the config decides it.
pub fn expected_shape(arch: &ArchConfig, role: Role) -> Vec<u64> {
    // Saturating: declared dims are file data; an overflowing width can match no tensor.
    let (h, q, kv) = (
        arch.dims.hidden_size,
        arch.dims.num_heads.saturating_mul(arch.dims.head_dim),
        arch.dims.num_kv_heads.saturating_mul(arch.dims.head_dim),
    );
    let (i, e) = (arch.dims.intermediate_size, arch.dims.num_experts);
    // OLMoE normalises the whole Q/K projection; Gemma 3 normalises per head.
    let (qn, kn) = match arch.dims.family {
        Family::Olmoe => (q, kv),
        Family::Llama | Family::Smollm3 | Family::Gemma3 => (arch.dims.head_dim, arch.dims.head_dim),
    };
    match role {
        Role::TokenEmbd | Role::LmHead => vec![arch.dims.vocab_size, h],
        Role::OutputNorm | Role::AttnNorm | Role::AttnPostNorm | Role::FfnNorm | Role::FfnPostNorm => vec![h],
        Role::AttnQ => vec![q, h],
        Role::AttnK | Role::AttnV => vec![kv, h],
        Role::AttnO => vec![h, q],
        Role::AttnQNorm => vec![qn],
        Role::AttnKNorm => vec![kn],
        Role::FfnGate | Role::FfnUp => vec![i, h],
        Role::FfnDown => vec![h, i],
        Role::MoeRouter => vec![e, h],
        Role::MoeGate | Role::MoeUp => vec![e, i, h],
        Role::MoeDown => vec![e, h, i],
    }
}

fn transform_for(kind: SourceKind, arch: &ArchConfig, role: Role) -> Transform {
    match (kind, arch.dims.family) {
        (SourceKind::Safetensors, Family::Gemma3) if role.is_norm() => Transform::AddOne,
        (SourceKind::Gguf, Family::Llama | Family::Smollm3) => match role {
            Role::AttnQ => Transform::UnpermuteRows { n_head: arch.dims.num_heads },
            Role::AttnK => Transform::UnpermuteRows { n_head: arch.dims.num_kv_heads },
            _ => Transform::None,
        },
        _ => Transform::None,
    }
}

/// Archive order: token embedding, then layer by layer in role order, then the output side.
fn order_key(role: Role, layer: Option<u32>) -> (u64, Role) {
    match (role, layer) {
        (_, Some(l)) => (u64::from(l) + 1, role),
        (Role::TokenEmbd, None) => (0, role),
        (_, None) => (u64::MAX, role),
    }
}

/// A layer's experts of one role (HF OLMoE stores one tensor per expert): layer, expert -> tensor.
type ExpertSlot<'s, 'a> = (Option<u32>, BTreeMap<u32, &'s SourceTensor<'a>>);

fn build_jobs<'s, 'a>(model: &'s SourceModel<'a>, names: &NameTable) -> Result<Vec<Job<'s, 'a>>, ConvertError> {
    let arch = &model.arch;
    let family = arch.dims.family;
    let mut singles: BTreeMap<(u64, Role), Job<'s, 'a>> = BTreeMap::new();
    // (key) -> expert -> tensor, for HF OLMoE's one-tensor-per-expert layout.
    let mut experts: BTreeMap<(u64, Role), ExpertSlot<'s, 'a>> = BTreeMap::new();
    for t in &model.tensors {
        let NameMatch::Tensor { role, layer, expert } = names.resolve(model.kind, &t.name)? else {
            continue;
        };
        if let Some(l) = layer {
            if u64::from(l) >= arch.dims.num_layers {
                return Err(ConvertError::LayerOutOfRange {
                    tensor: t.name.clone(),
                    layer: l,
                    num_layers: arch.dims.num_layers,
                });
            }
        }
        let key = order_key(role, layer);
        if let Some(e) = expert {
            let slot = experts.entry(key).or_insert_with(|| (layer, BTreeMap::new()));
            if let Some(prev) = slot.1.insert(e, t) {
                return Err(ConvertError::DuplicateRole {
                    canonical: format!("{} expert {e}", role.tensor_name(layer)),
                    first: prev.name.clone(),
                    second: t.name.clone(),
                });
            }
            continue;
        }
        let job = Job {
            canonical: role.tensor_name(layer),
            role,
            layer,
            shape: t.shape.clone(),
            source_dtype: t.dtype,
            source_name: t.name.clone(),
            parts: vec![t],
            transform: transform_for(model.kind, arch, role),
        };
        if let Some(prev) = singles.insert(key, job) {
            return Err(ConvertError::DuplicateRole {
                canonical: role.tensor_name(layer),
                first: prev.source_name,
                second: t.name.clone(),
            });
        }
    }
    let num_experts = arch.dims.num_experts;
    for (key, (layer, by_expert)) in experts {
        let role = key.1;
        let canonical = role.tensor_name(layer);
        if by_expert.len() as u64 != num_experts || by_expert.keys().any(|&e| u64::from(e) >= num_experts) {
            // The first few missing: at most len + 16 indices are looked at, whatever num_experts says.
            let missing: Vec<u32> =
                (0..num_experts).map_while(|e| u32::try_from(e).ok()).filter(|e| !by_expert.contains_key(e)).take(16).collect();
            return Err(ConvertError::MissingExperts { canonical, missing, num_experts });
        }
        let parts: Vec<&SourceTensor<'a>> = by_expert.into_values().collect();
        let first = parts[0];
        if let Some(odd) = parts.iter().find(|p| p.dtype != first.dtype || p.shape != first.shape) {
            return Err(ConvertError::MixedExperts {
                canonical,
                first: format!("{} {} {:?}", first.name, first.dtype.name(), first.shape),
                other: format!("{} {} {:?}", odd.name, odd.dtype.name(), odd.shape),
            });
        }
        let mut shape = vec![num_experts];
        shape.extend_from_slice(&first.shape);
        let source_name = first.name.replace(".experts.0.", ".experts.{E}.");
        let job = Job {
            canonical: canonical.clone(),
            role,
            layer,
            shape,
            source_dtype: first.dtype,
            source_name: source_name.clone(),
            parts,
            transform: transform_for(model.kind, arch, role),
        };
        if let Some(prev) = singles.insert(key, job) {
            return Err(ConvertError::DuplicateRole { canonical, first: prev.source_name, second: source_name });
        }
    }
    // Completeness and shapes, before anything is written.
    // The description lists every role of the family; the LM head is read only when untied.
    let roles: Vec<Role> = names.roles().filter(|r| *r != Role::LmHead || !arch.dims.tie_word_embeddings).collect();
    let mut required: Vec<(Role, Option<u32>)> =
        roles.iter().filter(|r| !r.is_per_layer()).map(|r| (*r, None)).collect();
    // The declared layer count, bounded by the layers present before the list is built from it.
    let present = singles.values().filter_map(|j| j.layer).collect::<std::collections::BTreeSet<u32>>().len() as u64;
    if arch.dims.num_layers > present {
        return Err(ConvertError::DeclaredCount { what: "layers", declared: arch.dims.num_layers, present });
    }
    for l in 0..arch.dims.num_layers {
        let l = u32::try_from(l).map_err(|_| ConvertError::LayerOutOfRange {
            tensor: String::new(),
            layer: u32::MAX,
            num_layers: arch.dims.num_layers,
        })?;
        required.extend(roles.iter().filter(|r| r.is_per_layer()).map(|r| (*r, Some(l))));
    }
    for (role, layer) in required {
        if !singles.contains_key(&order_key(role, layer)) {
            return Err(ConvertError::MissingTensor { canonical: role.tensor_name(layer), family: family.name() });
        }
    }
    for job in singles.values() {
        let expected = expected_shape(arch, job.role);
        if job.shape != expected {
            return Err(ConvertError::Shape {
                tensor: job.source_name.clone(),
                role: job.role.name(),
                layer: job.layer,
                expected,
                got: job.shape.clone(),
            });
        }
    }
    Ok(singles.into_values().collect())
}

/// Decode `bytes` of `dtype` into `out`, in parallel over whole-block chunks.
fn decode_parallel(tensor: &str, dtype: SourceDType, bytes: &[u8], out: &mut [f32]) -> Result<(), ConvertError> {
    let (per, block_bytes) = dtype.block();
    let blocks = (CHUNK_ELEMS / per).max(1);
    let chunk_elems = (blocks * per) as usize;
    let chunk_bytes = (blocks * block_bytes) as usize;
    let n = out.len() as u64;
    if dtype.bytes_for(n) != Some(bytes.len() as u64) {
        return Err(ConvertError::Transform {
            tensor: tensor.to_string(),
            what: format!("{} bytes do not hold {n} {} elements", bytes.len(), dtype.name()),
        });
    }
    out.par_chunks_mut(chunk_elems)
        .zip(bytes.par_chunks(chunk_bytes))
        .try_for_each(|(o, b)| codec::decode_to_f32(dtype, b, o))
        .map_err(|source| ConvertError::Codec { tensor: tensor.to_string(), dtype: dtype.name(), source })
}

fn encode_parallel(src: &[f32], f: fn(&[f32], &mut Vec<u8>)) -> Vec<u8> {
    let parts: Vec<Vec<u8>> = src
        .par_chunks(CHUNK_ELEMS as usize)
        .map(|c| {
            let mut v = Vec::new();
            f(c, &mut v);
            v
        })
        .collect();
    parts.concat()
}

/// Quantizes `values` (`[rows, cols]`) row by row in parallel: `f(rows_of_x, rows_of_out)` over
/// chunks of whole rows, each row taking `out_per_row` bytes of `out`.
fn per_rows<T: Copy + Default + Send>(
    values: &[f32],
    cols: usize,
    out_per_row: usize,
    f: impl Fn(&[f32], &mut [T]) -> Result<(), CodecError> + Sync,
) -> Result<Vec<T>, CodecError> {
    let rows = if cols == 0 { 0 } else { values.len() / cols };
    let mut out = vec![T::default(); rows * out_per_row];
    let chunk_rows = (CHUNK_ELEMS as usize / cols.max(1)).max(1);
    if rows > 0 {
        values
            .par_chunks(chunk_rows * cols)
            .zip(out.par_chunks_mut(chunk_rows * out_per_row))
            .try_for_each(|(x, o)| f(x, o))?;
    }
    Ok(out)
}

/// The stored bytes of one job in `method`'s layout, and whether they are the source's bytes
/// unchanged (rows of blocks moved by the Q/K unpermute count as unchanged: no value is).
fn produce(job: &Job<'_, '_>, method: QuantMethod) -> Result<(Vec<u8>, bool, WeightLayout), ConvertError> {
    let layout = WeightLayout::of(method.storage_dtype(), &job.shape, method.postscale())
        .map_err(|e| ConvertError::Transform { tensor: job.canonical.clone(), what: e.to_string() })?;
    let same_encoding = matches!(
        (job.source_dtype, method),
        (SourceDType::Bf16, QuantMethod::Bf16) | (SourceDType::F32, QuantMethod::F32) | (SourceDType::Q8_0, QuantMethod::Q8_0) | (SourceDType::Q4_1, QuantMethod::Q4_1)
    );
    if same_encoding {
        let raw: Vec<u8> = job.parts.iter().flat_map(|p| p.bytes.iter().copied()).collect();
        match job.transform {
            Transform::None => return Ok((raw, true, layout)),
            Transform::UnpermuteRows { n_head } => {
                let row_bytes = (layout.value_bytes / layout.rows.max(1)) as usize;
                let rows = unpermute_qk_rows(&raw, layout.rows as usize, row_bytes, n_head as usize)
                    .map_err(|what| ConvertError::Transform { tensor: job.source_name.clone(), what })?;
                return Ok((rows, true, layout));
            }
            Transform::AddOne => {}
        }
    }
    let part_elems = job.parts.first().map_or(0, |p| p.shape.iter().product::<u64>()) as usize;
    let mut values = vec![0f32; part_elems * job.parts.len()];
    for (p, out) in job.parts.iter().zip(values.chunks_mut(part_elems.max(1))) {
        decode_parallel(&p.name, p.dtype, p.bytes, out)?;
    }
    match job.transform {
        Transform::None => {}
        Transform::AddOne => fold_add_one(&mut values),
        Transform::UnpermuteRows { n_head } => {
            let (rows, cols) = match job.shape.as_slice() {
                [r, c] => (*r as usize, *c as usize),
                _ => {
                    return Err(ConvertError::Transform {
                        tensor: job.source_name.clone(),
                        what: "Q/K unpermute needs a matrix".into(),
                    })
                }
            };
            values = unpermute_qk_rows(&values, rows, cols, n_head as usize)
                .map_err(|what| ConvertError::Transform { tensor: job.source_name.clone(), what })?;
        }
    }
    let codec_err = |source| ConvertError::Codec { tensor: job.canonical.clone(), dtype: method.name(), source };
    let cols = layout.cols as usize;
    let bytes = match method {
        QuantMethod::F32 => encode_parallel(&values, codec::f32_to_le_bytes),
        QuantMethod::Bf16 => encode_parallel(&values, codec::f32_to_bf16_bytes),
        QuantMethod::Q8_0 => per_rows(&values, cols, cols / 32 * codecs::q8_0::BLOCK_BYTES, |x, o| {
            x.chunks_exact(cols).zip(o.chunks_exact_mut(cols / 32 * codecs::q8_0::BLOCK_BYTES)).try_for_each(|(x, o)| codecs::q8_0::quantize_row(x, o))
        })
        .map_err(codec_err)?,
        QuantMethod::Q4_1 => per_rows(&values, cols, cols / 32 * codecs::q4_1::BLOCK_BYTES, |x, o| {
            x.chunks_exact(cols).zip(o.chunks_exact_mut(cols / 32 * codecs::q4_1::BLOCK_BYTES)).try_for_each(|(x, o)| codecs::q4_1::quantize_row(x, o))
        })
        .map_err(codec_err)?,
        QuantMethod::Fp8RowScale => {
            // Codes and the row scale side by side per row (`cols + 4` bytes), split after.
            let packed = per_rows(&values, cols, cols + 4, |x, o| {
                x.chunks_exact(cols).zip(o.chunks_exact_mut(cols + 4)).try_for_each(|(x, o)| {
                    let (v, s) = o.split_at_mut(cols);
                    s.copy_from_slice(&codecs::fp8::quantize_row(x, v)?.to_le_bytes());
                    Ok(())
                })
            })
            .map_err(codec_err)?;
            let (codes, scales): (Vec<&[u8]>, Vec<&[u8]>) = packed.chunks_exact(cols + 4).map(|r| r.split_at(cols)).unzip();
            layout.assemble(&codes.concat(), &[&scales.concat()])
        }
        QuantMethod::Mxfp4 | QuantMethod::Mxfp4RowScale => {
            // Per row: cols/2 code bytes, cols/32 exponents, 2 bytes of postscale.
            let (vb, sb) = (cols / 2, cols / 32);
            let post = method.postscale();
            let packed = per_rows(&values, cols, vb + sb + 2, |x, o| {
                x.chunks_exact(cols).zip(o.chunks_exact_mut(vb + sb + 2)).try_for_each(|(x, o)| {
                    let (v, rest) = o.split_at_mut(vb);
                    let (s, p) = rest.split_at_mut(sb);
                    if post {
                        let mut ps = [half::bf16::ONE];
                        codecs::mxfp4::quantize_with_postscale(x, cols, v, s, &mut ps)?;
                        p.copy_from_slice(&ps[0].to_le_bytes());
                    } else {
                        codecs::mxfp4::quantize(x, cols, v, s)?;
                    }
                    Ok(())
                })
            })
            .map_err(codec_err)?;
            let rows = packed.chunks_exact(vb + sb + 2);
            let codes: Vec<u8> = rows.clone().flat_map(|r| r[..vb].iter().copied()).collect();
            let exps: Vec<u8> = rows.clone().flat_map(|r| r[vb..vb + sb].iter().copied()).collect();
            let posts: Vec<u8> = rows.flat_map(|r| r[vb + sb..].iter().copied()).collect();
            if post {
                layout.assemble(&codes, &[&exps, &posts])
            } else {
                layout.assemble(&codes, &[&exps])
            }
        }
    };
    Ok((bytes, false, layout))
}

enum Opened {
    Gguf(GgufFile, String),
    Hf(Box<HfDir>),
}

fn open_source(src: &Path) -> Result<Opened, ConvertError> {
    if !src.exists() {
        return Err(ConvertError::SourceNotFound { path: src.to_path_buf() });
    }
    if src.is_dir() {
        return Ok(Opened::Hf(Box::new(HfDir::open(src)?)));
    }
    let is_gguf = src.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        || std::fs::File::open(src)
            .and_then(|mut f| {
                let mut m = [0u8; 4];
                std::io::Read::read_exact(&mut f, &mut m).map(|_| m == *b"GGUF")
            })
            .unwrap_or(false);
    if !is_gguf {
        return Err(ConvertError::UnknownSource { path: src.to_path_buf() });
    }
    let name = src.file_name().map_or_else(|| src.display().to_string(), |n| n.to_string_lossy().into_owned());
    Ok(Opened::Gguf(GgufFile::open(src)?, name))
}

/// `out` must not be (or link to) the source file, nor a file of the source directory: the
/// final rename would replace what is being read. Compared by canonical path, so links count.
fn refuse_output_among_inputs(src: &Path, out: &Path) -> Result<(), ConvertError> {
    let Ok(out_real) = out.canonicalize() else { return Ok(()) }; // no such file yet: nothing to replace
    let src_real = src.canonicalize().unwrap_or_else(|_| src.to_path_buf());
    let inside = src_real.is_dir() && out_real.parent() == Some(src_real.as_path());
    if out_real == src_real || inside {
        let input = if inside { out_real.clone() } else { src_real };
        return Err(ConvertError::OutputIsInput { out: out.to_path_buf(), input });
    }
    Ok(())
}

/// Convert a `.gguf` file or a Hugging Face directory at `src` into the archive `out`.
pub fn convert(src: &Path, out: &Path, opts: &ConvertOptions) -> Result<ConvertReport, ConvertError> {
    let start = Instant::now();
    refuse_output_among_inputs(src, out)?;
    let opened = open_source(src)?;
    let mut model = match &opened {
        Opened::Gguf(g, name) => g.source_model(name)?,
        Opened::Hf(d) => d.source_model()?,
    };
    rope_scaling_from_freqs(&mut model, opts.archs)?;
    convert_model(&model, out, opts, start)
}

/// Llama 3 RoPE frequency divisors as llama.cpp's converter computes them for `rope_freqs.weight`
/// (convert_hf_to_gguf.py, `LlamaModel.generate_extra_tensors`: the frequencies in f32, as torch
/// does, the rest as Python does): 1 for wavelengths below `old / high`, `factor` above `old / low`,
/// a smooth ramp between.
pub fn llama3_rope_factors(theta: f64, head_dim: u64, factor: f64, low: f64, high: f64, old: u64) -> Vec<f64> {
    let (old, dim) = (old as f64, head_dim as f32);
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0f32 / (theta as f32).powf((2 * i) as f32 / dim);
            let wavelen = 2.0 * std::f64::consts::PI / f64::from(freq);
            if wavelen < old / high {
                1.0
            } else if wavelen > old / low {
                factor
            } else {
                let smooth = (old / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

/// llama.cpp writes a Llama 3 model's RoPE scaling as `rope_freqs.weight` and no `rope.scaling.*`
/// keys. A GGUF with that tensor and no recorded scaling takes the llama3 constants of the
/// description with its shapes whose factors equal the tensor's (within 1e-5), so the archive
/// records what the file computes; factors that the descriptions of its shapes do not give are
/// refused rather than run with a RoPE the file does not have. All-ones factors (no scaling), and
/// shapes no description has (no engine opens them), change nothing.
pub fn rope_scaling_from_freqs(model: &mut SourceModel<'_>, archs: &[KnownArch]) -> Result<(), ConvertError> {
    if model.kind != SourceKind::Gguf || model.arch.rope.scaling.is_some() {
        return Ok(());
    }
    let Some(t) = model.tensors.iter().find(|t| t.name == "rope_freqs.weight") else { return Ok(()) };
    if t.dtype != SourceDType::F32 {
        return Err(ConvertError::RopeFreqs(format!("stored as {}, llama.cpp writes F32", t.dtype.name())));
    }
    let got: Vec<f32> = t.bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    let half = model.arch.dims.head_dim / 2;
    if got.len() as u64 != half {
        return Err(ConvertError::RopeFreqs(format!("{} values; head_dim {} has {half} frequencies", got.len(), model.arch.dims.head_dim)));
    }
    if got.iter().all(|&f| f == 1.0) {
        return Ok(());
    }
    let fp = model.arch.shape_fingerprint();
    let same_shapes: Vec<&KnownArch> = archs.iter().filter(|k| k.family == model.arch.dims.family && k.fingerprint == fp).collect();
    for k in &same_shapes {
        let Some(c) = k.math.rope_scaling.filter(|c| c.rope_type == "llama3") else { continue };
        let want = llama3_rope_factors(model.arch.rope.theta, model.arch.dims.head_dim, c.factor, c.low_freq_factor, c.high_freq_factor, c.original_max_position_embeddings);
        if want.iter().zip(&got).all(|(w, &g)| (w - f64::from(g)).abs() <= 1e-5 * w.abs()) {
            model.arch.rope.scaling = Some(crate::arch::RopeScaling {
                rope_type: c.rope_type.to_string(),
                factor: c.factor,
                low_freq_factor: c.low_freq_factor,
                high_freq_factor: c.high_freq_factor,
                original_max_position_embeddings: c.original_max_position_embeddings,
            });
            return Ok(());
        }
    }
    // No description has these shapes: nothing to check against, and no engine will open it.
    if same_shapes.is_empty() {
        return Ok(());
    }
    let names: Vec<&str> = same_shapes.iter().map(|k| k.name).collect();
    Err(ConvertError::RopeFreqs(format!("frequency factors {got:?} that the rope scaling of {} does not give", names.join(", "))))
}

/// Convert an already opened source model.
pub fn convert_model(
    model: &SourceModel<'_>,
    out: &Path,
    opts: &ConvertOptions,
    start: Instant,
) -> Result<ConvertReport, ConvertError> {
    let names = NameTable::for_family(opts.archs, model.arch.dims.family)?;
    // The tokenizer and chat template the archive will embed must load and render (bounded), so
    // a broken or runaway one is refused here, not at a user's first `thin run`.
    let tok = crate::tokenizer::TextTokenizer::from_info(&model.tokenizer)?;
    tok.check_chat_template()?;
    let jobs = build_jobs(model, &names)?;
    let inputs: Vec<PlanInput<'_>> = jobs
        .iter()
        .map(|j| PlanInput {
            name: &j.canonical,
            role: j.role,
            layer: j.layer,
            source_dtype: j.source_dtype,
            cols: j.shape.last().copied().unwrap_or(1),
        })
        .collect();
    let plan = plan_quantization(&opts.profile, model.arch.dims.num_layers, &inputs, opts.allow_requantize)?;
    let values: Vec<u64> = jobs.iter().map(|j| j.shape.iter().product()).collect();
    let total_src: u64 = jobs.iter().flat_map(|j| &j.parts).map(|p| p.bytes.len() as u64).sum();
    let bar = if opts.progress {
        let b = indicatif::ProgressBar::new(total_src);
        if let Ok(style) =
            indicatif::ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} {msg}")
        {
            b.set_style(style);
        }
        b
    } else {
        indicatif::ProgressBar::hidden()
    };

    let mut writer = ArchiveWriter::create(out)?;
    let mut bytes_written = 0u64;
    for (job, planned) in jobs.iter().zip(&plan) {
        bar.set_message(job.canonical.clone());
        let (bytes, exact, layout) = produce(job, planned.method)?;
        bytes_written += bytes.len() as u64;
        let entry = TensorEntry {
            name: job.canonical.clone(),
            role: job.role,
            layer: job.layer,
            shape: job.shape.clone(),
            dtype: layout.dtype,
            block_size: layout.block_size,
            scales: layout.scales,
            first_page: 0,
            page_count: 0,
            byte_len: 0,
            source_dtype: job.source_dtype,
            source_name: job.source_name.clone(),
            exact_storage_preserved: exact,
        };
        writer.add_tensor(entry, &bytes)?;
        bar.inc(job.parts.iter().map(|p| p.bytes.len() as u64).sum());
    }
    bar.finish_and_clear();

    let layouts = jobs.iter().map(|j| (j.role.name().to_string(), "row_major".to_string())).collect();
    let max_page_size = jobs.iter().map(|j| j.shape.iter().product::<u64>()).max().unwrap_or(0);
    let manifest = Manifest {
        format: MANIFEST_FORMAT.to_string(),
        arch: model.arch.clone(),
        shape_fingerprint: model.arch.shape_fingerprint(),
        tokenizer: model.tokenizer.clone(),
        tensors: Vec::new(),
        quantization: QuantizationDescriptor::from_plan(&opts.profile.name, plan, &values, model.source_config.clone()),
        backend_hints: BackendHints {
            alignment: PAGE_ALIGNMENT,
            max_page_size: max_page_size.saturating_mul(4),
            layouts,
        },
        validation: Validation { parameter_count: 0, tensor_count: 0, tensor_blake3: BTreeMap::new() },
        source: SourceInfo {
            kind: model.kind.name().to_string(),
            files: model.files.clone(),
            details: model.details.clone(),
        },
    };
    let output = writer.finish(manifest)?;
    let seconds = start.elapsed().as_secs_f64();
    Ok(ConvertReport {
        output,
        tensors: jobs.len(),
        bytes_written,
        seconds,
        gb_per_s: if seconds > 0.0 { bytes_written as f64 / seconds / 1e9 } else { 0.0 },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's `permute` as written in convert_hf_to_gguf.py.
    fn llama_cpp_permute(w: &[f32], rows: usize, cols: usize, n_head: usize) -> Vec<f32> {
        let half = rows / n_head / 2;
        let mut out = vec![0f32; w.len()];
        // reshape(n_head, 2, half, cols).swapaxes(1, 2) -> (n_head, half, 2, cols)
        for h in 0..n_head {
            for j in 0..half {
                for i in 0..2 {
                    let dst = h * 2 * half + j * 2 + i;
                    let src = h * 2 * half + i * half + j;
                    out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
                }
            }
        }
        out
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        for (n_head, hd, cols) in [(4, 8, 3), (2, 64, 5), (1, 2, 1), (3, 16, 7)] {
            let rows = n_head * hd;
            let w: Vec<f32> = (0..rows * cols).map(|x| x as f32).collect();
            let p = llama_cpp_permute(&w, rows, cols, n_head);
            if hd > 2 {
                assert_ne!(p, w, "permute must move rows for hd {hd}");
            }
            let back = unpermute_qk_rows(&p, rows, cols, n_head).expect("unpermute");
            assert_eq!(back, w);
        }
        // The first GGUF rows of a head interleave the two rotary halves.
        let w: Vec<f32> = (0..8).map(|x| x as f32).collect();
        assert_eq!(llama_cpp_permute(&w, 8, 1, 1), vec![0., 4., 1., 5., 2., 6., 3., 7.]);
        assert!(unpermute_qk_rows(&w, 8, 1, 3).is_err());
    }

    #[test]
    fn gemma_fold_adds_one_for_hf_gemma_only() {
        let mut w = vec![0.0, -1.0, 0.5];
        fold_add_one(&mut w);
        assert_eq!(w, vec![1.0, 0.0, 1.5]);
        let arch = test_arch(Family::Gemma3);
        for role in [
            Role::AttnNorm,
            Role::AttnQNorm,
            Role::AttnKNorm,
            Role::AttnPostNorm,
            Role::FfnNorm,
            Role::FfnPostNorm,
            Role::OutputNorm,
        ] {
            assert_eq!(transform_for(SourceKind::Safetensors, &arch, role), Transform::AddOne, "{role:?}");
            assert_eq!(
                transform_for(SourceKind::Gguf, &arch, role),
                Transform::None,
                "{role:?}: llama.cpp already folded"
            );
        }
        assert_eq!(transform_for(SourceKind::Safetensors, &arch, Role::AttnQ), Transform::None);
        let llama = test_arch(Family::Llama);
        assert_eq!(transform_for(SourceKind::Safetensors, &llama, Role::AttnNorm), Transform::None);
        assert_eq!(transform_for(SourceKind::Gguf, &llama, Role::AttnQ), Transform::UnpermuteRows { n_head: 4 });
        assert_eq!(transform_for(SourceKind::Gguf, &llama, Role::AttnK), Transform::UnpermuteRows { n_head: 2 });
        assert_eq!(transform_for(SourceKind::Gguf, &test_arch(Family::Olmoe), Role::AttnQ), Transform::None);
    }

    fn test_arch(family: Family) -> ArchConfig {
        let moe = family == Family::Olmoe;
        ArchConfig {
            dims: crate::arch::ShapeDims {
                family,
                vocab_size: 32,
                hidden_size: 16,
                num_layers: 1,
                num_heads: 4,
                num_kv_heads: 2,
                head_dim: 4,
                intermediate_size: 24,
                num_experts: if moe { 2 } else { 0 },
                top_k: if moe { 1 } else { 0 },
                tie_word_embeddings: true,
            },
            rms_norm_eps: 1e-6,
            max_position_embeddings: 64,
            rope: crate::arch::RopeConfig { theta: 10000.0, local_theta: None, scaling: None },
            no_rope_layers: vec![],
            layer_attention: vec![],
            sliding_window: None,
            query_pre_attn_scalar: None,
            final_logit_softcap: None,
            attn_logit_softcap: None,
            moe: moe.then_some(crate::arch::MoeConfig { norm_topk_prob: false }),
            hidden_act: "silu".into(),
        }
    }

    #[test]
    fn rope_freqs_of_a_llama3_gguf_give_the_descriptions_scaling_or_are_refused() {
        use crate::engine::{MathConstants, RopeScalingConstants};
        let mut arch = test_arch(Family::Llama);
        arch.dims.head_dim = 64;
        arch.rope.theta = 500000.0;
        let llama3 = RopeScalingConstants { rope_type: "llama3", factor: 32.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8192 };
        let math = MathConstants {
            rms_norm_eps: 1e-6,
            rope_theta: 500000.0,
            rope_local_theta: None,
            rope_scaling: Some(llama3),
            no_rope_layers: &[],
            attn_logit_softcap: None,
            final_logit_softcap: None,
            sliding_window: None,
            embedding_scale: 1.0,
            attention_scale: 0.125,
        };
        let names = crate::names::TensorNames { roles: &[], hf_ignore: &[], gguf_ignore: &[], hf_ignore_prefixes: &[], hf_prefix_aliases: &[] };
        let fp: &'static str = Box::leak(arch.shape_fingerprint().into_boxed_str());
        let known = [KnownArch { name: "llama3-test", family: Family::Llama, fingerprint: fp, math, tensors: names }];
        // Llama-3.2-1B's factors: 15 ones, the ramp (these three values are what
        // convert_hf_to_gguf.py's formula gives, as bench/make_gguf.py wrote them), 14 of 32.
        let f = llama3_rope_factors(500000.0, 64, 32.0, 1.0, 4.0, 8192);
        assert_eq!(f.len(), 32);
        assert!(f[..15].iter().all(|&x| x == 1.0) && f[18..].iter().all(|&x| x == 32.0), "{f:?}");
        for (got, python) in f[15..18].iter().zip([1.6513293f32, 3.2922628, 9.666731]) {
            assert!((got - f64::from(python)).abs() < 1e-6 * got, "{got} vs {python}");
        }
        let bytes = |v: &[f64]| -> &'static [u8] { Box::leak(v.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect::<Vec<u8>>().into_boxed_slice()) };
        let model = |freqs: &'static [u8]| SourceModel {
            kind: SourceKind::Gguf,
            arch: arch.clone(),
            tokenizer: no_tokenizer(),
            tensors: vec![SourceTensor { name: "rope_freqs.weight".into(), shape: vec![(freqs.len() / 4) as u64], dtype: SourceDType::F32, bytes: freqs }],
            files: vec![],
            details: BTreeMap::new(),
            source_config: serde_json::Value::Null,
        };
        let mut m = model(bytes(&f));
        rope_scaling_from_freqs(&mut m, &known).expect("matching factors");
        let s = m.arch.rope.scaling.clone().expect("scaling recorded");
        assert_eq!((s.rope_type.as_str(), s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings), ("llama3", 32.0, 1.0, 4.0, 8192));
        assert!(known[0].math.mismatches(&m.arch).is_empty());
        // One factor off: refused, naming the description it was compared with.
        let mut off = f.clone();
        off[16] *= 1.01;
        let e = rope_scaling_from_freqs(&mut model(bytes(&off)), &known).unwrap_err();
        assert!(e.to_string().contains("llama3-test"), "{e}");
        // Factors of 1 (no scaling), a safetensors source, a recorded scaling: left as they are.
        let mut ones = model(bytes(&[1.0; 32]));
        rope_scaling_from_freqs(&mut ones, &known).expect("ones");
        assert_eq!(ones.arch.rope.scaling, None);
        let mut hf = model(bytes(&off));
        hf.kind = SourceKind::Safetensors;
        rope_scaling_from_freqs(&mut hf, &known).expect("safetensors untouched");
        assert_eq!(hf.arch.rope.scaling, None);
        // Shapes no description has: nothing to check, nothing recorded.
        let mut unknown = model(bytes(&f));
        rope_scaling_from_freqs(&mut unknown, &[]).expect("no description of these shapes");
        assert_eq!(unknown.arch.rope.scaling, None);
        // A description of these shapes without scaling, a wrong length, a wrong dtype: refused by name.
        let mut plain = known;
        plain[0].math.rope_scaling = None;
        assert!(rope_scaling_from_freqs(&mut model(bytes(&f)), &plain).unwrap_err().to_string().contains("llama3-test"));
        assert!(rope_scaling_from_freqs(&mut model(bytes(&f[..31])), &known).unwrap_err().to_string().contains("31 values"));
        let mut bf = model(bytes(&f));
        bf.tensors[0].dtype = SourceDType::Bf16;
        assert!(rope_scaling_from_freqs(&mut bf, &known).unwrap_err().to_string().contains("F32"));
    }

    /// A source model's tokenizer where the test needs none.
    fn no_tokenizer() -> crate::manifest::TokenizerInfo {
        crate::manifest::TokenizerInfo { tokenizer_json: String::new(), sentencepiece: None, chat_template: None, bos_token_id: None, eos_token_ids: vec![], add_bos: false }
    }

    /// archs/olmoe-tiny.toml's `[tensors]` (thin-core's unit tests cannot reach thin_generated).
    fn olmoe_names() -> NameTable {
        use crate::names::{RoleNames, TensorNames};
        const fn r(role: Role, hf: &'static str, gguf: &'static str) -> RoleNames {
            RoleNames { role, hf, gguf }
        }
        const ROLES: &[RoleNames] = &[
            r(Role::TokenEmbd, "model.embed_tokens.weight", "token_embd.weight"),
            r(Role::OutputNorm, "model.norm.weight", "output_norm.weight"),
            r(Role::LmHead, "lm_head.weight", "output.weight"),
            r(Role::AttnNorm, "model.layers.{l}.input_layernorm.weight", "blk.{l}.attn_norm.weight"),
            r(Role::AttnQ, "model.layers.{l}.self_attn.q_proj.weight", "blk.{l}.attn_q.weight"),
            r(Role::AttnK, "model.layers.{l}.self_attn.k_proj.weight", "blk.{l}.attn_k.weight"),
            r(Role::AttnV, "model.layers.{l}.self_attn.v_proj.weight", "blk.{l}.attn_v.weight"),
            r(Role::AttnO, "model.layers.{l}.self_attn.o_proj.weight", "blk.{l}.attn_output.weight"),
            r(Role::AttnQNorm, "model.layers.{l}.self_attn.q_norm.weight", "blk.{l}.attn_q_norm.weight"),
            r(Role::AttnKNorm, "model.layers.{l}.self_attn.k_norm.weight", "blk.{l}.attn_k_norm.weight"),
            r(Role::FfnNorm, "model.layers.{l}.post_attention_layernorm.weight", "blk.{l}.ffn_norm.weight"),
            r(Role::MoeRouter, "model.layers.{l}.mlp.gate.weight", "blk.{l}.ffn_gate_inp.weight"),
            r(Role::MoeGate, "model.layers.{l}.mlp.experts.{e}.gate_proj.weight", "blk.{l}.ffn_gate_exps.weight"),
            r(Role::MoeUp, "model.layers.{l}.mlp.experts.{e}.up_proj.weight", "blk.{l}.ffn_up_exps.weight"),
            r(Role::MoeDown, "model.layers.{l}.mlp.experts.{e}.down_proj.weight", "blk.{l}.ffn_down_exps.weight"),
        ];
        NameTable {
            family: Family::Olmoe,
            names: TensorNames { roles: ROLES, hf_ignore: &[], gguf_ignore: &[], hf_ignore_prefixes: &[], hf_prefix_aliases: &[] },
        }
    }

    fn tensor(name: &str, shape: &[u64]) -> SourceTensor<'static> {
        SourceTensor { name: name.into(), shape: shape.to_vec(), dtype: SourceDType::Bf16, bytes: &[] }
    }

    #[test]
    fn olmoe_experts_are_stacked_in_order_and_checked() {
        let arch = test_arch(Family::Olmoe);
        let mut ts = vec![
            tensor("model.embed_tokens.weight", &[32, 16]),
            tensor("model.norm.weight", &[16]),
            tensor("lm_head.weight", &[32, 16]),
        ];
        for (n, s) in [
            ("input_layernorm", vec![16]),
            ("self_attn.q_proj", vec![16, 16]),
            ("self_attn.k_proj", vec![8, 16]),
            ("self_attn.v_proj", vec![8, 16]),
            ("self_attn.o_proj", vec![16, 16]),
            ("self_attn.q_norm", vec![16]),
            ("self_attn.k_norm", vec![8]),
            ("post_attention_layernorm", vec![16]),
            ("mlp.gate", vec![2, 16]),
        ] {
            ts.push(tensor(&format!("model.layers.0.{n}.weight"), &s));
        }
        for e in [1, 0] {
            ts.push(tensor(&format!("model.layers.0.mlp.experts.{e}.gate_proj.weight"), &[24, 16]));
            ts.push(tensor(&format!("model.layers.0.mlp.experts.{e}.up_proj.weight"), &[24, 16]));
            ts.push(tensor(&format!("model.layers.0.mlp.experts.{e}.down_proj.weight"), &[16, 24]));
        }
        let model = SourceModel {
            kind: SourceKind::Safetensors,
            arch,
            tokenizer: no_tokenizer(),
            tensors: ts,
            files: vec![],
            details: BTreeMap::new(),
            source_config: serde_json::Value::Null,
        };
        let names = olmoe_names();
        let jobs = build_jobs(&model, &names).expect("jobs");
        assert_eq!(jobs[0].role, Role::TokenEmbd);
        assert_eq!(jobs.last().map(|j| j.role), Some(Role::LmHead));
        let gate = jobs.iter().find(|j| j.role == Role::MoeGate).expect("moe gate");
        assert_eq!(gate.shape, vec![2, 24, 16]);
        assert_eq!(gate.parts[0].name, "model.layers.0.mlp.experts.0.gate_proj.weight");
        assert_eq!(gate.source_name, "model.layers.0.mlp.experts.{E}.gate_proj.weight");

        let mut missing = model.clone();
        missing.tensors.retain(|t| t.name != "model.layers.0.mlp.experts.1.up_proj.weight");
        assert!(matches!(build_jobs(&missing, &names), Err(ConvertError::MissingExperts { .. })));
        let mut bad = model.clone();
        bad.tensors.retain(|t| t.name != "model.layers.0.self_attn.k_norm.weight");
        assert!(matches!(build_jobs(&bad, &names), Err(ConvertError::MissingTensor { .. })));
        // Declared counts far past the tensors: refused from what is present, without iterating them.
        let t = Instant::now();
        let mut layers = model.clone();
        layers.arch.dims.num_layers = 1 << 31;
        match build_jobs(&layers, &names) {
            Err(e @ ConvertError::DeclaredCount { what: "layers", declared: 2147483648, present: 1 }) => {
                assert_eq!(e.to_string(), "the config declares 2147483648 layers, but the source's tensors hold 1")
            }
            other => panic!("{other:?}"),
        }
        let mut experts = model.clone();
        experts.arch.dims.num_experts = 1 << 40;
        match build_jobs(&experts, &names) {
            Err(ConvertError::MissingExperts { missing, num_experts, .. }) => {
                assert_eq!((missing, num_experts), ((2..18).collect::<Vec<u32>>(), 1 << 40))
            }
            other => panic!("{other:?}"),
        }
        assert!(t.elapsed().as_secs_f64() < 1.0, "{:?}", t.elapsed());
        let mut wrong = model;
        wrong.tensors[1].shape = vec![15];
        let e = build_jobs(&wrong, &names).unwrap_err();
        assert!(e.to_string().contains("model.norm.weight"), "{e}");
    }
}
