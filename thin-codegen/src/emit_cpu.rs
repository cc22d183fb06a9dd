//! The CPU engine module of a description: consts, state, and one straight-line function per layer.

use proc_macro2::TokenStream;
use quote::{format_ident, quote};

use crate::description::*;
use crate::lower::*;

fn role_tokens(name: &str) -> TokenStream {
    let r = thin_core::role::Role::from_name(name).expect("plan names only known roles");
    let v = format_ident!("{}", format!("{r:?}"));
    quote!(thin_core::role::Role::#v)
}

pub(crate) fn lit_u(x: u64) -> TokenStream { let x = x as usize; quote!(#x) }

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
        Op::Attention { layer, window, scale, softcap } => {
            let l = lit_u(*layer);
            let win = match window { Some(x) => { let x = *x as usize; quote!(Some(#x)) } None => quote!(None) };
            let sc = *scale as f32;
            let cap = match softcap { Some(c) => { let c = *c as f32; quote!(Some(#c)) } None => quote!(None) };
            quote! {
                let p = thin_core::cpu::AttnParams { num_heads: consts::NUM_HEADS, num_kv_heads: consts::NUM_KV_HEADS, head_dim: consts::HEAD_DIM, scale: #sc, window: #win, softcap: #cap };
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
        Op::Attention { layer, window, scale, softcap } => {
            let l = lit_u(*layer);
            let win = match window { Some(x) => { let x = *x as usize; quote!(Some(#x)) } None => quote!(None) };
            let sc = *scale as f32;
            let cap = match softcap { Some(c) => { let c = *c as f32; quote!(Some(#c)) } None => quote!(None) };
            quote! {
                let p = thin_core::cpu::AttnParams { num_heads: consts::NUM_HEADS, num_kv_heads: consts::NUM_KV_HEADS, head_dim: consts::HEAD_DIM, scale: #sc, window: #win, softcap: #cap };
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
pub(crate) fn inv_freq_tokens(d: &Description, theta: f64, head_dim: TokenStream) -> TokenStream {
    match &d.rope.scaling {
        Some(sc) => {
            let (f, lo, hi, orig) = (sc.factor, sc.low_freq_factor, sc.high_freq_factor, sc.original_max_position_embeddings as f64);
            quote!(thin_core::cpu::llama3_inv_freq(&thin_core::cpu::rope_inv_freq(#head_dim, #theta), #f, #lo, #hi, #orig))
        }
        None => quote!(thin_core::cpu::rope_inv_freq(#head_dim, #theta)),
    }
}

