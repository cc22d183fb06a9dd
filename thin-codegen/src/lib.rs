//! thin-codegen: archs/*.toml → parse → validate → per-layer plan → Rust engine module in generated/.

use proc_macro2::TokenStream;
use quote::{format_ident, quote};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use thin_core::arch::{Family, ShapeDims};

pub const CODEGEN_VERSION: &str = env!("CARGO_PKG_VERSION");

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
    pub tensors: BTreeMap<String, TensorNames>,
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

pub fn parse(file: &str, text: &str) -> Result<Description, CodegenError> {
    toml::from_str(text).map_err(|e| CodegenError::Parse { file: file.to_string(), msg: e.to_string() })
}

/// Every problem in the description at once, each naming its key path.
pub fn validate(file: &str, d: &Description) -> Result<(), CodegenError> {
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
    }
    let expect_act = match d.mlp.kind { MlpKind::Swiglu => "silu", MlpKind::GegluTanh => "gelu_pytorch_tanh" };
    if d.mlp.hidden_act != expect_act {
        e.push(format!("mlp.hidden_act: {:?} does not match mlp.kind (expected {expect_act:?})", d.mlp.hidden_act));
    }
    for k in d.tensors.keys() {
        match thin_core::role::Role::from_name(k) {
            None => e.push(format!("tensors.{k}: unknown role")),
            Some(r) if r.is_per_layer() => {
                let t = &d.tensors[k];
                if !t.hf.contains("{l}") {
                    e.push(format!("tensors.{k}.hf: per-layer pattern lacks {{l}}"));
                }
                if !t.gguf.contains("{l}") {
                    e.push(format!("tensors.{k}.gguf: per-layer pattern lacks {{l}}"));
                }
            }
            Some(_) => {}
        }
    }
    for r in required_roles(d) {
        if !d.tensors.contains_key(r.name()) {
            e.push(format!("tensors.{}: missing", r.name()));
        }
    }
    if e.is_empty() { Ok(()) } else { Err(CodegenError::Invalid { file: file.to_string(), errors: e }) }
}

fn required_roles(d: &Description) -> Vec<thin_core::role::Role> {
    use thin_core::role::Role::*;
    let mut r = vec![TokenEmbd, OutputNorm, AttnNorm, AttnQ, AttnK, AttnV, AttnO, FfnNorm];
    if !d.embedding.tie_word_embeddings { r.push(LmHead); }
    if d.attention.qk_norm != QkNorm::None { r.extend([AttnQNorm, AttnKNorm]); }
    if d.norm.placement == Placement::Sandwich { r.extend([AttnPostNorm, FfnPostNorm]); }
    if d.moe.is_some() { r.extend([MoeRouter, MoeGate, MoeUp, MoeDown]); } else { r.extend([FfnGate, FfnUp, FfnDown]); }
    r
}

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
    Attention { layer: u64, window: Option<u64>, scale: f64 },
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
        ops.push(Op::Attention { layer: l, window, scale });
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

