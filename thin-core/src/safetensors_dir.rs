//! Hugging Face safetensors directory importer: config.json, (sharded) *.safetensors, tokenizer files.
//!
//! Safetensors headers are parsed here rather than trusted to a crate: the header length, every
//! name (duplicates included), dtype, shape product and data range is checked against the file.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::Value;

use crate::arch::{ArchConfig, Family, LayerAttention, MoeConfig, RopeConfig, RopeScaling, ShapeDims};
use crate::dtype::SourceDType;
use crate::manifest::TokenizerInfo;
use crate::source::{SourceKind, SourceModel, SourceTensor};

/// Largest safetensors JSON header accepted (the format's own reference reader uses the same cap).
pub const MAX_HEADER_LEN: u64 = 100_000_000;

#[derive(Debug, thiserror::Error)]
pub enum SafetensorsError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: not a directory")]
    NotADirectory { path: PathBuf },
    #[error("{path}: missing (a Hugging Face model directory needs it)")]
    MissingFile { path: PathBuf },
    #[error("{path}: invalid JSON: {source}")]
    Json { path: PathBuf, source: serde_json::Error },
    #[error("{path}: key `{key}`: {msg}")]
    Config { path: PathBuf, key: String, msg: String },
    #[error("{path}: model_type `{model_type}` is not supported (llama, smollm3, gemma3_text, gemma3, olmoe)")]
    UnsupportedModel { path: PathBuf, model_type: String },
    #[error("{file}: {len} bytes, too short for a safetensors header")]
    TooShort { file: String, len: u64 },
    #[error("{file}: header length {header_len} exceeds {limit} bytes")]
    HeaderTooLarge { file: String, header_len: u64, limit: u64 },
    #[error("{file}: header length {header_len} runs past the end of the {file_len}-byte file")]
    HeaderPastEnd { file: String, header_len: u64, file_len: u64 },
    #[error("{file}: header is not a JSON object of tensors: {msg}")]
    Header { file: String, msg: String },
    #[error("{file}: tensor `{tensor}` appears more than once")]
    DuplicateTensor { file: String, tensor: String },
    #[error("{file}: tensor `{tensor}`: field `{field}`: {msg}")]
    TensorField { file: String, tensor: String, field: &'static str, msg: String },
    #[error("{file}: tensor `{tensor}`: dtype {dtype} is not supported (F32, F16, BF16)")]
    UnsupportedDtype { file: String, tensor: String, dtype: String },
    #[error("{file}: tensor `{tensor}`: shape {shape:?} element count overflows")]
    ShapeOverflow { file: String, tensor: String, shape: Vec<u64> },
    #[error("{file}: tensor `{tensor}`: data_offsets [{begin}, {end}] outside the {data_len}-byte data section")]
    OffsetsOutOfFile { file: String, tensor: String, begin: u64, end: u64, data_len: u64 },
    #[error("{file}: tensor `{tensor}`: data_offsets span {got} bytes, shape and dtype need {expected}")]
    SizeMismatch { file: String, tensor: String, expected: u64, got: u64 },
    #[error("{file}: tensors `{first}` and `{second}` overlap in the data section")]
    Overlap { file: String, first: String, second: String },
    #[error("tensor `{tensor}` is in both {first} and {second}")]
    DuplicateAcrossShards { tensor: String, first: String, second: String },
    #[error("{index}: weight_map names `{tensor}` in {file}, which does not hold it")]
    IndexMismatch { index: String, tensor: String, file: String },
    #[error("{index}: shard name `{file}` is not a plain file name")]
    BadShardName { index: String, file: String },
    #[error("{path}: quantized checkpoints (quantization_config.quant_method = {method}) are not supported; convert from the unquantized model")]
    QuantizedCheckpoint { path: PathBuf, method: String },
}

/// One tensor's place in a mapped file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: SourceDType,
    pub shape: Vec<u64>,
    /// Absolute byte range in the file.
    pub start: u64,
    pub end: u64,
}

