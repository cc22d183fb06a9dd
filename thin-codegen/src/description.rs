//! The architecture description: its TOML schema, parsing, and validation that reports every error at once.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use thin_core::arch::{Family, ShapeDims};

#[derive(Debug, thiserror::Error)]
pub enum CodegenError {
    #[error("{path}: {msg}")]
    Io { path: String, msg: String },
    #[error("{file}: parse error: {msg}")]
    Parse { file: String, msg: String },
    #[error("{file}: {} validation error(s):\n  {}", errors.len(), errors.join("\n  "))]
    Invalid { file: String, errors: Vec<String> },
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Description {
    pub model: Model,
    pub dims: Dims,
    pub attention: Attention,
    pub rope: Rope,
    pub norm: Norm,
    pub mlp: Mlp,
    pub moe: Option<Moe>,
    pub embedding: Embedding,
    #[serde(default)]
    pub final_logit_softcap: Option<f64>,
    pub tensors: Tensors,
}
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Model { pub name: String, pub family: Family }
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Dims { pub vocab_size: u64, pub hidden_size: u64, pub num_layers: u64, pub intermediate_size: u64, pub max_position_embeddings: u64 }
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Attention {
    pub num_heads: u64,
    pub num_kv_heads: u64,
    pub head_dim: u64,
    pub qk_norm: QkNorm,
    pub query_pre_attn_scalar: Option<f64>,
    pub sliding_window: Option<u64>,
    #[serde(default)]
    pub pattern: Vec<AttnKind>,
    pub softcap: Option<f64>,
}
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QkNorm { None, PerHead, Whole }
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttnKind { Full, Sliding }
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rope { pub theta: f64, pub local_theta: Option<f64>, pub skip_every: Option<u64>, pub scaling: Option<thin_core::arch::RopeScaling> }
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Norm { pub eps: f64, pub placement: Placement, #[serde(default)] pub weight_offset_folded: bool }
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement { Pre, Sandwich }
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Mlp { pub kind: MlpKind, pub hidden_act: String }
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MlpKind { Swiglu, GegluTanh }
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Moe { pub num_experts: u64, pub top_k: u64, pub norm_topk_prob: bool }
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Embedding { pub scale: EmbScale, pub tie_word_embeddings: bool }
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EmbScale { None, SqrtHidden }
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorNames { pub hf: String, pub gguf: String }
/// `[tensors]`: the source names of every role (`roles`, keyed by `Role::name`), plus what the
/// importers skip or rewrite. Every other key is a role, so a misspelt role is an error.
#[derive(Debug, Clone, Deserialize)]
pub struct Tensors {
    #[serde(default)]
    pub ignore: IgnoredNames,
    /// `[from, to]` HF name-prefix rewrites applied before matching.
    #[serde(default)]
    pub hf_prefix_aliases: Vec<(String, String)>,
    #[serde(flatten)]
    pub roles: BTreeMap<String, TensorNames>,
}
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IgnoredNames {
    #[serde(default)]
    pub hf: Vec<String>,
    #[serde(default)]
    pub gguf: Vec<String>,
    #[serde(default)]
    pub hf_prefixes: Vec<String>,
}

pub fn parse(file: &str, text: &str) -> Result<Description, CodegenError> {
    toml::from_str(text).map_err(|e| CodegenError::Parse { file: file.to_string(), msg: e.to_string() })
}

/// Every problem in the description at once, each naming its key path.
pub fn validate(file: &str, d: &Description) -> Result<(), CodegenError> {
    use thin_core::role::Role::{MoeDown, MoeGate, MoeUp};
    let mut e = Vec::new();
    let a = &d.attention;
    for (k, v) in [
        ("dims.vocab_size", d.dims.vocab_size),
        ("dims.hidden_size", d.dims.hidden_size),
        ("dims.num_layers", d.dims.num_layers),
        ("dims.intermediate_size", d.dims.intermediate_size),
        ("dims.max_position_embeddings", d.dims.max_position_embeddings),
        ("attention.num_heads", a.num_heads),
        ("attention.num_kv_heads", a.num_kv_heads),
        ("attention.head_dim", a.head_dim),
    ] {
        if v == 0 {
            e.push(format!("{k}: must be > 0"));
        }
    }
    if a.num_kv_heads != 0 && a.num_heads % a.num_kv_heads != 0 {
        e.push(format!("attention.num_kv_heads: {} does not divide num_heads {}", a.num_kv_heads, a.num_heads));
    }
    if a.head_dim % 2 != 0 {
        e.push(format!("attention.head_dim: {} must be even for RoPE", a.head_dim));
    }
    if a.pattern.contains(&AttnKind::Sliding) && a.sliding_window.is_none() {
        e.push("attention.sliding_window: required when attention.pattern has \"sliding\"".into());
    }
    if a.sliding_window == Some(0) {
        e.push("attention.sliding_window: must be > 0".into());
    }
    if !(d.rope.theta > 0.0) {
        e.push(format!("rope.theta: {} must be > 0", d.rope.theta));
    }
    if d.rope.skip_every == Some(0) {
        e.push("rope.skip_every: must be > 0".into());
    }
    if let Some(s) = &d.rope.scaling {
        if s.rope_type != "llama3" {
            e.push(format!("rope.scaling.rope_type: {:?} is not supported (llama3)", s.rope_type));
        }
        if s.high_freq_factor <= s.low_freq_factor {
            e.push("rope.scaling.high_freq_factor: must exceed low_freq_factor".into());
        }
    }
    if !(d.norm.eps > 0.0) {
        e.push(format!("norm.eps: {} must be > 0", d.norm.eps));
    }
    if let Some(m) = &d.moe {
        if m.top_k == 0 || m.top_k > m.num_experts {
            e.push(format!("moe.top_k: {} must be in 1..=num_experts {}", m.top_k, m.num_experts));
        }
        // Both engines run experts as SwiGLU (the CPU's swiglu, the kernels' mlp_act of mlp.kind).
        if d.mlp.kind != MlpKind::Swiglu {
            e.push("mlp.kind: experts are SwiGLU; a [moe] description needs kind = \"swiglu\"".to_string());
        }
    }
    let expect_act = match d.mlp.kind { MlpKind::Swiglu => "silu", MlpKind::GegluTanh => "gelu_pytorch_tanh" };
    if d.mlp.hidden_act != expect_act {
        e.push(format!("mlp.hidden_act: {:?} does not match mlp.kind (expected {expect_act:?})", d.mlp.hidden_act));
    }
    for (k, t) in &d.tensors.roles {
        let Some(r) = thin_core::role::Role::from_name(k) else {
            e.push(format!("tensors.{k}: unknown role"));
            continue;
        };
        for (fmt, p) in [("hf", &t.hf), ("gguf", &t.gguf)] {
            if r.is_per_layer() != p.contains("{l}") {
                let says = if r.is_per_layer() { "per-layer pattern lacks {l}" } else { "model-level pattern has {l}" };
                e.push(format!("tensors.{k}.{fmt}: {says}"));
            }
            // Only HF stores one tensor per expert (OLMoE); GGUF stacks them.
            let expert_ok = fmt == "hf" && matches!(r, MoeGate | MoeUp | MoeDown);
            if p.contains("{e}") && !expert_ok {
                e.push(format!("tensors.{k}.{fmt}: {{e}} is only for the hf names of moe_gate, moe_up, moe_down"));
            }
            if let Some(bad) = unknown_placeholder(p) {
                e.push(format!("tensors.{k}.{fmt}: unknown placeholder {bad} (only {{l}} and {{e}})"));
            }
        }
    }
    for (fmt, list) in [("hf", &d.tensors.ignore.hf), ("gguf", &d.tensors.ignore.gguf)] {
        for p in list {
            if let Some(bad) = unknown_placeholder(p) {
                e.push(format!("tensors.ignore.{fmt}: {p:?} has unknown placeholder {bad}"));
            }
        }
    }
    for r in required_roles(d) {
        if !d.tensors.roles.contains_key(r.name()) {
            e.push(format!("tensors.{}: missing", r.name()));
        }
    }
    if e.is_empty() { Ok(()) } else { Err(CodegenError::Invalid { file: file.to_string(), errors: e }) }
}

/// The first `{...}` in a pattern other than `{l}` / `{e}`.
fn unknown_placeholder(p: &str) -> Option<&str> {
    let mut rest = p;
    while let Some(i) = rest.find('{') {
        let end = rest[i..].find('}').map_or(rest.len(), |j| i + j + 1);
        let tok = &rest[i..end];
        if tok != "{l}" && tok != "{e}" {
            return Some(tok);
        }
        rest = &rest[end..];
    }
    None
}

fn required_roles(d: &Description) -> Vec<thin_core::role::Role> {
    use thin_core::role::Role::*;
    // The LM head is named even when tied: the importer reads it from untied checkpoints of the
    // family, and a family's descriptions share one table.
    let mut r = vec![TokenEmbd, OutputNorm, LmHead, AttnNorm, AttnQ, AttnK, AttnV, AttnO, FfnNorm];
    if d.attention.qk_norm != QkNorm::None { r.extend([AttnQNorm, AttnKNorm]); }
    if d.norm.placement == Placement::Sandwich { r.extend([AttnPostNorm, FfnPostNorm]); }
    if d.moe.is_some() { r.extend([MoeRouter, MoeGate, MoeUp, MoeDown]); } else { r.extend([FfnGate, FfnUp, FfnDown]); }
    r
}

pub fn shape_dims(d: &Description) -> ShapeDims {
    ShapeDims {
        family: d.model.family,
        vocab_size: d.dims.vocab_size,
        hidden_size: d.dims.hidden_size,
        num_layers: d.dims.num_layers,
        num_heads: d.attention.num_heads,
        num_kv_heads: d.attention.num_kv_heads,
        head_dim: d.attention.head_dim,
        intermediate_size: d.dims.intermediate_size,
        num_experts: d.moe.as_ref().map_or(0, |m| m.num_experts),
        top_k: d.moe.as_ref().map_or(0, |m| m.top_k),
        tie_word_embeddings: d.embedding.tie_word_embeddings,
    }
}

