//! The CPU engine module of a description: consts, state, and one straight-line function per layer.

use proc_macro2::TokenStream;
use quote::{format_ident, quote};

use thin_core::arch::ShapeDims;
use thin_core::role::Role;

use crate::description::*;
use crate::lower::*;

fn role_ident(r: Role) -> TokenStream {
    let v = format_ident!("{}", format!("{r:?}"));
    quote!(thin_core::role::Role::#v)
}

/// Every tensor the engine reads, in first-use order, with its element count: the engine binds
/// them once at load (`WEIGHTS`, checked there) and an op reads its tensor as `w.at(ix[slot])`.
#[derive(Default)]
pub(crate) struct Slots(Vec<(Role, Option<u64>, TokenStream)>);

impl Slots {
    /// The expression reading (role, layer), a tensor of `count` elements.
    fn at(&mut self, role: Role, layer: Option<u64>, count: TokenStream) -> TokenStream {
        let k = match self.0.iter().position(|(r, l, _)| *r == role && *l == layer) {
            Some(k) => k,
            None => {
                self.0.push((role, layer, count));
                self.0.len() - 1
            }
        };
        quote!(w.at(ix[#k]))
    }

    fn named(&mut self, name: &str, layer: Option<u64>, count: TokenStream) -> TokenStream {
        self.at(Role::from_name(name).expect("plan names only known roles"), layer, count)
    }

    /// `const WEIGHTS: [(Role, Option<u32>, usize); N]`.
    fn table(&self) -> TokenStream {
        let n = self.0.len();
        let rows = self.0.iter().map(|(r, l, c)| {
            let r = role_ident(*r);
            let l = match l {
                Some(l) => {
                    let l = *l as u32;
                    quote!(Some(#l))
                }
                None => quote!(None),
            };
            quote!((#r, #l, #c))
        });
        quote! {
            /// Every tensor the engine reads (role, layer, elements), bound once at load.
            const WEIGHTS: [(thin_core::role::Role, Option<u32>, usize); #n] = [#(#rows),*];
        }
    }
}

pub(crate) fn lit_u(x: u64) -> TokenStream { let x = x as usize; quote!(#x) }

/// The decode code of `ops`: [`emit_op`] of each, except that consecutive matvecs over the same
/// input (q, k, v) are one `matvecs` call, one pool region.
fn emit_ops(ops: &[Op], layer: Option<u64>, eps: f32, sl: &mut Slots) -> Vec<TokenStream> {
    let mut code = Vec::new();
    let mut i = 0;
    while i < ops.len() {
        // The matvecs from i on that read the input op i's matvec reads.
        let first = match &ops[i] { Op::Matvec { input, .. } => Some(input), _ => None };
        let run: Vec<_> = ops[i..]
            .iter()
            .map_while(|o| match o {
                Op::Matvec { weight, input, out, out_dim, in_dim } if Some(input) == first => Some((weight, out, out_dim * in_dim)),
                _ => None,
            })
            .collect();
        if run.len() <= 1 {
            code.push(emit_op(&ops[i], layer, eps, sl));
            i += 1;
            continue;
        }
        let x = format_ident!("{}", first.expect("a run starts at a matvec"));
        let jobs: Vec<TokenStream> = run
            .iter()
            .map(|&(weight, out, elems)| {
                let m = sl.named(weight, layer, lit_u(elems));
                let o = format_ident!("{}", out);
                quote!((#m, &mut s.#o[..]))
            })
            .collect();
        code.push(quote! { thin_core::cpu::matvecs(&s.#x, &mut [#(#jobs),*]); });
        i += run.len();
    }
    code
}

fn emit_op(op: &Op, layer: Option<u64>, eps: f32, sl: &mut Slots) -> TokenStream {
    match op {
        Op::Embed { out, hidden, scale } => {
            let out = format_ident!("{}", out);
            let hdn = lit_u(*hidden);
            let sc = *scale as f32;
            let table = sl.at(Role::TokenEmbd, None, quote!(consts::VOCAB * consts::HIDDEN));
            quote! {
                let table = #table;
                thin_core::cpu::embedding(table, token as usize, #hdn, #sc, &mut s.#out);
            }
        }
        Op::RmsNorm { weight, input, out, dim } => {
            let g = sl.named(weight, layer, lit_u(*dim));
            let i = format_ident!("{}", input);
            let o = format_ident!("{}", out);
            // The norm weight is read where it is stored (no copy per layer per token).
            if input == out {
                quote! {
                    s.tmp.copy_from_slice(&s.#i);
                    thin_core::cpu::rms_norm_view(&s.tmp, #g, #eps, &mut s.#o);
                }
            } else {
                quote! { thin_core::cpu::rms_norm_view(&s.#i, #g, #eps, &mut s.#o); }
            }
        }
        Op::Matvec { weight, input, out, out_dim, in_dim } => {
            let m = sl.named(weight, layer, lit_u(out_dim * in_dim));
            let i = format_ident!("{}", input);
            let o = format_ident!("{}", out);
            quote! { thin_core::cpu::matvec(#m, &s.#i, &mut s.#o); }
        }
        Op::QkNorm { weight, buf, dim, .. } => {
            let g = sl.named(weight, layer, lit_u(*dim));
            let b = format_ident!("{}", buf);
            quote! { thin_core::cpu::rms_norm_chunks_view(&mut s.#b, #g, #eps); }
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
            let [g, u, d] = [Role::FfnGate, Role::FfnUp, Role::FfnDown].map(|r| sl.at(r, layer, quote!(consts::FFN * consts::HIDDEN)));
            quote! {
                thin_core::cpu::matvecs(&s.xn, &mut [(#g, &mut s.gate[..]), (#u, &mut s.up[..])]);
                thin_core::cpu::#act(&mut s.gate, &s.up);
                thin_core::cpu::matvec(#d, &s.gate, &mut s.down);
            }
        }
        Op::Moe { renorm, .. } => {
            let router = sl.at(Role::MoeRouter, layer, quote!(consts::NUM_EXPERTS * consts::HIDDEN));
            let [g, u, d] = [Role::MoeGate, Role::MoeUp, Role::MoeDown].map(|r| sl.at(r, layer, quote!(consts::NUM_EXPERTS * consts::FFN * consts::HIDDEN)));
            quote! {
                thin_core::cpu::matvec(#router, &s.xn, &mut s.router);
                let n = consts::FFN * consts::HIDDEN;
                let gate_all = #g;
                let up_all = #u;
                let down_all = #d;
                s.down.iter_mut().for_each(|v| *v = 0.0);
                for &(e, p) in s.route.top(&s.router, consts::TOP_K, #renorm) {
                    thin_core::cpu::matvec(gate_all.slice(e * n, (e + 1) * n), &s.xn, &mut s.gate);
                    thin_core::cpu::matvec(up_all.slice(e * n, (e + 1) * n), &s.xn, &mut s.up);
                    thin_core::cpu::swiglu(&mut s.gate, &s.up);
                    thin_core::cpu::matvec(down_all.slice(e * n, (e + 1) * n), &s.gate, &mut s.tmp);
                    for (d, t) in s.down.iter_mut().zip(&s.tmp) { *d += p * t; }
                }
            }
        }
        Op::LmHead { weight, .. } => {
            let head = sl.named(weight, None, quote!(consts::VOCAB * consts::HIDDEN));
            quote! { thin_core::cpu::matvec(#head, &s.xn, &mut s.logits); }
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
fn emit_op_batch(op: &Op, layer: Option<u64>, eps: f32, sl: &mut Slots) -> TokenStream {
    match op {
        Op::Embed { out, hidden, scale } => {
            let out = format_ident!("{}", out);
            let hdn = lit_u(*hidden);
            let sc = *scale as f32;
            let table = sl.at(Role::TokenEmbd, None, quote!(consts::VOCAB * consts::HIDDEN));
            quote! {
                let table = #table;
                for (t, &token) in tokens.iter().enumerate() {
                    thin_core::cpu::embedding(table, token as usize, #hdn, #sc, &mut b.#out[t * consts::HIDDEN..(t + 1) * consts::HIDDEN]);
                }
            }
        }
        Op::RmsNorm { weight, input, out, dim } => {
            let d = lit_u(*dim);
            let g = sl.named(weight, layer, d.clone());
            let i = format_ident!("{}", input);
            let o = format_ident!("{}", out);
            let src = if input == out { quote!(b.tmp) } else { quote!(b.#i) };
            let copy = if input == out { quote!(b.tmp.copy_from_slice(&b.#i);) } else { quote!() };
            quote! {
                let g = #g;
                #copy
                for (xr, yr) in #src.chunks_exact(#d).zip(b.#o.chunks_exact_mut(#d)) {
                    thin_core::cpu::rms_norm_view(xr, g, #eps, yr);
                }
            }
        }
        Op::Matvec { weight, input, out, out_dim, in_dim } => {
            let m = sl.named(weight, layer, lit_u(out_dim * in_dim));
            let k = lit_u(*in_dim);
            let i = format_ident!("{}", input);
            let o = format_ident!("{}", out);
            quote! { thin_core::cpu::matmul(#m, &b.#i, #k, &mut b.#o); }
        }
        Op::QkNorm { weight, buf, dim, .. } => {
            let g = sl.named(weight, layer, lit_u(*dim));
            let bf = format_ident!("{}", buf);
            quote! { thin_core::cpu::rms_norm_chunks_view(&mut b.#bf, #g, #eps); }
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
                thin_core::cpu::attention_prompt(&b.q, &s.k_cache[#l], &s.v_cache[#l], pos, p, &mut b.att);
            }
        }
        Op::ResidualAdd { into, from } => {
            let a = format_ident!("{}", into);
            let f = format_ident!("{}", from);
            quote! { thin_core::cpu::residual_add(&mut b.#a, &b.#f); }
        }
        Op::Mlp { kind, .. } => {
            let act = match kind { MlpKind::Swiglu => quote!(swiglu), MlpKind::GegluTanh => quote!(geglu) };
            let [g, u, d] = [Role::FfnGate, Role::FfnUp, Role::FfnDown].map(|r| sl.at(r, layer, quote!(consts::FFN * consts::HIDDEN)));
            quote! {
                thin_core::cpu::matmul(#g, &b.xn, consts::HIDDEN, &mut b.gate);
                thin_core::cpu::matmul(#u, &b.xn, consts::HIDDEN, &mut b.up);
                thin_core::cpu::#act(&mut b.gate, &b.up);
                thin_core::cpu::matmul(#d, &b.gate, consts::FFN, &mut b.down);
            }
        }
        Op::Moe { .. } => {
            // Each row routes to its own experts: the single-token MoE, row by row.
            let one = emit_op(op, layer, eps, sl);
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

/// `d` as a `ShapeDims` constant expression.
fn dims_tokens(d: &ShapeDims) -> TokenStream {
    let family = format_ident!("{}", format!("{:?}", d.family));
    let ShapeDims { vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, head_dim, intermediate_size, num_experts, top_k, tie_word_embeddings, .. } = d;
    quote! {
        thin_core::arch::ShapeDims {
            family: thin_core::arch::Family::#family,
            vocab_size: #vocab_size, hidden_size: #hidden_size, num_layers: #num_layers,
            num_heads: #num_heads, num_kv_heads: #num_kv_heads, head_dim: #head_dim,
            intermediate_size: #intermediate_size, num_experts: #num_experts, top_k: #top_k,
            tie_word_embeddings: #tie_word_embeddings,
        }
    }
}

/// The Rust module for one description.
pub fn emit_rust(d: &Description, plan: &Plan) -> TokenStream {
    let a = &d.attention;
    let u = |x: u64| lit_u(x);
    let dims = dims_tokens(&shape_dims(d));
    let max_seq = u(d.dims.max_position_embeddings.min(4096));
    let fp = &plan.fingerprint;
    let eps = d.norm.eps as f32;
    let name = &d.model.name;
    let attn_softcap = match a.softcap { Some(c) => { let c = c as f32; quote!(Some(#c)) } None => quote!(None) };
    let theta = d.rope.theta;
    let local_theta = d.rope.local_theta.unwrap_or(d.rope.theta);
    let inv = |t: f64| inv_freq_tokens(d, t, quote!(consts::HEAD_DIM));
    let (inv_g, inv_l) = (inv(theta), inv(local_theta));
    let mut sl = Slots::default();
    let prologue: Vec<_> = plan.prologue.iter().map(|o| emit_op(o, None, eps, &mut sl)).collect();
    let epilogue: Vec<_> = plan.epilogue.iter().map(|o| emit_op(o, None, eps, &mut sl)).collect();
    let mut layer_fns = Vec::new();
    let mut layer_calls = Vec::new();
    let mut batch_calls = Vec::new();
    let mut step_arms = Vec::new();
    let mut prompt_arms = Vec::new();
    let prologue_b: Vec<_> = plan.prologue.iter().map(|o| emit_op_batch(o, None, eps, &mut sl)).collect();
    for lp in &plan.layers {
        let f = format_ident!("layer_{}", lp.layer);
        let body = emit_ops(&lp.ops, Some(lp.layer), eps, &mut sl);
        let doc = format!(" Layer {}: {:?} attention, rope {}.", lp.layer, lp.attention, if lp.rope { "on" } else { "off" });
        layer_fns.push(quote! {
            #[doc = #doc]
            #[allow(unused_variables)]
            fn #f(w: &W, ix: &[usize], s: &mut State, pos: usize) { #(#body)* }
        });
        layer_calls.push(quote! { Self::#f(w, ix, s, pos); });
        let li = lit_u(lp.layer);
        step_arms.push(quote! { #li => Self::#f(w, ix, s, pos), });
        let fb = format_ident!("layer_{}_prefill", lp.layer);
        let body_b: Vec<_> = lp.ops.iter().map(|o| emit_op_batch(o, Some(lp.layer), eps, &mut sl)).collect();
        let doc_b = format!(" Layer {} over all prompt rows.", lp.layer);
        layer_fns.push(quote! {
            #[doc = #doc_b]
            #[allow(unused_variables)]
            fn #fb(w: &W, ix: &[usize], s: &mut State, b: &mut Batch, tokens: &[u32], pos: usize) { #(#body_b)* }
        });
        batch_calls.push(quote! { Self::#fb(w, ix, s, &mut b, tokens, pos); });
        prompt_arms.push(quote! { #li => Self::#fb(w, ix, s, &mut b, &tokens, pos), });
    }
    let weights = sl.table();
    let nw = sl.0.len();
    let modoc = format!(" Engine for `{name}`, generated from its architecture description.");
    quote! {
        #![doc = #modoc]
        #![allow(clippy::all, unused_imports, dead_code)]
        use thin_core::engine::{EngineError, Weights};

        /// The model's dimensions; the archive must carry the same (see [`SHAPE_FINGERPRINT`]).
        pub const DIMS: thin_core::arch::ShapeDims = #dims;

        /// The dims as the engine's array sizes.
        pub mod consts {
            use super::DIMS;
            pub const VOCAB: usize = DIMS.vocab_size as usize;
            pub const HIDDEN: usize = DIMS.hidden_size as usize;
            pub const NUM_LAYERS: usize = DIMS.num_layers as usize;
            pub const NUM_HEADS: usize = DIMS.num_heads as usize;
            pub const NUM_KV_HEADS: usize = DIMS.num_kv_heads as usize;
            pub const HEAD_DIM: usize = DIMS.head_dim as usize;
            pub const Q_DIM: usize = DIMS.q_dim() as usize;
            pub const KV_DIM: usize = DIMS.kv_dim() as usize;
            pub const FFN: usize = DIMS.intermediate_size as usize;
            pub const NUM_EXPERTS: usize = DIMS.num_experts as usize;
            pub const TOP_K: usize = DIMS.top_k as usize;
            pub const MAX_SEQ: usize = #max_seq;
            pub const RMS_EPS: f32 = #eps;
            pub const ATTN_SOFTCAP: Option<f32> = #attn_softcap;
        }

        pub const ARCH: &str = #name;
        /// Must equal the archive's `ShapeDims::fingerprint()`.
        pub const SHAPE_FINGERPRINT: &str = #fp;

        #weights

        /// Every buffer, allocated once.
        pub struct State {
            x: Vec<f32>, xn: Vec<f32>, tmp: Vec<f32>, q: Vec<f32>, k: Vec<f32>, v: Vec<f32>, att: Vec<f32>, o: Vec<f32>,
            gate: Vec<f32>, up: Vec<f32>, down: Vec<f32>, router: Vec<f32>, route: thin_core::cpu::Router, logits: Vec<f32>,
            k_cache: Vec<Vec<f32>>, v_cache: Vec<Vec<f32>>,
            cos_global: Vec<f32>, sin_global: Vec<f32>, cos_local: Vec<f32>, sin_local: Vec<f32>,
        }

        /// The engine over weights `w`: `ix` holds the handle of each of [`WEIGHTS`], bound at load.
        pub struct Engine<W: Weights> { w: W, ix: [usize; #nw], s: State, pos: usize }

        /// Prefill's buffers: one row per prompt token of each per-token buffer, allocated per prompt
        /// (decode steps allocate nothing).
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
            /// Bind every tensor of [`WEIGHTS`] (a missing or misshapen one is an error here) and
            /// allocate every buffer.
            pub fn new(w: W) -> Result<Self, EngineError> {
                let mut ix = [0usize; #nw];
                for (h, &(role, layer, n)) in ix.iter_mut().zip(WEIGHTS.iter()) {
                    *h = w.bind(role, layer, n)?;
                }
                let (cos_global, sin_global) = thin_core::cpu::rope_tables(&#inv_g, consts::MAX_SEQ);
                let (cos_local, sin_local) = thin_core::cpu::rope_tables(&#inv_l, consts::MAX_SEQ);
                let s = State {
                    x: vec![0.0; consts::HIDDEN], xn: vec![0.0; consts::HIDDEN], tmp: vec![0.0; consts::HIDDEN],
                    q: vec![0.0; consts::Q_DIM], k: vec![0.0; consts::KV_DIM], v: vec![0.0; consts::KV_DIM],
                    att: vec![0.0; consts::Q_DIM], o: vec![0.0; consts::HIDDEN],
                    gate: vec![0.0; consts::FFN], up: vec![0.0; consts::FFN], down: vec![0.0; consts::HIDDEN],
                    router: vec![0.0; consts::NUM_EXPERTS], route: thin_core::cpu::Router::new(consts::NUM_EXPERTS), logits: vec![0.0; consts::VOCAB],
                    // One zeroed allocation per layer (not clones of one): pages are touched as positions fill.
                    k_cache: (0..consts::NUM_LAYERS).map(|_| vec![0.0; consts::MAX_SEQ * consts::KV_DIM]).collect(),
                    v_cache: (0..consts::NUM_LAYERS).map(|_| vec![0.0; consts::MAX_SEQ * consts::KV_DIM]).collect(),
                    cos_global, sin_global, cos_local, sin_local,
                };
                Ok(Engine { w, ix, s, pos: 0 })
            }

            /// The residual stream as the last step left it, after its last layer and before the
            /// final norm (the prompt's last row after a prefill).
            pub fn residual(&self) -> &[f32] { &self.s.x }

            #(#layer_fns)*

            fn forward(&mut self, token: u32) -> Result<(), EngineError> {
                if token as usize >= consts::VOCAB {
                    return Err(EngineError::TokenOutOfRange { token, vocab: consts::VOCAB });
                }
                if self.pos >= consts::MAX_SEQ {
                    return Err(EngineError::ContextFull { pos: self.pos, max_seq: consts::MAX_SEQ });
                }
                let pos = self.pos;
                let (w, ix, s) = (&self.w, &self.ix[..], &mut self.s);
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
                let (w, ix, s) = (&self.w, &self.ix[..], &mut self.s);
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
            fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32], EngineError> {
                if tokens.is_empty() { return Err(EngineError::EmptyPrompt); }
                self.forward_prompt(tokens)?;
                Ok(&self.s.logits)
            }
            fn decode_step(&mut self, token: u32) -> Result<&[f32], EngineError> {
                self.forward(token)?;
                Ok(&self.s.logits)
            }
            fn reset(&mut self) { self.pos = 0; }
        }

        /// One layer at a time, for a GPU engine that keeps some layers on the host.
        impl<W: Weights> thin_core::engine::HostLayers for Engine<W> {
            fn num_layers(&self) -> usize { consts::NUM_LAYERS }
            fn max_seq(&self) -> usize { consts::MAX_SEQ }
            fn layer_step(&mut self, layer: usize, x: &mut [f32], pos: usize) -> Result<(), EngineError> {
                if x.len() != consts::HIDDEN {
                    return Err(EngineError::RowShape { what: "a host layer's residual", got: x.len(), row: consts::HIDDEN, max_rows: 1 });
                }
                if pos >= consts::MAX_SEQ {
                    return Err(EngineError::ContextFull { pos, max_seq: consts::MAX_SEQ });
                }
                let (w, ix, s) = (&self.w, &self.ix[..], &mut self.s);
                s.x.copy_from_slice(x);
                match layer {
                    #(#step_arms)*
                    _ => return Err(EngineError::NoSuchLayer { layer, layers: consts::NUM_LAYERS }),
                }
                x.copy_from_slice(&s.x);
                Ok(())
            }
            fn layer_prompt(&mut self, layer: usize, x: &mut [f32], pos: usize) -> Result<(), EngineError> {
                let rows = x.len() / consts::HIDDEN;
                if rows == 0 || x.len() % consts::HIDDEN != 0 || pos + rows > consts::MAX_SEQ {
                    return Err(EngineError::RowShape { what: "a host layer's prompt rows", got: x.len(), row: consts::HIDDEN, max_rows: consts::MAX_SEQ.saturating_sub(pos) });
                }
                let (w, ix, s) = (&self.w, &self.ix[..], &mut self.s);
                let mut b = Batch::new(rows);
                b.x.copy_from_slice(x);
                // The layers read no token ids (the prologue embedded them).
                let tokens = vec![0u32; rows];
                match layer {
                    #(#prompt_arms)*
                    _ => return Err(EngineError::NoSuchLayer { layer, layers: consts::NUM_LAYERS }),
                }
                x.copy_from_slice(&b.x);
                Ok(())
            }
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