/// One parsed and checked safetensors file.
#[derive(Debug)]
pub struct SafetensorsFile {
    pub file_name: String,
    pub tensors: Vec<TensorInfo>,
    mmap: Mmap,
}

/// JSON object entries in file order, duplicates kept (serde_json maps silently drop them).
struct Entries(Vec<(String, Value)>);

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Entries, A::Error> {
                let mut v = Vec::new();
                while let Some((k, val)) = m.next_entry::<String, Value>()? {
                    v.push((k, val));
                }
                Ok(Entries(v))
            }
        }
        d.deserialize_map(V)
    }
}

fn parse_dtype(s: &str) -> Option<SourceDType> {
    match s {
        "F32" => Some(SourceDType::F32),
        "F16" => Some(SourceDType::F16),
        "BF16" => Some(SourceDType::Bf16),
        _ => None,
    }
}

/// Parse and check a safetensors header against the file's length. `bytes` is the whole file.
pub fn parse_header(file: &str, bytes: &[u8]) -> Result<Vec<TensorInfo>, SafetensorsError> {
    let file_len = bytes.len() as u64;
    let Some(len_bytes) = bytes.get(..8) else {
        return Err(SafetensorsError::TooShort { file: file.to_string(), len: file_len });
    };
    let mut n = [0u8; 8];
    n.copy_from_slice(len_bytes);
    let header_len = u64::from_le_bytes(n);
    if header_len > MAX_HEADER_LEN {
        return Err(SafetensorsError::HeaderTooLarge { file: file.to_string(), header_len, limit: MAX_HEADER_LEN });
    }
    let data_start = 8 + header_len;
    if data_start > file_len {
        return Err(SafetensorsError::HeaderPastEnd { file: file.to_string(), header_len, file_len });
    }
    let data_len = file_len - data_start;
    let header = &bytes[8..data_start as usize];
    let text = std::str::from_utf8(header)
        .map_err(|e| SafetensorsError::Header { file: file.to_string(), msg: e.to_string() })?;
    let Entries(entries) = serde_json::from_str(text.trim_end_matches(' '))
        .map_err(|e| SafetensorsError::Header { file: file.to_string(), msg: e.to_string() })?;
    let mut seen = BTreeSet::new();
    let mut out = Vec::with_capacity(entries.len());
    for (name, v) in entries {
        if !seen.insert(name.clone()) {
            return Err(SafetensorsError::DuplicateTensor { file: file.to_string(), tensor: name });
        }
        if name == "__metadata__" {
            continue;
        }
        let field_err = |field: &'static str, msg: &str| SafetensorsError::TensorField {
            file: file.to_string(),
            tensor: name.clone(),
            field,
            msg: msg.to_string(),
        };
        let dtype_s =
            v.get("dtype").and_then(Value::as_str).ok_or_else(|| field_err("dtype", "missing or not a string"))?;
        let dtype = parse_dtype(dtype_s).ok_or_else(|| SafetensorsError::UnsupportedDtype {
            file: file.to_string(),
            tensor: name.clone(),
            dtype: dtype_s.to_string(),
        })?;
        let shape: Vec<u64> = v
            .get("shape")
            .and_then(Value::as_array)
            .ok_or_else(|| field_err("shape", "missing or not an array"))?
            .iter()
            .map(|d| d.as_u64().ok_or_else(|| field_err("shape", "dims must be non-negative integers")))
            .collect::<Result<_, _>>()?;
        let offs = v
            .get("data_offsets")
            .and_then(Value::as_array)
            .ok_or_else(|| field_err("data_offsets", "missing or not an array"))?;
        let (begin, end) = match offs.as_slice() {
            [b, e] => (
                b.as_u64().ok_or_else(|| field_err("data_offsets", "not a non-negative integer"))?,
                e.as_u64().ok_or_else(|| field_err("data_offsets", "not a non-negative integer"))?,
            ),
            _ => return Err(field_err("data_offsets", "needs exactly [begin, end]")),
        };
        let count = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let expected = count.and_then(|c| dtype.bytes_for(c)).ok_or_else(|| SafetensorsError::ShapeOverflow {
            file: file.to_string(),
            tensor: name.clone(),
            shape: shape.clone(),
        })?;
        if begin > end || end > data_len {
            return Err(SafetensorsError::OffsetsOutOfFile {
                file: file.to_string(),
                tensor: name,
                begin,
                end,
                data_len,
            });
        }
        if end - begin != expected {
            return Err(SafetensorsError::SizeMismatch {
                file: file.to_string(),
                tensor: name,
                expected,
                got: end - begin,
            });
        }
        out.push(TensorInfo { name, dtype, shape, start: data_start + begin, end: data_start + end });
    }
    let mut by_start: Vec<&TensorInfo> = out.iter().filter(|t| t.end > t.start).collect();
    by_start.sort_by_key(|t| (t.start, t.end));
    for w in by_start.windows(2) {
        if w[1].start < w[0].end {
            return Err(SafetensorsError::Overlap {
                file: file.to_string(),
                first: w[0].name.clone(),
                second: w[1].name.clone(),
            });
        }
    }
    Ok(out)
}

