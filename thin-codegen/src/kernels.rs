//! The CUDA kernels of a description, rendered from `kernels/decode.cu.j2` at its exact shapes.

use std::collections::BTreeMap;

use thin_core::cuda::plan::Schedule;

use crate::description::*;

/// The decode-step kernels of one arch at its exact shapes, the weight-reading ones once per
/// storage type the kernels have a traits block for.
#[derive(askama::Template)]
#[template(path = "decode.cu.j2", escape = "none")]
pub struct DecodeKernels {
    pub arch: String,
    /// Storage types with a traits block ([`thin_core::cuda::plan::WEIGHT_TYPES`] by name).
    pub formats: Vec<String>,
    pub vocab: u64,
    pub hidden: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub ffn: u64,
    /// Experts of a mixture-of-experts MLP and how many each token takes (0 for a dense MLP).
    pub experts: u64,
    pub top_k: u64,
    /// Prefill's grouped MoE kernels: most pairs a tile, and the f32 inputs its staging holds.
    pub moe_tile_rows: usize,
    pub moe_stage_floats: usize,
    pub eps: String,
    pub emb_scale: String,
    /// The embedding scale rounded to bf16, as HF applies it to bf16 weights.
    pub emb_scale_bf16: String,
    pub attn_scale: String,
    pub act: &'static str,
    pub qk_norm: bool,
    pub attn_cluster: usize,
    pub matvec_warps: u32,
    pub attn_warps: u32,
    /// The kernels the schedule launches: the variants it does not use are not rendered.
    pub kernels: Vec<&'static str>,
}

impl DecodeKernels {
    /// Whether the schedule launches kernel `name` (the template renders it only then).
    fn uses(&self, name: &str) -> bool {
        self.kernels.contains(&name)
    }
}

/// The CUDA source of one arch (`decode.cu`): the kernels `schedule` launches.
pub fn emit_kernels(d: &Description, schedule: &Schedule) -> Result<BTreeMap<String, String>, askama::Error> {
    use askama::Template;
    use thin_core::cuda::plan as cp;
    let a = &d.attention;
    let h = d.dims.hidden_size;
    let emb = match d.embedding.scale { EmbScale::None => 1.0, EmbScale::SqrtHidden => (h as f64).sqrt() };
    let k = DecodeKernels {
        arch: d.model.name.clone(),
        formats: cp::WEIGHT_TYPES.iter().map(|t| t.name().to_string()).collect(),
        vocab: d.dims.vocab_size,
        hidden: h,
        heads: a.num_heads,
        kv_heads: a.num_kv_heads,
        head_dim: a.head_dim,
        ffn: d.dims.intermediate_size,
        experts: d.moe.as_ref().map_or(0, |m| m.num_experts),
        top_k: d.moe.as_ref().map_or(0, |m| m.top_k),
        moe_tile_rows: cp::MOE_TILE_ROWS,
        moe_stage_floats: cp::MOE_STAGE_BYTES / 4,
        eps: format!("{:e}", d.norm.eps),
        emb_scale: format!("{emb:e}"),
        emb_scale_bf16: format!("{:e}", half::bf16::from_f64(emb).to_f64()),
        attn_scale: format!("{:e}", 1.0 / a.query_pre_attn_scalar.unwrap_or(a.head_dim as f64).sqrt()),
        act: match d.mlp.kind { MlpKind::Swiglu => "silu", MlpKind::GegluTanh => "gelu_tanh" },
        qk_norm: a.qk_norm == QkNorm::PerHead,
        attn_cluster: cp::ATTN_CLUSTER,
        matvec_warps: cp::MATVEC_WARPS,
        attn_warps: cp::ATTN_WARPS,
        kernels: schedule.kernels(),
    };
    Ok(BTreeMap::from([("decode.cu".to_string(), k.render()?)]))
}