fn role_tokens(name: &str) -> TokenStream {
    let r = thin_core::role::Role::from_name(name).expect("plan names only known roles");
    let v = format_ident!("{}", format!("{r:?}"));
    quote!(thin_core::role::Role::#v)
}

fn lit_u(x: u64) -> TokenStream { let x = x as usize; quote!(#x) }

fn emit_op(op: &Op, layer: Option<u64>, eps: f32) -> TokenStream {
    let lay = match layer { Some(l) => { let l = l as u32; quote!(Some(#l)) } None => quote!(None) };
    match op {
        Op::Embed { out, hidden, scale } => {
            let out = format_ident!("{}", out);
            let hdn = lit_u(*hidden);
            let sc = *scale as f32;
            quote! {
                let table = w.expect(thin_core::role::Role::TokenEmbd, None, consts::VOCAB * consts::HIDDEN)?;
                thin_core::cpu::embedding(table, token as usize, #hdn, #sc, &mut s.#out);
            }
        }
        Op::RmsNorm { weight, input, out, dim } => {
            let r = role_tokens(weight);
            let d = lit_u(*dim);
            let i = format_ident!("{}", input);
            let o = format_ident!("{}", out);
            // The norm weight is read where it is stored (no copy per layer per token).
            if input == out {
                quote! {
                    s.tmp.copy_from_slice(&s.#i);
                    thin_core::cpu::rms_norm_view(&s.tmp, w.expect(#r, #lay, #d)?, #eps, &mut s.#o);
                }
            } else {
                quote! { thin_core::cpu::rms_norm_view(&s.#i, w.expect(#r, #lay, #d)?, #eps, &mut s.#o); }
            }
        }
        Op::Matvec { weight, input, out, out_dim, in_dim } => {
            let r = role_tokens(weight);
            let n = lit_u(out_dim * in_dim);
            let i = format_ident!("{}", input);
            let o = format_ident!("{}", out);
            quote! { thin_core::cpu::matvec(w.expect(#r, #lay, #n)?, &s.#i, &mut s.#o); }
        }
        Op::QkNorm { weight, buf, dim, .. } => {
            let r = role_tokens(weight);
            let d = lit_u(*dim);
            let b = format_ident!("{}", buf);
            quote! { thin_core::cpu::rms_norm_chunks_view(&mut s.#b, w.expect(#r, #lay, #d)?, #eps); }
        }
        Op::Rope { buf, table, .. } => {
            let b = format_ident!("{}", buf);
            let (c, sn) = (format_ident!("cos_{}", table), format_ident!("sin_{}", table));
            quote! {
                let half = consts::HEAD_DIM / 2;
                thin_core::cpu::rope(&mut s.#b, consts::HEAD_DIM, &s.#c[pos * half..(pos + 1) * half], &s.#sn[pos * half..(pos + 1) * half]);
            }
        }
        Op::KvWrite { layer } => {
            let l = lit_u(*layer);
            quote! { thin_core::cpu::kv_write(&s.k, &s.v, pos, &mut s.k_cache[#l], &mut s.v_cache[#l]); }
        }
        Op::Attention { layer, window, scale } => {
            let l = lit_u(*layer);
            let win = match window { Some(x) => { let x = *x as usize; quote!(Some(#x)) } None => quote!(None) };
            let sc = *scale as f32;
            quote! {
                let p = thin_core::cpu::AttnParams { num_heads: consts::NUM_HEADS, num_kv_heads: consts::NUM_KV_HEADS, head_dim: consts::HEAD_DIM, scale: #sc, window: #win, softcap: consts::ATTN_SOFTCAP };
                thin_core::cpu::attention(&s.q, &s.k_cache[#l], &s.v_cache[#l], pos, p, &mut s.att);
            }
        }
        Op::ResidualAdd { into, from } => {
            let a = format_ident!("{}", into);
            let b = format_ident!("{}", from);
            quote! { thin_core::cpu::residual_add(&mut s.#a, &s.#b); }
        }
        Op::Mlp { kind, .. } => {
            let act = match kind { MlpKind::Swiglu => quote!(swiglu), MlpKind::GegluTanh => quote!(geglu) };
            quote! {
                let n = consts::FFN * consts::HIDDEN;
                thin_core::cpu::matvec(w.expect(thin_core::role::Role::FfnGate, #lay, n)?, &s.xn, &mut s.gate);
                thin_core::cpu::matvec(w.expect(thin_core::role::Role::FfnUp, #lay, n)?, &s.xn, &mut s.up);
                thin_core::cpu::#act(&mut s.gate, &s.up);
                thin_core::cpu::matvec(w.expect(thin_core::role::Role::FfnDown, #lay, n)?, &s.gate, &mut s.down);
            }
        }
        Op::Moe { renorm, .. } => {
            quote! {
                thin_core::cpu::matvec(w.expect(thin_core::role::Role::MoeRouter, #lay, consts::NUM_EXPERTS * consts::HIDDEN)?, &s.xn, &mut s.router);
                let n = consts::FFN * consts::HIDDEN;
                let gate_all = w.expect(thin_core::role::Role::MoeGate, #lay, consts::NUM_EXPERTS * n)?;
                let up_all = w.expect(thin_core::role::Role::MoeUp, #lay, consts::NUM_EXPERTS * n)?;
                let down_all = w.expect(thin_core::role::Role::MoeDown, #lay, consts::NUM_EXPERTS * n)?;
                s.down.iter_mut().for_each(|v| *v = 0.0);
                for (e, p) in thin_core::cpu::topk_router(&s.router, consts::TOP_K, #renorm) {
                    thin_core::cpu::matvec(gate_all.slice(e * n, (e + 1) * n), &s.xn, &mut s.gate);
                    thin_core::cpu::matvec(up_all.slice(e * n, (e + 1) * n), &s.xn, &mut s.up);
                    thin_core::cpu::swiglu(&mut s.gate, &s.up);
                    thin_core::cpu::matvec(down_all.slice(e * n, (e + 1) * n), &s.gate, &mut s.tmp);
                    for (d, t) in s.down.iter_mut().zip(&s.tmp) { *d += p * t; }
                }
            }
        }
        Op::LmHead { weight, .. } => {
            let r = role_tokens(weight);
            quote! { thin_core::cpu::matvec(w.expect(#r, None, consts::VOCAB * consts::HIDDEN)?, &s.xn, &mut s.logits); }
        }
        Op::Softcap { buf, cap } => {
            let b = format_ident!("{}", buf);
            let c = *cap as f32;
            quote! { thin_core::cpu::softcap(&mut s.#b, #c); }
        }
    }
}

/// Width of one row of a state buffer, as the consts name it.
fn row_dim(buf: &str) -> TokenStream {
    match buf {
        "q" | "att" => quote!(consts::Q_DIM),
        "k" | "v" => quote!(consts::KV_DIM),
        "gate" | "up" => quote!(consts::FFN),
        _ => quote!(consts::HIDDEN),
    }
}

/// One op over all `n` prompt rows at once (prefill): weights are read once per layer, not once per
/// token. Row `t` is at position `pos + t`; every row gets exactly the arithmetic of [`emit_op`], so
/// prefill and token-by-token decode give the same bits.
fn emit_op_batch(op: &Op, layer: Option<u64>, eps: f32) -> TokenStream {
    let lay = match layer { Some(l) => { let l = l as u32; quote!(Some(#l)) } None => quote!(None) };
    match op {
        Op::Embed { out, hidden, scale } => {
            let out = format_ident!("{}", out);
            let hdn = lit_u(*hidden);
            let sc = *scale as f32;
            quote! {
                let table = w.expect(thin_core::role::Role::TokenEmbd, None, consts::VOCAB * consts::HIDDEN)?;
                for (t, &token) in tokens.iter().enumerate() {
                    thin_core::cpu::embedding(table, token as usize, #hdn, #sc, &mut b.#out[t * consts::HIDDEN..(t + 1) * consts::HIDDEN]);
                }
            }
        }
        Op::RmsNorm { weight, input, out, dim } => {
            let r = role_tokens(weight);
            let d = lit_u(*dim);
            let i = format_ident!("{}", input);
            let o = format_ident!("{}", out);
            let src = if input == out { quote!(b.tmp) } else { quote!(b.#i) };
            let copy = if input == out { quote!(b.tmp.copy_from_slice(&b.#i);) } else { quote!() };
            quote! {
                let g = w.expect(#r, #lay, #d)?;
                #copy
                for (xr, yr) in #src.chunks_exact(#d).zip(b.#o.chunks_exact_mut(#d)) {
                    thin_core::cpu::rms_norm_view(xr, g, #eps, yr);
                }
            }
        }
        Op::Matvec { weight, input, out, out_dim, in_dim } => {
            let r = role_tokens(weight);
            let n = lit_u(out_dim * in_dim);
            let k = lit_u(*in_dim);
            let i = format_ident!("{}", input);
            let o = format_ident!("{}", out);
            quote! { thin_core::cpu::matmul(w.expect(#r, #lay, #n)?, &b.#i, #k, &mut b.#o); }
        }
        Op::QkNorm { weight, buf, dim, .. } => {
            let r = role_tokens(weight);
            let d = lit_u(*dim);
            let bf = format_ident!("{}", buf);
            quote! { thin_core::cpu::rms_norm_chunks_view(&mut b.#bf, w.expect(#r, #lay, #d)?, #eps); }
        }
        Op::Rope { buf, table, .. } => {
            let bf = format_ident!("{}", buf);
            let dim = row_dim(buf);
            let (c, sn) = (format_ident!("cos_{}", table), format_ident!("sin_{}", table));
            quote! {
                let half = consts::HEAD_DIM / 2;
                for (t, row) in b.#bf.chunks_exact_mut(#dim).enumerate() {
                    let p = pos + t;
                    thin_core::cpu::rope(row, consts::HEAD_DIM, &s.#c[p * half..(p + 1) * half], &s.#sn[p * half..(p + 1) * half]);
                }
            }
        }
        Op::KvWrite { layer } => {
            let l = lit_u(*layer);
            quote! {
                for (t, (kr, vr)) in b.k.chunks_exact(consts::KV_DIM).zip(b.v.chunks_exact(consts::KV_DIM)).enumerate() {
                    thin_core::cpu::kv_write(kr, vr, pos + t, &mut s.k_cache[#l], &mut s.v_cache[#l]);
                }
            }
        }
        Op::Attention { layer, window, scale } => {
            let l = lit_u(*layer);
            let win = match window { Some(x) => { let x = *x as usize; quote!(Some(#x)) } None => quote!(None) };
            let sc = *scale as f32;
            quote! {
                let p = thin_core::cpu::AttnParams { num_heads: consts::NUM_HEADS, num_kv_heads: consts::NUM_KV_HEADS, head_dim: consts::HEAD_DIM, scale: #sc, window: #win, softcap: consts::ATTN_SOFTCAP };
                for (t, (qr, ar)) in b.q.chunks_exact(consts::Q_DIM).zip(b.att.chunks_exact_mut(consts::Q_DIM)).enumerate() {
                    thin_core::cpu::attention(qr, &s.k_cache[#l], &s.v_cache[#l], pos + t, p, ar);
                }
            }
        }
        Op::ResidualAdd { into, from } => {
            let a = format_ident!("{}", into);
            let f = format_ident!("{}", from);
            quote! { thin_core::cpu::residual_add(&mut b.#a, &b.#f); }
        }
        Op::Mlp { kind, .. } => {
            let act = match kind { MlpKind::Swiglu => quote!(swiglu), MlpKind::GegluTanh => quote!(geglu) };
            quote! {
                let n = consts::FFN * consts::HIDDEN;
                thin_core::cpu::matmul(w.expect(thin_core::role::Role::FfnGate, #lay, n)?, &b.xn, consts::HIDDEN, &mut b.gate);
                thin_core::cpu::matmul(w.expect(thin_core::role::Role::FfnUp, #lay, n)?, &b.xn, consts::HIDDEN, &mut b.up);
                thin_core::cpu::#act(&mut b.gate, &b.up);
                thin_core::cpu::matmul(w.expect(thin_core::role::Role::FfnDown, #lay, n)?, &b.gate, consts::FFN, &mut b.down);
            }
        }
        Op::Moe { .. } => {
            // Each row routes to its own experts: the single-token MoE, row by row.
            let one = emit_op(op, layer, eps);
            quote! {
                for t in 0..tokens.len() {
                    s.xn.copy_from_slice(&b.xn[t * consts::HIDDEN..(t + 1) * consts::HIDDEN]);
                    #one
                    b.down[t * consts::HIDDEN..(t + 1) * consts::HIDDEN].copy_from_slice(&s.down);
                }
            }
        }
        Op::LmHead { .. } | Op::Softcap { .. } => unreachable!("the epilogue runs on the last row only"),
    }
}

/// The Rust module for one description.
pub fn emit_rust(d: &Description, plan: &Plan) -> TokenStream {
    let a = &d.attention;
    let u = |x: u64| lit_u(x);
    let (vocab, hidden, layers, heads, kv, hd, ffn) = (u(d.dims.vocab_size), u(d.dims.hidden_size), u(d.dims.num_layers), u(a.num_heads), u(a.num_kv_heads), u(a.head_dim), u(d.dims.intermediate_size));
    let max_seq = u(d.dims.max_position_embeddings.min(4096));
    let experts = u(d.moe.as_ref().map_or(0, |m| m.num_experts));
    let top_k = u(d.moe.as_ref().map_or(0, |m| m.top_k));
    let fp = &plan.fingerprint;
    let eps = d.norm.eps as f32;
    let name = &d.model.name;
    let attn_softcap = match a.softcap { Some(c) => { let c = c as f32; quote!(Some(#c)) } None => quote!(None) };
    let theta = d.rope.theta;
    let local_theta = d.rope.local_theta.unwrap_or(d.rope.theta);
    let inv = |t: f64| inv_freq_tokens(d, t, quote!(consts::HEAD_DIM));
    let (inv_g, inv_l) = (inv(theta), inv(local_theta));
    let prologue: Vec<_> = plan.prologue.iter().map(|o| emit_op(o, None, eps)).collect();
    let epilogue: Vec<_> = plan.epilogue.iter().map(|o| emit_op(o, None, eps)).collect();
    let mut layer_fns = Vec::new();
    let mut layer_calls = Vec::new();
    let mut batch_calls = Vec::new();
    let prologue_b: Vec<_> = plan.prologue.iter().map(|o| emit_op_batch(o, None, eps)).collect();
    for lp in &plan.layers {
        let f = format_ident!("layer_{}", lp.layer);
        let body: Vec<_> = lp.ops.iter().map(|o| emit_op(o, Some(lp.layer), eps)).collect();
        let doc = format!(" Layer {}: {:?} attention, rope {}.", lp.layer, lp.attention, if lp.rope { "on" } else { "off" });
        layer_fns.push(quote! {
            #[doc = #doc]
            #[allow(unused_variables)]
            fn #f(w: &W, s: &mut State, pos: usize) -> Result<(), EngineError> { #(#body)* Ok(()) }
        });
        layer_calls.push(quote! { Self::#f(w, s, pos)?; });
        let fb = format_ident!("layer_{}_prefill", lp.layer);
        let body_b: Vec<_> = lp.ops.iter().map(|o| emit_op_batch(o, Some(lp.layer), eps)).collect();
        let doc_b = format!(" Layer {} over all prompt rows.", lp.layer);
        layer_fns.push(quote! {
            #[doc = #doc_b]
            #[allow(unused_variables)]
            fn #fb(w: &W, s: &mut State, b: &mut Batch, tokens: &[u32], pos: usize) -> Result<(), EngineError> { #(#body_b)* Ok(()) }
        });
        batch_calls.push(quote! { Self::#fb(w, s, &mut b, tokens, pos)?; });
    }
    let modoc = format!(" Engine for `{name}`, generated from its architecture description.");
    quote! {
        #![doc = #modoc]
        #![allow(clippy::all, unused_imports, dead_code)]
        use thin_core::engine::{EngineError, Weights};

        /// Every dim of the architecture, as consts.
        pub mod consts {
            pub const VOCAB: usize = #vocab;
            pub const HIDDEN: usize = #hidden;
            pub const NUM_LAYERS: usize = #layers;
            pub const NUM_HEADS: usize = #heads;
            pub const NUM_KV_HEADS: usize = #kv;
            pub const HEAD_DIM: usize = #hd;
            pub const Q_DIM: usize = NUM_HEADS * HEAD_DIM;
            pub const KV_DIM: usize = NUM_KV_HEADS * HEAD_DIM;
            pub const FFN: usize = #ffn;
            pub const NUM_EXPERTS: usize = #experts;
            pub const TOP_K: usize = #top_k;
            pub const MAX_SEQ: usize = #max_seq;
            pub const RMS_EPS: f32 = #eps;
            pub const ATTN_SOFTCAP: Option<f32> = #attn_softcap;
        }

        pub const ARCH: &str = #name;
        /// Must equal the archive's `ShapeDims::fingerprint()`.
        pub const SHAPE_FINGERPRINT: &str = #fp;

        /// Every buffer, allocated once.
        pub struct State {
            x: Vec<f32>, xn: Vec<f32>, tmp: Vec<f32>, q: Vec<f32>, k: Vec<f32>, v: Vec<f32>, att: Vec<f32>, o: Vec<f32>,
            gate: Vec<f32>, up: Vec<f32>, down: Vec<f32>, router: Vec<f32>, logits: Vec<f32>,
            k_cache: Vec<Vec<f32>>, v_cache: Vec<Vec<f32>>,
            cos_global: Vec<f32>, sin_global: Vec<f32>, cos_local: Vec<f32>, sin_local: Vec<f32>,
        }

        pub struct Engine<W: Weights> { w: W, s: State, pos: usize }

        /// Prefill's buffers: one row per prompt token of each per-token buffer, allocated per prompt.
        struct Batch {
            x: Vec<f32>, xn: Vec<f32>, tmp: Vec<f32>, q: Vec<f32>, k: Vec<f32>, v: Vec<f32>, att: Vec<f32>, o: Vec<f32>,
            gate: Vec<f32>, up: Vec<f32>, down: Vec<f32>,
        }

        impl Batch {
            fn new(rows: usize) -> Self {
                Batch {
                    x: vec![0.0; rows * consts::HIDDEN], xn: vec![0.0; rows * consts::HIDDEN], tmp: vec![0.0; rows * consts::HIDDEN],
                    q: vec![0.0; rows * consts::Q_DIM], k: vec![0.0; rows * consts::KV_DIM], v: vec![0.0; rows * consts::KV_DIM],
                    att: vec![0.0; rows * consts::Q_DIM], o: vec![0.0; rows * consts::HIDDEN],
                    gate: vec![0.0; rows * consts::FFN], up: vec![0.0; rows * consts::FFN], down: vec![0.0; rows * consts::HIDDEN],
                }
            }
        }

        impl<W: Weights> Engine<W> {
            pub fn new(w: W) -> Self {
                let (cos_global, sin_global) = thin_core::cpu::rope_tables(&#inv_g, consts::MAX_SEQ);
                let (cos_local, sin_local) = thin_core::cpu::rope_tables(&#inv_l, consts::MAX_SEQ);
                let s = State {
                    x: vec![0.0; consts::HIDDEN], xn: vec![0.0; consts::HIDDEN], tmp: vec![0.0; consts::HIDDEN],
                    q: vec![0.0; consts::Q_DIM], k: vec![0.0; consts::KV_DIM], v: vec![0.0; consts::KV_DIM],
                    att: vec![0.0; consts::Q_DIM], o: vec![0.0; consts::HIDDEN],
                    gate: vec![0.0; consts::FFN], up: vec![0.0; consts::FFN], down: vec![0.0; consts::HIDDEN],
                    router: vec![0.0; consts::NUM_EXPERTS], logits: vec![0.0; consts::VOCAB],
                    // One zeroed allocation per layer (not clones of one): pages are touched as positions fill.
                    k_cache: (0..consts::NUM_LAYERS).map(|_| vec![0.0; consts::MAX_SEQ * consts::KV_DIM]).collect(),
                    v_cache: (0..consts::NUM_LAYERS).map(|_| vec![0.0; consts::MAX_SEQ * consts::KV_DIM]).collect(),
                    cos_global, sin_global, cos_local, sin_local,
                };
                Engine { w, s, pos: 0 }
            }

            #(#layer_fns)*

            fn forward(&mut self, token: u32) -> Result<(), EngineError> {
                if token as usize >= consts::VOCAB {
                    return Err(EngineError::TokenOutOfRange { token, vocab: consts::VOCAB });
                }
                if self.pos >= consts::MAX_SEQ {
                    return Err(EngineError::ContextFull { pos: self.pos, max_seq: consts::MAX_SEQ });
                }
                let pos = self.pos;
                let w = &self.w;
                let s = &mut self.s;
                #(#prologue)*
                #(#layer_calls)*
                #(#epilogue)*
                self.pos += 1;
                Ok(())
            }

            /// Every prompt token through each layer at once (weights read once per layer); the
            /// epilogue (LM head) runs on the last row only.
            fn forward_prompt(&mut self, tokens: &[u32]) -> Result<(), EngineError> {
                if let Some(&token) = tokens.iter().find(|&&t| t as usize >= consts::VOCAB) {
                    return Err(EngineError::TokenOutOfRange { token, vocab: consts::VOCAB });
                }
                if self.pos + tokens.len() > consts::MAX_SEQ {
                    return Err(EngineError::ContextFull { pos: consts::MAX_SEQ, max_seq: consts::MAX_SEQ });
                }
                let pos = self.pos;
                let w = &self.w;
                let s = &mut self.s;
                let mut b = Batch::new(tokens.len());
                #(#prologue_b)*
                #(#batch_calls)*
                let last = tokens.len() - 1;
                s.x.copy_from_slice(&b.x[last * consts::HIDDEN..(last + 1) * consts::HIDDEN]);
                #(#epilogue)*
                self.pos += tokens.len();
                Ok(())
            }
        }

        impl<W: Weights> thin_core::engine::Engine for Engine<W> {
            fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
                if tokens.is_empty() { return Err(EngineError::EmptyPrompt); }
                self.forward_prompt(tokens)?;
                Ok(self.s.logits.clone())
            }
            fn decode_step(&mut self, token: u32) -> Result<Vec<f32>, EngineError> {
                self.forward(token)?;
                Ok(self.s.logits.clone())
            }
            fn reset(&mut self) { self.pos = 0; }
        }
    }
}

/// The expression computing the RoPE inverse frequencies for `theta` (with the arch's scaling).
fn inv_freq_tokens(d: &Description, theta: f64, head_dim: TokenStream) -> TokenStream {
    match &d.rope.scaling {
        Some(sc) => {
            let (f, lo, hi, orig) = (sc.factor, sc.low_freq_factor, sc.high_freq_factor, sc.original_max_position_embeddings as f64);
            quote!(thin_core::cpu::llama3_inv_freq(&thin_core::cpu::rope_inv_freq(#head_dim, #theta), #f, #lo, #hi, #orig))
        }
        None => quote!(thin_core::cpu::rope_inv_freq(#head_dim, #theta)),
    }
}

/// The `cuda` submodule of a generated engine: the arch as the CUDA runtime sees it, with the
/// kernel sources embedded. Plain data, so it builds with or without the `cuda` feature.
pub fn emit_cuda_module(d: &Description, plan: &Plan) -> TokenStream {
    let a = &d.attention;
    let u = |x: u64| lit_u(x);
    let (vocab, hidden, heads, kv, hd, ffn) = (u(d.dims.vocab_size), u(d.dims.hidden_size), u(a.num_heads), u(a.num_kv_heads), u(a.head_dim), u(d.dims.intermediate_size));
    let max_pos = u(d.dims.max_position_embeddings);
    let sandwich = d.norm.placement == Placement::Sandwich;
    let qk_norm = a.qk_norm != QkNorm::None;
    let tied = d.embedding.tie_word_embeddings;
    let moe = d.moe.is_some();
    let opt = |x: Option<f64>| match x { Some(c) => { let c = c as f32; quote!(Some(#c)) } None => quote!(None) };
    let (attn_softcap, final_softcap) = (opt(a.softcap), opt(d.final_logit_softcap));
    let inv = |t: f64| inv_freq_tokens(d, t, hd.clone());
    let (inv_g, inv_l) = (inv(d.rope.theta), inv(d.rope.local_theta.unwrap_or(d.rope.theta)));
    let layers: Vec<_> = plan
        .layers
        .iter()
        .map(|lp| {
            let sliding = lp.attention == AttnKind::Sliding;
            let rope = if !lp.rope {
                quote!(None)
            } else if sliding && d.rope.local_theta.is_some() {
                quote!(Some(RopeTable::Local))
            } else {
                quote!(Some(RopeTable::Global))
            };
            let window = match (sliding, a.sliding_window) { (true, Some(w)) => { let w = w as usize; quote!(Some(#w)) } _ => quote!(None) };
            quote!(LayerSpec { rope: #rope, window: #window })
        })
        .collect();
    quote! {
        /// This engine on the CUDA backend: shapes, per-layer kinds, kernel sources (see `kernels/`).
        pub mod cuda {
            use thin_core::cuda::plan::{CudaArch, LayerSpec, RopeTable};
            pub const KERNELS_BF16: &str = include_str!("kernels/decode_bf16.cu");
            pub const KERNELS_F32: &str = include_str!("kernels/decode_f32.cu");
            pub fn arch() -> CudaArch {
                CudaArch {
                    arch: super::ARCH,
                    fingerprint: super::SHAPE_FINGERPRINT,
                    vocab: #vocab,
                    hidden: #hidden,
                    heads: #heads,
                    kv_heads: #kv,
                    head_dim: #hd,
                    ffn: #ffn,
                    max_positions: #max_pos,
                    sandwich: #sandwich,
                    qk_norm: #qk_norm,
                    tied_embeddings: #tied,
                    moe: #moe,
                    attn_softcap: #attn_softcap,
                    final_softcap: #final_softcap,
                    inv_freq_global: #inv_g,
                    inv_freq_local: #inv_l,
                    layers: vec![#(#layers),*],
                    kernels_bf16: KERNELS_BF16,
                    kernels_f32: KERNELS_F32,
                }
            }
        }
    }
}

/// The decode-step kernels of one arch at its exact shapes, for one weight storage type.
#[derive(askama::Template)]
#[template(path = "decode.cu.j2", escape = "none")]
pub struct DecodeKernels {
    pub arch: String,
    pub wname: &'static str,
    pub vocab: u64,
    pub hidden: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub ffn: u64,
    pub eps: String,
    pub emb_scale: String,
    pub attn_scale: String,
    pub act: &'static str,
    pub qk_norm: bool,
    pub attn_chunk: usize,
    pub attn_cluster: usize,
    pub matvec_warps: u32,
    pub attn_warps: u32,
    pub num_layers: u64,
    /// Render the persistent step (thin_core::cuda::plan::persistent_fits holds).
    pub persistent: bool,
}

const TEMPLATES: [&str; 1] = [include_str!("../../kernels/decode.cu.j2")];

/// Weight storage types the kernels are instantiated for: (file/name suffix, whether bf16).
pub const KERNEL_WEIGHT_TYPES: [&str; 2] = ["bf16", "f32"];

/// CUDA sources of one arch: file name → source (without header), one per weight storage type.
pub fn emit_kernels(d: &Description, _plan: &Plan) -> Result<BTreeMap<String, String>, askama::Error> {
    use askama::Template;
    use thin_core::cuda::plan as cp;
    let a = &d.attention;
    let h = d.dims.hidden_size;
    let mut out = BTreeMap::new();
    for wname in KERNEL_WEIGHT_TYPES {
        let emb = match d.embedding.scale { EmbScale::None => 1.0, EmbScale::SqrtHidden => (h as f64).sqrt() };
        // HF multiplies by the scale cast to the weights' dtype: in bf16 that is the bf16-rounded value.
        let emb = if wname == "bf16" { half::bf16::from_f64(emb).to_f64() } else { emb };
        let k = DecodeKernels {
            arch: d.model.name.clone(),
            wname,
            vocab: d.dims.vocab_size,
            hidden: h,
            heads: a.num_heads,
            kv_heads: a.num_kv_heads,
            head_dim: a.head_dim,
            ffn: d.dims.intermediate_size,
            eps: format!("{:e}", d.norm.eps),
            emb_scale: format!("{emb:e}"),
            attn_scale: format!("{:e}", 1.0 / a.query_pre_attn_scalar.unwrap_or(a.head_dim as f64).sqrt()),
            act: match d.mlp.kind { MlpKind::Swiglu => "silu", MlpKind::GegluTanh => "gelu_tanh" },
            qk_norm: a.qk_norm == QkNorm::PerHead,
            attn_chunk: cp::ATTN_CHUNK,
            attn_cluster: cp::ATTN_CLUSTER,
            matvec_warps: cp::MATVEC_WARPS,
            attn_warps: cp::ATTN_WARPS,
            num_layers: d.dims.num_layers,
            persistent: d.moe.is_none()
                && d.norm.placement != Placement::Sandwich
                && a.softcap.is_none()
                && d.final_logit_softcap.is_none()
                && cp::persistent_stage_fits(h as usize, (a.num_heads * a.head_dim) as usize, d.dims.intermediate_size as usize),
        };
        out.insert(format!("decode_{wname}.cu"), k.render()?);
    }
    Ok(out)
}

/// Feature name = file stem; module name = stem with `.`/`-` as `_`.
pub fn module_name(stem: &str) -> String { stem.replace(['.', '-'], "_") }

fn header(rel: &str, hash: &str) -> String {
    format!("// @generated by thin-codegen from {rel}, inputs blake3 {hash}\n")
}

/// parse → validate → plan → emit for one file; returns (feature, plan, mod.rs text).
pub fn generate_one(rel: &str, text: &str) -> Result<(String, Plan, String), CodegenError> {
    let (n, p, src, _) = generate_one_with_kernels(rel, text)?;
    Ok((n, p, src))
}

/// [`generate_one`] plus the CUDA sources (file name → text, headed).
pub fn generate_one_with_kernels(rel: &str, text: &str) -> Result<(String, Plan, String, BTreeMap<String, String>), CodegenError> {
    let d = parse(rel, text)?;
    validate(rel, &d)?;
    let plan = lower(&d);
    let mut tokens = emit_rust(&d, &plan);
    tokens.extend(emit_cuda_module(&d, &plan));
    let file = syn::parse2::<syn::File>(tokens).map_err(|e| CodegenError::Parse { file: rel.into(), msg: format!("emitted Rust does not parse: {e}") })?;
    let mut h = blake3::Hasher::new();
    h.update(text.as_bytes());
    h.update(CODEGEN_VERSION.as_bytes());
    h.update(include_str!("lib.rs").as_bytes());
    for t in TEMPLATES {
        h.update(t.as_bytes());
    }
    let hash = h.finalize().to_hex().to_string();
    let kernels = emit_kernels(&d, &plan).map_err(|e| CodegenError::Parse { file: rel.into(), msg: format!("kernel template: {e}") })?;
    let kernels = kernels.into_iter().map(|(k, v)| (k, header(rel, &hash) + &v)).collect();
    Ok((d.model.name.clone(), plan, header(rel, &hash) + &prettyplease::unparse(&file), kernels))
}

/// All descriptions under `root/archs` (sorted), as relative paths.
pub fn descriptions(root: &Path) -> Result<Vec<PathBuf>, CodegenError> {
    let mut out = Vec::new();
    for dir in ["archs", "archs/tiny"] {
        let rd = std::fs::read_dir(root.join(dir)).map_err(|e| CodegenError::Io { path: dir.into(), msg: e.to_string() })?;
        for e in rd.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "toml") {
                out.push(Path::new(dir).join(p.file_name().unwrap_or_default()));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Every file generated/ should hold, path relative to root → contents. Fails before emitting anything.
pub fn generate_all(root: &Path) -> Result<BTreeMap<PathBuf, String>, CodegenError> {
    let mut files = BTreeMap::new();
    let mut feats = Vec::new();
    let mut errors = Vec::new();
    for rel in descriptions(root)? {
        let rels = rel.to_string_lossy().to_string();
        let text = std::fs::read_to_string(root.join(&rel)).map_err(|e| CodegenError::Io { path: rels.clone(), msg: e.to_string() })?;
        let stem = rel.file_stem().unwrap_or_default().to_string_lossy().to_string();
        match generate_one_with_kernels(&rels, &text) {
            Ok((name, plan, src, kernels)) => {
                let dir = PathBuf::from("generated").join(module_name(&stem));
                files.insert(dir.join("mod.rs"), src);
                for (k, v) in kernels {
                    files.insert(dir.join("kernels").join(k), v);
                }
                if name != stem {
                    errors.push(format!("{rels}: model.name {name:?} differs from the file stem {stem:?} (the feature name)"));
                }
                let family = parse(&rels, &text)?.model.family;
                feats.push((stem, family, plan.fingerprint));
            }
            Err(e) => errors.push(e.to_string()),
        }
    }
    if !errors.is_empty() {
        return Err(CodegenError::Invalid { file: "archs/".into(), errors });
    }
    files.insert(PathBuf::from("generated/lib.rs"), emit_lib(&feats));
    Ok(files)
}

/// generated/lib.rs: the modules behind their features, the table of every known description, the
/// compiled-in CPU engines and `open_cpu`, which picks the one whose shape fingerprint fits.
/// `feats` is (feature = description name, family, shape fingerprint) per description.
fn emit_lib(feats: &[(String, Family, String)]) -> String {
    let mut lib = String::from(
        "// @generated by thin-codegen from archs/*.toml\n\
         //! Engines generated by thin-codegen, one module per architecture behind its feature, and the\n\
         //! dispatcher that picks the compiled-in engine fitting an archive.\n\n\
         use std::sync::Arc;\n\n\
         use thin_core::arch::Family;\n\
         use thin_core::engine::{CompiledEngine, Engine, KnownArch, OpenError};\n\
         use thin_core::format::Archive;\n\n",
    );
    for (f, _, _) in feats {
        lib += &format!("#[cfg(feature = \"{f}\")]\n#[path = \"{m}/mod.rs\"]\npub mod {m};\n", m = module_name(f));
    }
    lib += "\n/// Every architecture feature this crate knows.\npub const AVAILABLE_FEATURES: &[&str] = &[\n";
    for (f, _, _) in feats {
        lib += &format!("    \"{f}\",\n");
    }
    lib += "];\n";
    lib += "\n/// Every description in archs/, compiled in or not: names an archive's shapes in errors.\n\
            pub const KNOWN_ARCHS: &[KnownArch] = &[\n";
    for (f, family, fp) in feats {
        lib += &format!("    KnownArch {{ name: \"{f}\", family: Family::{family:?}, fingerprint: \"{fp}\" }},\n");
    }
    lib += "];\n";
    lib += "\n/// The CPU engines compiled into this build, one per enabled architecture feature.\n\
            pub const CPU_ENGINES: &[CompiledEngine<Arc<Archive>>] = &[\n";
    for (f, family, _) in feats {
        let m = module_name(f);
        lib += &format!(
            "    #[cfg(feature = \"{f}\")]\n    CompiledEngine {{\n        arch: {m}::ARCH,\n        family: Family::{family:?},\n        \
             fingerprint: {m}::SHAPE_FINGERPRINT,\n        open: |a| Box::new({m}::Engine::new(a)),\n    }},\n"
        );
    }
    lib += "];\n";
    lib += "\n/// The CPU engine for `archive`: the compiled-in engine whose shape fingerprint equals the\n\
            /// archive's. The engine holds the archive (its weights are views into the mmap).\n\
            pub fn open_cpu(archive: Arc<Archive>) -> Result<Box<dyn Engine + Send>, OpenError> {\n    \
            let e = thin_core::engine::select_engine(archive.manifest(), KNOWN_ARCHS, CPU_ENGINES)?;\n    \
            Ok((e.open)(archive))\n}\n";
    lib += "\n/// The description whose shapes have this fingerprint, if codegen knows one.\n\
            pub fn arch_name(fingerprint: &str) -> Option<&'static str> {\n    \
            KNOWN_ARCHS.iter().find(|k| k.fingerprint == fingerprint).map(|k| k.name)\n}\n";
    lib += "\n/// The CUDA view of the compiled-in engine whose shape fingerprint the archive has (`None`: not built into this binary).\n";
    lib += "#[allow(unused_variables)]\npub fn cuda_arch(shape_fingerprint: &str) -> Option<thin_core::cuda::plan::CudaArch> {\n";
    for (f, _, _) in feats {
        lib += &format!("    #[cfg(feature = \"{f}\")]\n    if shape_fingerprint == {m}::SHAPE_FINGERPRINT {{\n        return Some({m}::cuda::arch());\n    }}\n", m = module_name(f));
    }
    lib += "    None\n}\n";
    lib
}

pub fn write_files(root: &Path, files: &BTreeMap<PathBuf, String>) -> std::io::Result<()> {
    for (p, c) in files {
        let full = root.join(p);
        if let Some(d) = full.parent() { std::fs::create_dir_all(d)?; }
        std::fs::write(full, c)?;
    }
    Ok(())
}

pub fn stale_files(root: &Path, files: &BTreeMap<PathBuf, String>) -> Vec<PathBuf> {
    files.iter().filter(|(p, c)| std::fs::read_to_string(root.join(p)).ok().as_deref() != Some(c.as_str())).map(|(p, _)| p.clone()).collect()
}