impl SafetensorsFile {
    pub fn open(path: &Path) -> Result<SafetensorsFile, SafetensorsError> {
        let io = |source| SafetensorsError::Io { path: path.to_path_buf(), source };
        let file_name =
            path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned());
        let f = File::open(path).map_err(io)?;
        let len = f.metadata().map_err(io)?.len();
        if len < 8 {
            return Err(SafetensorsError::TooShort { file: file_name, len });
        }
        // SAFETY: the map is read-only; a file changed underneath us is the usual mmap caveat
        // (the converter checksums what it writes, not what it read).
        let mmap = unsafe { Mmap::map(&f) }.map_err(io)?;
        let tensors = parse_header(&file_name, &mmap)?;
        Ok(SafetensorsFile { file_name, tensors, mmap })
    }

    pub fn bytes(&self, t: &TensorInfo) -> &[u8] {
        // parse_header checked start <= end <= file length.
        &self.mmap[t.start as usize..t.end as usize]
    }
}

/// An opened Hugging Face model directory.
#[derive(Debug)]
pub struct HfDir {
    pub dir: PathBuf,
    pub arch: ArchConfig,
    pub tokenizer: TokenizerInfo,
    pub files: Vec<SafetensorsFile>,
    pub details: BTreeMap<String, String>,
    pub source_config: Value,
}

fn read_json(path: &Path) -> Result<Value, SafetensorsError> {
    let text =
        std::fs::read_to_string(path).map_err(|source| SafetensorsError::Io { path: path.to_path_buf(), source })?;
    serde_json::from_str(&text).map_err(|source| SafetensorsError::Json { path: path.to_path_buf(), source })
}

fn read_json_opt(path: &Path) -> Result<Option<Value>, SafetensorsError> {
    if path.is_file() {
        read_json(path).map(Some)
    } else {
        Ok(None)
    }
}

/// Typed access to config.json keys; every error names the key.
struct Cfg<'a> {
    path: &'a Path,
    v: &'a Value,
}

