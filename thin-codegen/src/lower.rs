//! Lowering: a validated description → the per-layer list of ops both backends follow.

use serde::Serialize;

use crate::description::*;

/// One lowered op; buffers are named fields of the engine state.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    Embed { out: String, hidden: u64, scale: f64 },
    RmsNorm { weight: String, input: String, out: String, dim: u64 },
    Matvec { weight: String, input: String, out: String, out_dim: u64, in_dim: u64 },
    QkNorm { weight: String, buf: String, dim: u64, total: u64 },
    Rope { buf: String, table: String, theta: f64 },
    KvWrite { layer: u64 },
    Attention { layer: u64, window: Option<u64>, scale: f64, softcap: Option<f64> },
    ResidualAdd { into: String, from: String },
    Mlp { kind: MlpKind, ffn: u64 },
    Moe { experts: u64, top_k: u64, renorm: bool, ffn: u64 },
    LmHead { weight: String, vocab: u64, hidden: u64 },
    Softcap { buf: String, cap: f64 },
}

#[derive(Debug, Clone, Serialize)]
pub struct LayerPlan { pub layer: u64, pub attention: AttnKind, pub rope: bool, pub ops: Vec<Op> }

#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub arch: String,
    pub fingerprint: String,
    pub prologue: Vec<Op>,
    pub layers: Vec<LayerPlan>,
    pub epilogue: Vec<Op>,
}

fn s(x: &str) -> String { x.to_string() }

pub fn lower(d: &Description) -> Plan {
    let a = &d.attention;
    let h = d.dims.hidden_size;
    let qd = a.num_heads * a.head_dim;
    let kvd = a.num_kv_heads * a.head_dim;
    let scale = 1.0 / a.query_pre_attn_scalar.unwrap_or(a.head_dim as f64).sqrt();
    let emb_scale = match d.embedding.scale { EmbScale::None => 1.0, EmbScale::SqrtHidden => (h as f64).sqrt() };
    let mut layers = Vec::new();
    for l in 0..d.dims.num_layers {
        let kind = if a.pattern.is_empty() { AttnKind::Full } else { a.pattern[(l as usize) % a.pattern.len()] };
        let rope = d.rope.skip_every.map_or(true, |n| (l + 1) % n != 0);
        let mut ops = vec![
            Op::RmsNorm { weight: s("attn_norm"), input: s("x"), out: s("xn"), dim: h },
            Op::Matvec { weight: s("attn_q"), input: s("xn"), out: s("q"), out_dim: qd, in_dim: h },
            Op::Matvec { weight: s("attn_k"), input: s("xn"), out: s("k"), out_dim: kvd, in_dim: h },
            Op::Matvec { weight: s("attn_v"), input: s("xn"), out: s("v"), out_dim: kvd, in_dim: h },
        ];
        match a.qk_norm {
            QkNorm::None => {}
            QkNorm::PerHead => {
                ops.push(Op::QkNorm { weight: s("attn_q_norm"), buf: s("q"), dim: a.head_dim, total: qd });
                ops.push(Op::QkNorm { weight: s("attn_k_norm"), buf: s("k"), dim: a.head_dim, total: kvd });
            }
            QkNorm::Whole => {
                ops.push(Op::QkNorm { weight: s("attn_q_norm"), buf: s("q"), dim: qd, total: qd });
                ops.push(Op::QkNorm { weight: s("attn_k_norm"), buf: s("k"), dim: kvd, total: kvd });
            }
        }
        if rope {
            let (table, theta) = match (kind, d.rope.local_theta) {
                (AttnKind::Sliding, Some(t)) => (s("local"), t),
                _ => (s("global"), d.rope.theta),
            };
            ops.push(Op::Rope { buf: s("q"), table: table.clone(), theta });
            ops.push(Op::Rope { buf: s("k"), table, theta });
        }
        ops.push(Op::KvWrite { layer: l });
        let window = match kind { AttnKind::Full => None, AttnKind::Sliding => a.sliding_window };
        ops.push(Op::Attention { layer: l, window, scale, softcap: a.softcap });
        ops.push(Op::Matvec { weight: s("attn_o"), input: s("att"), out: s("o"), out_dim: h, in_dim: qd });
        if d.norm.placement == Placement::Sandwich {
            ops.push(Op::RmsNorm { weight: s("attn_post_norm"), input: s("o"), out: s("o"), dim: h });
        }
        ops.push(Op::ResidualAdd { into: s("x"), from: s("o") });
        ops.push(Op::RmsNorm { weight: s("ffn_norm"), input: s("x"), out: s("xn"), dim: h });
        match &d.moe {
            None => ops.push(Op::Mlp { kind: d.mlp.kind, ffn: d.dims.intermediate_size }),
            Some(m) => ops.push(Op::Moe { experts: m.num_experts, top_k: m.top_k, renorm: m.norm_topk_prob, ffn: d.dims.intermediate_size }),
        }
        if d.norm.placement == Placement::Sandwich {
            ops.push(Op::RmsNorm { weight: s("ffn_post_norm"), input: s("down"), out: s("down"), dim: h });
        }
        ops.push(Op::ResidualAdd { into: s("x"), from: s("down") });
        layers.push(LayerPlan { layer: l, attention: kind, rope, ops });
    }
    let lm = if d.embedding.tie_word_embeddings { "token_embd" } else { "lm_head" };
    let mut epilogue = vec![
        Op::RmsNorm { weight: s("output_norm"), input: s("x"), out: s("xn"), dim: h },
        Op::LmHead { weight: s(lm), vocab: d.dims.vocab_size, hidden: h },
    ];
    if let Some(c) = d.final_logit_softcap {
        epilogue.push(Op::Softcap { buf: s("logits"), cap: c });
    }
    Plan {
        arch: d.model.name.clone(),
        fingerprint: shape_dims(d).fingerprint(),
        prologue: vec![Op::Embed { out: s("x"), hidden: h, scale: emb_scale }],
        layers,
        epilogue,
    }
}

