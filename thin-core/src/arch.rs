//! Model hyperparameters as recorded in an archive, and the shape fingerprint engines check at open.

use serde::{Deserialize, Serialize};

/// Model family: decides which name tables and which block structure apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Family {
    /// Llama 2/3 and SmolLM2: pre-norm, GQA, SwiGLU, optional Llama 3 RoPE scaling.
    Llama,
    /// SmolLM3: Llama block with RoPE skipped on some layers (`no_rope_layers`).
    Smollm3,
    /// Gemma 3 text: four norms per block, QK-norm, sliding-window/global layers, GeGLU-tanh.
    Gemma3,
    /// OLMoE: mixture of experts with QK-norm over the whole projection.
    Olmoe,
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Smollm3 => "smollm3",
            Family::Gemma3 => "gemma3",
            Family::Olmoe => "olmoe",
        }
    }
}

/// Llama 3 style RoPE frequency scaling (`rope_scaling.rope_type = "llama3"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    pub rope_type: String,
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RopeConfig {
    /// Base of the global (or only) layers.
    pub theta: f64,
    /// Base of sliding-window layers where it differs (Gemma 3: 10,000 local vs 1,000,000 global).
    pub local_theta: Option<f64>,
    pub scaling: Option<RopeScaling>,
}

/// Attention span of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerAttention {
    Full,
    SlidingWindow,
}

/// Routing of a mixture-of-experts model; the expert count and top-k are shape, in [`ShapeDims`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// Renormalise the top-k router probabilities to sum to one.
    pub norm_topk_prob: bool,
}

/// Everything about a model's shape and math that the converter learns from the source
/// (`config.json` or GGUF metadata) and records in the manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArchConfig {
    /// The shape (the manifest keeps these fields at the top level of `arch`).
    #[serde(flatten)]
    pub dims: ShapeDims,
    pub rms_norm_eps: f64,
    pub max_position_embeddings: u64,
    pub rope: RopeConfig,
    /// Layers that apply no rotary embedding (SmolLM3: every fourth).
    pub no_rope_layers: Vec<u64>,
    /// Per-layer attention span; empty means every layer is `Full`.
    pub layer_attention: Vec<LayerAttention>,
    pub sliding_window: Option<u64>,
    /// Gemma 3: attention scale is `query_pre_attn_scalar^-0.5` instead of `head_dim^-0.5`.
    pub query_pre_attn_scalar: Option<f64>,
    pub final_logit_softcap: Option<f64>,
    pub attn_logit_softcap: Option<f64>,
    /// Present exactly when `dims.num_experts > 0`.
    pub moe: Option<MoeConfig>,
    /// HF `hidden_act` (`silu`, `gelu_pytorch_tanh`).
    pub hidden_act: String,
}

/// The model's dimensions: the one dims type. The manifest records it (inside
/// [`ArchConfig`]), the generated engines are specialised to it (`generated::<arch>::DIMS`), the
/// CUDA layout sizes its buffers from it, and its fingerprint decides whether an engine fits an
/// archive. `num_experts` and `top_k` are 0 for a dense model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShapeDims {
    pub family: Family,
    pub vocab_size: u64,
    pub hidden_size: u64,
    pub num_layers: u64,
    pub num_heads: u64,
    pub num_kv_heads: u64,
    pub head_dim: u64,
    pub intermediate_size: u64,
    /// Absent from archives written before it was recorded here (dense models): 0.
    #[serde(default)]
    pub num_experts: u64,
    #[serde(default)]
    pub top_k: u64,
    pub tie_word_embeddings: bool,
}

impl ShapeDims {
    /// One canonical line: the same dims always give the same bytes, whoever computes them.
    pub fn normalized(&self) -> String {
        format!(
            "thin-shape-v0;family={};vocab={};hidden={};layers={};heads={};kv_heads={};head_dim={};intermediate={};experts={};top_k={};tied={}",
            self.family.name(),
            self.vocab_size,
            self.hidden_size,
            self.num_layers,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.intermediate_size,
            self.num_experts,
            self.top_k,
            self.tie_word_embeddings
        )
    }

    /// Width of the query projection (`num_heads * head_dim`).
    pub const fn q_dim(&self) -> u64 {
        self.num_heads * self.head_dim
    }

    /// Width of the key and value projections (`num_kv_heads * head_dim`).
    pub const fn kv_dim(&self) -> u64 {
        self.num_kv_heads * self.head_dim
    }

    /// blake3 of [`Self::normalized`], hex.
    pub fn fingerprint(&self) -> String {
        blake3::hash(self.normalized().as_bytes()).to_hex().to_string()
    }
}

impl ArchConfig {
    pub fn shape_fingerprint(&self) -> String {
        self.dims.fingerprint()
    }

    /// Whether layer `l` applies RoPE.
    pub fn layer_uses_rope(&self, l: u64) -> bool {
        !self.no_rope_layers.contains(&l)
    }

    /// Factor on the token embedding. Not a field of the manifest: every Gemma 3 source (HF's
    /// `Gemma3TextScaledWordEmbedding`, llama.cpp's gemma3 graph) scales by `sqrt(hidden)`, and no
    /// other family scales, so the family decides it.
    pub fn embedding_scale(&self) -> f64 {
        match self.dims.family {
            Family::Gemma3 => (self.dims.hidden_size as f64).sqrt(),
            Family::Llama | Family::Smollm3 | Family::Olmoe => 1.0,
        }
    }

    /// Factor on the attention logits: `query_pre_attn_scalar^-0.5`, else `head_dim^-0.5`.
    pub fn attention_scale(&self) -> f64 {
        1.0 / self.query_pre_attn_scalar.unwrap_or(self.dims.head_dim as f64).sqrt()
    }

    pub fn layer_attention(&self, l: u64) -> LayerAttention {
        self.layer_attention.get(l as usize).copied().unwrap_or(LayerAttention::Full)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprint_is_stable_and_sensitive() {
        let d = ShapeDims {
            family: Family::Llama,
            vocab_size: 49152,
            hidden_size: 576,
            num_layers: 30,
            num_heads: 9,
            num_kv_heads: 3,
            head_dim: 64,
            intermediate_size: 1536,
            num_experts: 0,
            top_k: 0,
            tie_word_embeddings: true,
        };
        assert_eq!(d.fingerprint(), d.clone().fingerprint());
        let mut e = d.clone();
        e.num_layers = 29;
        assert_ne!(d.fingerprint(), e.fingerprint());
        assert!(d.normalized().starts_with("thin-shape-v0;family=llama;vocab=49152"));
    }
}