impl Cfg<'_> {
    fn err(&self, key: &str, msg: &str) -> SafetensorsError {
        SafetensorsError::Config { path: self.path.to_path_buf(), key: key.to_string(), msg: msg.to_string() }
    }
    fn present(&self, key: &str) -> Option<&Value> {
        self.v.get(key).filter(|v| !v.is_null())
    }
    fn u64(&self, key: &str) -> Result<u64, SafetensorsError> {
        self.u64_opt(key)?.ok_or_else(|| self.err(key, "missing"))
    }
    fn u64_opt(&self, key: &str) -> Result<Option<u64>, SafetensorsError> {
        self.present(key).map(|v| v.as_u64().ok_or_else(|| self.err(key, "not a non-negative integer"))).transpose()
    }
    fn f64_opt(&self, key: &str) -> Result<Option<f64>, SafetensorsError> {
        self.present(key).map(|v| v.as_f64().ok_or_else(|| self.err(key, "not a number"))).transpose()
    }
    fn bool_opt(&self, key: &str) -> Result<Option<bool>, SafetensorsError> {
        self.present(key).map(|v| v.as_bool().ok_or_else(|| self.err(key, "not a boolean"))).transpose()
    }
    fn str_opt(&self, key: &str) -> Result<Option<&str>, SafetensorsError> {
        self.present(key).map(|v| v.as_str().ok_or_else(|| self.err(key, "not a string"))).transpose()
    }
}

/// Most layers a config.json may declare: per-layer lists are built from the count before the
/// tensors are read (the converter then requires every declared layer's tensors).
pub const MAX_LAYERS: u64 = 1 << 16;

/// Read the arch from config.json (the text config for multimodal Gemma 3).
pub fn arch_from_config(path: &Path, config: &Value) -> Result<ArchConfig, SafetensorsError> {
    let top = Cfg { path, v: config };
    let model_type = top.str_opt("model_type")?.ok_or_else(|| top.err("model_type", "missing"))?;
    let (family, text) = match model_type {
        "llama" => (Family::Llama, config),
        "smollm3" => (Family::Smollm3, config),
        "gemma3_text" => (Family::Gemma3, config),
        "gemma3" => (
            Family::Gemma3,
            config.get("text_config").ok_or_else(|| top.err("text_config", "missing for model_type gemma3"))?,
        ),
        "olmoe" => (Family::Olmoe, config),
        other => {
            return Err(SafetensorsError::UnsupportedModel { path: path.to_path_buf(), model_type: other.to_string() })
        }
    };
    let c = Cfg { path, v: text };
    let hidden_size = c.u64("hidden_size")?;
    let num_layers = c.u64("num_hidden_layers")?;
    let num_heads = c.u64("num_attention_heads")?;
    if num_heads == 0 || num_layers == 0 || hidden_size == 0 {
        return Err(
            c.err("num_attention_heads", "hidden_size, num_hidden_layers and num_attention_heads must be positive")
        );
    }
    if num_layers > MAX_LAYERS {
        return Err(c.err("num_hidden_layers", &format!("{num_layers} is more than {MAX_LAYERS}, the most a checkpoint may declare")));
    }
    let num_kv_heads = c.u64_opt("num_key_value_heads")?.unwrap_or(num_heads);
    if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
        return Err(c.err("num_key_value_heads", "must divide num_attention_heads"));
    }
    let head_dim = match c.u64_opt("head_dim")? {
        Some(h) => h,
        None => {
            if hidden_size % num_heads != 0 {
                return Err(c.err("head_dim", "missing, and hidden_size is not a multiple of num_attention_heads"));
            }
            hidden_size / num_heads
        }
    };
    let vocab_size = match c.u64_opt("vocab_size")? {
        Some(v) => v,
        None if family == Family::Gemma3 => 262_208,
        None => return Err(c.err("vocab_size", "missing")),
    };
    let default_tie = matches!(family, Family::Smollm3 | Family::Gemma3);
    let tie_word_embeddings = match c.bool_opt("tie_word_embeddings")? {
        Some(t) => t,
        None => top.bool_opt("tie_word_embeddings")?.unwrap_or(default_tie),
    };
    let default_theta = match family {
        Family::Gemma3 => 1_000_000.0,
        Family::Llama | Family::Smollm3 | Family::Olmoe => 10_000.0,
    };
    // transformers >= 5 writes `rope_parameters` (flat, or keyed by layer type for Gemma 3); older
    // configs write `rope_theta`, `rope_scaling` and `rope_local_base_freq` at the top level.
    let (global_rope, local_rope) = match c.present("rope_parameters") {
        Some(rp) if rp.get("full_attention").is_some() => (rp.get("full_attention"), rp.get("sliding_attention")),
        Some(rp) => (Some(rp), None),
        None => (None, None),
    };
    let theta_of = |v: Option<&Value>, key: &str| -> Result<Option<f64>, SafetensorsError> {
        match v {
            Some(v) => Cfg { path, v }.f64_opt("rope_theta").map_err(|_| c.err(key, "rope_theta is not a number")),
            None => Ok(None),
        }
    };
    let scaling = match c.present("rope_scaling").or(global_rope) {
        None => None,
        Some(rs) => {
            let r = Cfg { path, v: rs };
            let ty = match r.str_opt("rope_type")? {
                Some(t) => t,
                None => r.str_opt("type")?.ok_or_else(|| c.err("rope_scaling.rope_type", "missing"))?,
            };
            let factor = || r.f64_opt("factor")?.ok_or_else(|| c.err("rope_scaling.factor", "missing"));
            match ty {
                "default" => None,
                "llama3" => Some(RopeScaling {
                    rope_type: ty.to_string(),
                    factor: factor()?,
                    low_freq_factor: r
                        .f64_opt("low_freq_factor")?
                        .ok_or_else(|| c.err("rope_scaling.low_freq_factor", "missing"))?,
                    high_freq_factor: r
                        .f64_opt("high_freq_factor")?
                        .ok_or_else(|| c.err("rope_scaling.high_freq_factor", "missing"))?,
                    original_max_position_embeddings: r
                        .u64_opt("original_max_position_embeddings")?
                        .ok_or_else(|| c.err("rope_scaling.original_max_position_embeddings", "missing"))?,
                }),
                // Positions divided by `factor`; the llama3-only fields are zero.
                "linear" => Some(RopeScaling {
                    rope_type: ty.to_string(),
                    factor: factor()?,
                    low_freq_factor: 0.0,
                    high_freq_factor: 0.0,
                    original_max_position_embeddings: 0,
                }),
                other => {
                    return Err(c.err("rope_scaling.rope_type", &format!("`{other}` is not supported (llama3, linear)")))
                }
            }
        }
    };
    let rope = RopeConfig {
        theta: match c.f64_opt("rope_theta")? {
            Some(t) => t,
            None => theta_of(global_rope, "rope_parameters")?.unwrap_or(default_theta),
        },
        local_theta: match family {
            Family::Gemma3 => Some(match c.f64_opt("rope_local_base_freq")? {
                Some(t) => t,
                None => theta_of(local_rope, "rope_parameters.sliding_attention")?.unwrap_or(10_000.0),
            }),
            Family::Llama | Family::Smollm3 | Family::Olmoe => None,
        },
        scaling,
    };
    let no_rope_layers = match family {
        Family::Smollm3 => match c.present("no_rope_layers") {
            Some(v) => {
                let flags = v.as_array().ok_or_else(|| c.err("no_rope_layers", "not an array"))?;
                if (flags.len() as u64) < num_layers {
                    return Err(c.err("no_rope_layers", "shorter than num_hidden_layers"));
                }
                let mut out = Vec::new();
                for (l, f) in flags.iter().take(num_layers as usize).enumerate() {
                    match f.as_u64() {
                        Some(0) => out.push(l as u64),
                        Some(1) => {}
                        _ => return Err(c.err("no_rope_layers", "entries must be 0 (no RoPE) or 1 (RoPE)")),
                    }
                }
                out
            }
            None => {
                let every = c.u64_opt("no_rope_layer_interval")?.unwrap_or(4);
                if every == 0 {
                    return Err(c.err("no_rope_layer_interval", "must be positive"));
                }
                (0..num_layers).filter(|l| (l + 1) % every == 0).collect()
            }
        },
        Family::Llama | Family::Gemma3 | Family::Olmoe => Vec::new(),
    };
    let (layer_attention, sliding_window) = match family {
        Family::Gemma3 => {
            let kinds = match c.present("layer_types") {
                Some(v) => {
                    let a = v.as_array().ok_or_else(|| c.err("layer_types", "not an array"))?;
                    if a.len() as u64 != num_layers {
                        return Err(c.err("layer_types", "length differs from num_hidden_layers"));
                    }
                    a.iter()
                        .map(|t| match t.as_str() {
                            Some("sliding_attention") => Ok(LayerAttention::SlidingWindow),
                            Some("full_attention") => Ok(LayerAttention::Full),
                            _ => Err(c.err("layer_types", "entries must be sliding_attention or full_attention")),
                        })
                        .collect::<Result<Vec<_>, _>>()?
                }
                None => {
                    let p = c.u64_opt("sliding_window_pattern")?.unwrap_or(6);
                    if p == 0 {
                        return Err(c.err("sliding_window_pattern", "must be positive"));
                    }
                    (0..num_layers)
                        .map(|l| if (l + 1) % p == 0 { LayerAttention::Full } else { LayerAttention::SlidingWindow })
                        .collect()
                }
            };
            (kinds, Some(c.u64_opt("sliding_window")?.unwrap_or(4096)))
        }
        Family::Llama | Family::Smollm3 | Family::Olmoe => (Vec::new(), None),
    };
    let (num_experts, top_k, moe) = match family {
        Family::Olmoe => {
            // (The converter checks num_experts against the expert tensors present.)
            let (experts, top_k) = (c.u64("num_experts")?, c.u64("num_experts_per_tok")?);
            if top_k > experts {
                return Err(c.err("num_experts_per_tok", &format!("{top_k} is more than num_experts {experts}")));
            }
            (experts, top_k, Some(MoeConfig { norm_topk_prob: c.bool_opt("norm_topk_prob")?.unwrap_or(false) }))
        }
        Family::Llama | Family::Smollm3 | Family::Gemma3 => (0, 0, None),
    };
    let default_act = match family {
        Family::Gemma3 => "gelu_pytorch_tanh",
        Family::Llama | Family::Smollm3 | Family::Olmoe => "silu",
    };
    let hidden_act = match c.str_opt("hidden_activation")? {
        Some(a) => a,
        None => c.str_opt("hidden_act")?.unwrap_or(default_act),
    }
    .to_string();
    Ok(ArchConfig {
        dims: ShapeDims {
            family,
            vocab_size,
            hidden_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate_size: c.u64("intermediate_size")?,
            num_experts,
            top_k,
            tie_word_embeddings,
        },
        rms_norm_eps: c.f64_opt("rms_norm_eps")?.unwrap_or(1e-6),
        max_position_embeddings: c.u64_opt("max_position_embeddings")?.unwrap_or(4096),
        rope,
        no_rope_layers,
        layer_attention,
        sliding_window,
        query_pre_attn_scalar: match family {
            Family::Gemma3 => Some(c.f64_opt("query_pre_attn_scalar")?.unwrap_or(head_dim as f64)),
            Family::Llama | Family::Smollm3 | Family::Olmoe => None,
        },
        final_logit_softcap: c.f64_opt("final_logit_softcapping")?,
        attn_logit_softcap: c.f64_opt("attn_logit_softcapping")?,
        moe,
        hidden_act,
    })
}

/// Token ids from a JSON int or list of ints.
fn ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().and_then(|x| u32::try_from(x).ok()).into_iter().collect(),
        Some(Value::Array(a)) => a.iter().filter_map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok())).collect(),
        _ => Vec::new(),
    }
}

/// A special token's text from tokenizer_config (`"<s>"` or `{"content": "<s>"}`).
fn token_text(v: Option<&Value>) -> Option<&str> {
    match v? {
        Value::String(s) => Some(s),
        Value::Object(o) => o.get("content").and_then(Value::as_str),
        _ => None,
    }
}

/// Id of a token text in tokenizer.json (added tokens first, then the model vocab).
fn token_id(tok: &Value, text: &str) -> Option<u32> {
    let added = tok.get("added_tokens").and_then(Value::as_array).and_then(|a| {
        a.iter().find(|t| t.get("content").and_then(Value::as_str) == Some(text)).and_then(|t| t.get("id")?.as_u64())
    });
    let id = added.or_else(|| tok.get("model")?.get("vocab")?.get(text)?.as_u64())?;
    u32::try_from(id).ok()
}

fn read_tokenizer(dir: &Path, config: &Value) -> Result<TokenizerInfo, SafetensorsError> {
    let tok_path = dir.join("tokenizer.json");
    if !tok_path.is_file() {
        return Err(SafetensorsError::MissingFile { path: tok_path });
    }
    let tokenizer_json =
        std::fs::read_to_string(&tok_path).map_err(|source| SafetensorsError::Io { path: tok_path.clone(), source })?;
    let tok: Value = serde_json::from_str(&tokenizer_json)
        .map_err(|source| SafetensorsError::Json { path: tok_path.clone(), source })?;
    let tc_path = dir.join("tokenizer_config.json");
    let tc = read_json_opt(&tc_path)?.unwrap_or(Value::Null);
    let gen = read_json_opt(&dir.join("generation_config.json"))?.unwrap_or(Value::Null);
    let text_cfg = config.get("text_config").unwrap_or(&Value::Null);

    let jinja = dir.join("chat_template.jinja");
    let chat_template = if jinja.is_file() {
        Some(std::fs::read_to_string(&jinja).map_err(|source| SafetensorsError::Io { path: jinja, source })?)
    } else {
        match tc.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            // A list of named templates: the "default" one, else the first.
            Some(Value::Array(a)) => a
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .or_else(|| a.first())
                .and_then(|t| t.get("template")?.as_str())
                .map(str::to_string),
            _ => None,
        }
    };

    let bos_text = token_text(tc.get("bos_token"));
    let bos_token_id = ids(config.get("bos_token_id"))
        .first()
        .or(ids(text_cfg.get("bos_token_id")).first())
        .or(ids(gen.get("bos_token_id")).first())
        .copied()
        .or_else(|| bos_text.and_then(|t| token_id(&tok, t)));
    let mut eos_token_ids = Vec::new();
    for v in [config.get("eos_token_id"), text_cfg.get("eos_token_id"), gen.get("eos_token_id")] {
        for id in ids(v) {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
    }
    if let Some(id) = token_text(tc.get("eos_token")).and_then(|t| token_id(&tok, t)) {
        if !eos_token_ids.contains(&id) {
            eos_token_ids.push(id);
        }
    }
    // Explicit `add_bos_token` wins; otherwise BOS is added when the tokenizer's own
    // post-processor template inserts the BOS token.
    let add_bos = match tc.get("add_bos_token").and_then(Value::as_bool) {
        Some(b) => b,
        None => match (bos_text, tok.get("post_processor")) {
            (Some(b), Some(pp)) if !pp.is_null() => {
                pp.to_string().contains(&serde_json::to_string(b).unwrap_or_default())
            }
            _ => false,
        },
    };
    Ok(TokenizerInfo { tokenizer_json, sentencepiece: None, chat_template, bos_token_id, eos_token_ids, add_bos })
}

fn open_shards(dir: &Path) -> Result<Vec<SafetensorsFile>, SafetensorsError> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![SafetensorsFile::open(&single)?]);
    }
    let index_path = dir.join("model.safetensors.index.json");
    if !index_path.is_file() {
        return Err(SafetensorsError::MissingFile { path: single });
    }
    let index_name = "model.safetensors.index.json".to_string();
    let index = read_json(&index_path)?;
    let map = index.get("weight_map").and_then(Value::as_object).ok_or_else(|| SafetensorsError::Config {
        path: index_path.clone(),
        key: "weight_map".into(),
        msg: "missing or not an object".into(),
    })?;
    let mut wanted: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (tensor, file) in map {
        let file = file.as_str().ok_or_else(|| SafetensorsError::Config {
            path: index_path.clone(),
            key: format!("weight_map.{tensor}"),
            msg: "not a string".into(),
        })?;
        if file.is_empty() || file.contains('/') || file.contains('\\') || file == "." || file == ".." {
            return Err(SafetensorsError::BadShardName { index: index_name, file: file.to_string() });
        }
        wanted.entry(file).or_default().push(tensor);
    }
    let mut files = Vec::new();
    for (file, tensors) in wanted {
        let f = SafetensorsFile::open(&dir.join(file))?;
        for t in tensors {
            if !f.tensors.iter().any(|x| x.name == t) {
                return Err(SafetensorsError::IndexMismatch {
                    index: index_name,
                    tensor: t.to_string(),
                    file: file.to_string(),
                });
            }
        }
        files.push(f);
    }
    let mut owner: BTreeMap<&str, &str> = BTreeMap::new();
    for f in &files {
        for t in &f.tensors {
            if let Some(first) = owner.insert(&t.name, &f.file_name) {
                return Err(SafetensorsError::DuplicateAcrossShards {
                    tensor: t.name.clone(),
                    first: first.to_string(),
                    second: f.file_name.clone(),
                });
            }
        }
    }
    Ok(files)
}

impl HfDir {
    pub fn open(dir: &Path) -> Result<HfDir, SafetensorsError> {
        if !dir.is_dir() {
            return Err(SafetensorsError::NotADirectory { path: dir.to_path_buf() });
        }
        let config_path = dir.join("config.json");
        if !config_path.is_file() {
            return Err(SafetensorsError::MissingFile { path: config_path });
        }
        let config = read_json(&config_path)?;
        let qc = config.get("quantization_config").filter(|v| !v.is_null());
        if let Some(q) = qc {
            let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("unknown").to_string();
            return Err(SafetensorsError::QuantizedCheckpoint { path: config_path, method });
        }
        let arch = arch_from_config(&config_path, &config)?;
        let tokenizer = read_tokenizer(dir, &config)?;
        let files = open_shards(dir)?;
        let mut details = BTreeMap::new();
        for key in ["model_type", "torch_dtype", "transformers_version"] {
            if let Some(v) = config.get(key).and_then(Value::as_str) {
                details.insert(key.to_string(), v.to_string());
            }
        }
        if let Some(a) = config.get("architectures").and_then(Value::as_array) {
            let names: Vec<&str> = a.iter().filter_map(Value::as_str).collect();
            details.insert("architectures".into(), names.join(","));
        }
        Ok(HfDir { dir: dir.to_path_buf(), arch, tokenizer, files, details, source_config: Value::Null })
    }

    pub fn source_model(&self) -> Result<SourceModel<'_>, SafetensorsError> {
        let tensors = self
            .files
            .iter()
            .flat_map(|f| {
                f.tensors.iter().map(move |t| SourceTensor {
                    name: t.name.clone(),
                    shape: t.shape.clone(),
                    dtype: t.dtype,
                    bytes: f.bytes(t),
                })
            })
            .collect();
        Ok(SourceModel {
            kind: SourceKind::Safetensors,
            arch: self.arch.clone(),
            tokenizer: self.tokenizer.clone(),
            tensors,
            files: self.files.iter().map(|f| f.file_name.clone()).collect(),
            details: self.details.clone(),
            source_config: self.source_config.clone(),
        })
    }
}
