//! The CUDA lowering of a plan: the plan's ops, in order, matched to the kernels of
//! `kernels/decode.cu.j2` (the decode step's launches and a prefill pass's steps), each plan op
//! taken by exactly one rule. An op no rule takes is a typed refusal naming it, so a feature the
//! CPU engine honours is never skipped on the GPU: it is run there, or the arch is refused.

use proc_macro2::TokenStream;
use quote::quote;
use thin_core::cuda::plan::{Arg, Buf, Gemm, Grid, LayerSteps, Launch, RopeTable, Schedule, Step, WeightRef, ATTN_WARPS, MATVEC_WARPS};
use thin_core::arch::ShapeDims;
use thin_core::role::Role;

use crate::description::*;
use crate::lower::*;

/// Threads of a matvec block.
const MV: u32 = MATVEC_WARPS * 32;

/// Why an arch has no CUDA schedule: the plan op no kernel takes.
#[derive(Debug, Clone, PartialEq)]
pub struct Unsupported(pub String);

fn role(name: &str) -> Role {
    Role::from_name(name).expect("the plan names only known roles")
}


/// The ops of one layer (or the prologue/epilogue), taken front to back.
struct Ops<'a> {
    ops: &'a [Op],
    at: usize,
}

impl<'a> Ops<'a> {
    /// The next op if `f` accepts it (and it is consumed), else nothing.
    fn take<T>(&mut self, f: impl Fn(&'a Op) -> Option<T>) -> Option<T> {
        let v = f(self.ops.get(self.at)?)?;
        self.at += 1;
        Some(v)
    }

    /// The next op, which no rule took: what the GPU cannot run.
    fn refuse(&self) -> Unsupported {
        Unsupported(match &self.ops[self.at] {
            Op::Moe { .. } => "mixture-of-experts layers".into(),
            Op::Attention { softcap: Some(c), .. } => format!("attention logit softcapping ({c})"),
            Op::Softcap { cap, .. } => format!("final logit softcapping ({cap})"),
            op => format!("the op {op:?} at this point of the layer"),
        })
    }

    fn done(&self) -> bool {
        self.at == self.ops.len()
    }
}

/// A projection's way into the residual stream: added as it is, or through its own post-norm.
enum Residual {
    Plain,
    PostNorm(Role),
}

/// `[RmsNorm(from → from)] ResidualAdd(x ← from)`.
fn residual(ops: &mut Ops, from: &str) -> Option<Residual> {
    let post = ops.take(|o| match o {
        Op::RmsNorm { weight, input, out, .. } if input == from && out == from => Some(role(weight)),
        _ => None,
    });
    ops.take(|o| matches!(o, Op::ResidualAdd { into, from: f } if into == "x" && f == from).then_some(()))?;
    Some(post.map_or(Residual::Plain, Residual::PostNorm))
}

/// The launches and prefill steps of one layer (or of the prologue).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Out {
    pub decode: Vec<Launch>,
    pub prefill: Vec<Step>,
}

/// A matvec over `rows` outputs of `nr` rows of `weight` of `in_features`, typed by that weight.
fn mv(weight: WeightRef, in_features: usize, rows: usize, nr: usize) -> (Option<WeightRef>, Grid) {
    (Some(weight), Grid::Matvec { weight, in_features, rows, nr })
}

impl Out {
    /// A decode launch; `typed`: the tensor whose storage type picks its instance, and its grid.
    fn k(&mut self, kernel: &'static str, (typed_by, grid): (Option<WeightRef>, Grid), block: u32, args: Vec<Arg>) {
        self.decode.push(Launch { kernel, typed_by, grid, block, args });
    }
    fn pk(&mut self, kernel: &'static str, (typed_by, grid): (Option<WeightRef>, Grid), block: u32, args: Vec<Arg>) {
        self.prefill.push(Step::Kernel(Launch { kernel, typed_by, grid, block, args }));
    }
    #[allow(clippy::too_many_arguments)]
    fn gemm(&mut self, weight: (Role, Option<u32>), input: Buf, out: Buf, out_col: usize, ldc: usize, n: usize, k: usize, accumulate: bool) {
        self.prefill.push(Step::Gemm(Gemm { weight, input, out, out_col, ldc, n, k, accumulate }));
    }

    /// A projection's output into the residual: decode `fused` (matvec + add) or `plain` then
    /// norm_residual; prefill a GEMM accumulating into PX, or into PO then norm_residual.
    #[allow(clippy::too_many_arguments)]
    fn push_residual(&mut self, r: Residual, (fused, plain): (&'static str, &'static str), input: Buf, weight: WeightRef, prefill_in: Buf, n: usize, k: usize) {
        let w = Arg::Weight(weight.0, weight.1);
        let grid = mv(weight, k, n, 1);
        match r {
            Residual::Plain => {
                self.k(fused, grid, MV, vec![Arg::Buf(input), w, Arg::Buf(Buf::X)]);
                self.gemm(weight, prefill_in, Buf::PX, 0, n, n, k, true);
            }
            Residual::PostNorm(post) => {
                let g = Arg::Weight(post, weight.1);
                self.k(plain, grid, MV, vec![Arg::Buf(input), w, Arg::Buf(Buf::O)]);
                self.k("norm_residual", (None, Grid::Fixed(1, 1, 1)), 256, vec![Arg::Buf(Buf::O), g, Arg::Buf(Buf::X)]);
                self.gemm(weight, prefill_in, Buf::PO, 0, n, n, k, false);
                self.pk("norm_residual", (None, Grid::Rows), 256, vec![Arg::Buf(Buf::PO), g, Arg::Buf(Buf::PX)]);
            }
        }
    }
}

impl Out {
    /// A mixture-of-experts MLP into the residual. Both passes: the router matvec over the normed
    /// residual; the softmax and top-k of its logits with the weights (renormalised if `renorm`),
    /// on the device, into the route buffer. Nothing crosses to the host within a token.
    ///
    /// The decode step then reads the chosen experts' gate and up rows only, and their down rows,
    /// weighted, added into the residual (one row: each chosen expert is read once anyway).
    ///
    /// Prefill groups the prompt rows by expert instead, so an expert chosen by many rows is read
    /// once per tile of them, not once per row: `moe_group` lists each expert's (row, slot) pairs
    /// (on the device, into fixed-size buffers: the pass stays capturable); the grouped gate/up
    /// and down kernels take a tile of one expert's pairs a block, the down kernel writing each
    /// pair's output apart; `moe_combine` adds them into each residual row with the route's
    /// weights in slot order, so the sum is the same on every run (no float atomics).
    fn moe(&mut self, li: Option<u32>, norm: Role, (experts, top_k, renorm): (usize, usize, bool), h: usize, ffn: usize) {
        let w = |r: Role| Arg::Weight(r, li);
        let (router, gate, up, down) = (Role::MoeRouter, Role::MoeGate, Role::MoeUp, Role::MoeDown);
        let grid = |weight: Role, in_features: usize, rows: usize, nr: usize| {
            (Some((weight, li)), Grid::MatvecRows { weight: (weight, li), in_features, rows, nr })
        };
        let tiles = |weight: Role, in_features: usize, rows: usize, nr: usize| {
            (Some((weight, li)), Grid::ExpertTiles { weight: (weight, li), in_features, rows, nr, experts, top_k })
        };
        let renorm = Arg::I32(renorm as i32);
        let route = |x: Buf, logits: Buf, route: Buf| {
            [
                ("moe_router", grid(router, h, experts, 1), MV, vec![Arg::Buf(x), w(norm), w(router), Arg::Buf(logits)]),
                ("moe_topk", (None, Grid::Rows), 32, vec![Arg::Buf(logits), renorm, Arg::Buf(route)]),
            ]
        };
        let (x, route_buf, act) = (Buf::X, Buf::MoeRoute, Buf::MoeAct);
        for (kernel, g, block, args) in route(x, Buf::MoeLogits, route_buf) {
            self.k(kernel, g, block, args);
        }
        self.k("moe_gateup", grid(gate, h, top_k * ffn, 2), MV, vec![Arg::Buf(x), w(norm), w(gate), w(up), Arg::Buf(route_buf), Arg::Buf(act)]);
        self.k("moe_down", grid(down, ffn, h, top_k), MV, vec![Arg::Buf(act), w(down), Arg::Buf(route_buf), Arg::Buf(x)]);

        let (x, route_buf, act, groups, out) = (Buf::PX, Buf::PMoeRoute, Buf::PMoeAct, Buf::PMoeGroups, Buf::PMoeDown);
        for (kernel, g, block, args) in route(x, Buf::PMoeLogits, route_buf) {
            self.pk(kernel, g, block, args);
        }
        self.pk("moe_group", (None, Grid::Fixed(1, 1, 1)), 256, vec![Arg::Buf(route_buf), Arg::Elements { width: top_k }, Arg::Buf(groups)]);
        self.pk("moe_gateup_grouped", tiles(gate, h, ffn, 2), MV, vec![Arg::Buf(x), w(norm), w(gate), w(up), Arg::Buf(groups), Arg::Buf(act)]);
        self.pk("moe_down_grouped", tiles(down, ffn, h, 1), MV, vec![Arg::Buf(act), w(down), Arg::Buf(groups), Arg::Buf(out)]);
        self.pk("moe_combine", (None, Grid::Rows), 256, vec![Arg::Buf(out), Arg::Buf(route_buf), Arg::Buf(x)]);
    }
}

/// One layer's ops as kernels: norm + q/k/v; QK-norm + RoPE + KV write + split attention; O
/// projection into the residual; norm + gate/up + activation; down into the residual (or the
/// mixture of experts: [`Out::moe`]).
fn lower_layer(lp: &LayerPlan, d: &ShapeDims) -> Result<Out, Unsupported> {
    let mut ops = Ops { ops: &lp.ops, at: 0 };
    let mut out = Out::default();
    let l = lp.layer as usize;
    let li = Some(lp.layer as u32);
    let w = |r: Role| Arg::Weight(r, li);
    let (h, q, kv) = (d.hidden_size as usize, d.q_dim() as usize, d.kv_dim() as usize);

    // norm + q, k, v
    let norm = ops.take(|o| match o {
        Op::RmsNorm { weight, input, out, .. } if input == "x" && out == "xn" => Some(role(weight)),
        _ => None,
    });
    let mut proj = |name: &'static str| {
        ops.take(move |o| match o {
            Op::Matvec { weight, input, out, .. } if input == "xn" && out == name => Some(role(weight)),
            _ => None,
        })
    };
    let (Some(norm), Some(wq), Some(wk), Some(wv)) = (norm, proj("q"), proj("k"), proj("v")) else { return Err(ops.refuse()) };
    out.k("norm_qkv", mv((wq, li), h, q + 2 * kv, 1), MV, vec![Arg::Buf(Buf::X), w(norm), w(wq), w(wk), w(wv), Arg::Buf(Buf::Qkv)]);
    // The GEMM input rows are in q's type (k and v must share it).
    out.pk("rows_norm", (Some((wq, li)), Grid::Rows), 256, vec![Arg::Buf(Buf::PX), w(norm), Arg::Buf(Buf::PXn)]);
    for (r, col, n) in [(wq, 0, q), (wk, q, kv), (wv, q + kv, kv)] {
        out.gemm((r, li), Buf::PXn, Buf::PQkv, col, q + 2 * kv, n, h, false);
    }

    // [whole-projection QK-norm] [per-head QK-norm] [RoPE] KV write, attention
    let whole_norm = |buf: &'static str, n: u64| {
        move |o: &Op| match o {
            Op::QkNorm { weight, buf: b, dim, total } if b == buf && dim == total && *total == n => Some(role(weight)),
            _ => None,
        }
    };
    if let Some(wqn) = ops.take(whole_norm("q", d.q_dim())) {
        let wkn = ops.take(whole_norm("k", d.kv_dim())).ok_or_else(|| ops.refuse())?;
        let args = |b: Buf| vec![Arg::Buf(b), w(wqn), w(wkn)];
        // Decode: one block for q and one for k (blockIdx.y); prefill: a block per row, q then k.
        out.k("qk_norm_whole", (None, Grid::Fixed(1, 2, 1)), 256, args(Buf::Qkv));
        out.pk("qk_norm_whole", (None, Grid::Rows), 256, args(Buf::PQkv));
    }
    let head_norm = |buf: &'static str| {
        move |o: &Op| match o {
            Op::QkNorm { weight, buf: b, dim, total } if b == buf && *dim == d.head_dim && total % dim == 0 => Some(role(weight)),
            _ => None,
        }
    };
    let (qn, kn) = match ops.take(head_norm("q")) {
        Some(qn) => (w(qn), w(ops.take(head_norm("k")).ok_or_else(|| ops.refuse())?)),
        None => (Arg::Null, Arg::Null),
    };
    let table = |buf: &'static str| {
        move |o: &Op| match o {
            Op::Rope { buf: b, table, .. } if b == buf => Some(if table == "local" { RopeTable::Local } else { RopeTable::Global }),
            _ => None,
        }
    };
    let rope = match ops.take(table("q")) {
        Some(t) if ops.take(table("k")) == Some(t) => Some(t),
        Some(_) => return Err(ops.refuse()),
        None => None,
    };
    let (cos, sin) = match rope {
        Some(t) => (Arg::Buf(Buf::Cos(t)), Arg::Buf(Buf::Sin(t))),
        None => (Arg::Null, Arg::Null),
    };
    ops.take(|o| matches!(o, Op::KvWrite { layer } if *layer as usize == l).then_some(())).ok_or_else(|| ops.refuse())?;
    let window = ops
        .take(|o| match o {
            Op::Attention { layer, window, softcap: None, .. } if *layer as usize == l => Some(Arg::I32(window.map_or(0, |x| x as i32))),
            _ => None,
        })
        .ok_or_else(|| ops.refuse())?;
    // The O projection and its way into the residual (taken here: prefill's attention merge
    // writes the O GEMM's input, in that weight's type).
    let wo = ops.take(|o| match o {
        Op::Matvec { weight, input, out, .. } if input == "att" && out == "o" => Some(role(weight)),
        _ => None,
    });
    let (Some(wo), Some(r)) = (wo, residual(&mut ops, "o")) else { return Err(ops.refuse()) };
    let (kc, vc, use_rope) = (Arg::Buf(Buf::KCache(l)), Arg::Buf(Buf::VCache(l)), Arg::I32(rope.is_some() as i32));
    out.k(
        "attn_decode",
        (None, Grid::HeadSplits { heads: d.num_heads as usize }),
        ATTN_WARPS * 32,
        vec![Arg::Buf(Buf::Qkv), qn, kn, cos, sin, Arg::Buf(Buf::Pos), kc, vc, use_rope, window, Arg::Buf(Buf::Part), Arg::Buf(Buf::AttnCount), Arg::Buf(Buf::Att)],
    );
    out.pk("qk_rope_kv", (None, Grid::Rows), 256, vec![Arg::Buf(Buf::PQkv), qn, kn, cos, sin, Arg::Buf(Buf::Pos), kc, vc, use_rope]);
    out.pk("attn_partial", (None, Grid::HeadRowsZ { heads: d.num_heads as usize }), ATTN_WARPS * 32, vec![Arg::Buf(Buf::PQkv), kc, vc, Arg::Buf(Buf::Pos), window, Arg::Ctx, Arg::Buf(Buf::PPart)]);
    out.pk("attn_combine_rows", (Some((wo, li)), Grid::HeadRowsY { heads: d.num_heads as usize }), d.head_dim as u32, vec![Arg::Buf(Buf::PPart), Arg::I32(1), Arg::Buf(Buf::PAtt)]);
    out.push_residual(r, ("o_residual", "o_proj"), Buf::Att, (wo, li), Buf::PAtt, h, q);

    // norm + gate/up + activation, then down into the residual
    let ffn_norm = ops.take(|o| match o {
        Op::RmsNorm { weight, input, out, .. } if input == "x" && out == "xn" => Some(role(weight)),
        _ => None,
    });
    let Some(ffn_norm) = ffn_norm else { return Err(ops.refuse()) };
    if let Some((experts, top_k, renorm)) = ops.take(|o| match o {
        Op::Moe { experts, top_k, renorm, .. } => Some((*experts as usize, *top_k as usize, *renorm)),
        _ => None,
    }) {
        let r = residual(&mut ops, "down").ok_or_else(|| ops.refuse())?;
        let Residual::Plain = r else { return Err(Unsupported("mixture-of-experts layers with a post-feedforward norm".into())) };
        out.moe(li, ffn_norm, (experts, top_k, renorm), h, d.intermediate_size as usize);
        return if ops.done() { Ok(out) } else { Err(ops.refuse()) };
    }
    ops.take(|o| matches!(o, Op::Mlp { .. }).then_some(())).ok_or_else(|| ops.refuse())?;
    let (ffn, gate, up, down) = (d.intermediate_size as usize, Role::FfnGate, Role::FfnUp, Role::FfnDown);
    out.k("norm_gateup", mv((gate, li), h, ffn, 2), MV, vec![Arg::Buf(Buf::X), w(ffn_norm), w(gate), w(up), Arg::Buf(Buf::Act)]);
    out.pk("rows_norm", (Some((gate, li)), Grid::Rows), 256, vec![Arg::Buf(Buf::PX), w(ffn_norm), Arg::Buf(Buf::PXn)]);
    out.gemm((gate, li), Buf::PXn, Buf::PGate, 0, ffn, ffn, h, false);
    out.gemm((up, li), Buf::PXn, Buf::PUp, 0, ffn, ffn, h, false);
    out.pk("rows_act", (Some((down, li)), Grid::Elements { width: ffn }), 256, vec![Arg::Buf(Buf::PGate), Arg::Buf(Buf::PUp), Arg::Buf(Buf::PAct), Arg::Elements { width: ffn }]);
    let r = residual(&mut ops, "down").ok_or_else(|| ops.refuse())?;
    out.push_residual(r, ("down_residual", "down_proj"), Buf::Act, (down, li), Buf::PAct, h, ffn);

    if ops.done() { Ok(out) } else { Err(ops.refuse()) }
}

fn lower_prologue(ops: &[Op], d: &ShapeDims) -> Result<Out, Unsupported> {
    let mut ops = Ops { ops, at: 0 };
    ops.take(|o| matches!(o, Op::Embed { out, .. } if out == "x").then_some(())).ok_or_else(|| ops.refuse())?;
    let mut out = Out::default();
    let table = Arg::Weight(Role::TokenEmbd, None);
    let typed = Some((Role::TokenEmbd, None));
    out.k("embed", (typed, Grid::Fixed((d.hidden_size as usize).div_ceil(256) as u32, 1, 1)), 256, vec![table, Arg::Buf(Buf::Tok), Arg::Buf(Buf::X)]);
    out.pk("rows_embed", (typed, Grid::Rows), 256, vec![table, Arg::Buf(Buf::PToks), Arg::Buf(Buf::PX)]);
    if ops.done() { Ok(out) } else { Err(ops.refuse()) }
}

/// Final norm + LM head (each block keeps its best logit), then the argmax over the blocks'
/// candidates, which writes the next token and advances the position.
fn lower_epilogue(ops: &[Op], d: &ShapeDims) -> Result<Vec<Launch>, Unsupported> {
    let mut ops = Ops { ops, at: 0 };
    let norm = ops.take(|o| match o {
        Op::RmsNorm { weight, input, out, .. } if input == "x" && out == "xn" => Some(role(weight)),
        _ => None,
    });
    let head = ops.take(|o| match o {
        Op::LmHead { weight, .. } => Some(role(weight)),
        _ => None,
    });
    let (Some(norm), Some(head)) = (norm, head) else { return Err(ops.refuse()) };
    if !ops.done() {
        return Err(ops.refuse());
    }
    let (typed_by, grid) = mv((head, None), d.hidden_size as usize, d.vocab_size as usize, 1);
    Ok(vec![
        Launch {
            kernel: "norm_lm_head",
            typed_by,
            grid,
            block: MV,
            args: vec![Arg::Buf(Buf::X), Arg::Weight(norm, None), Arg::Weight(head, None), Arg::Buf(Buf::Logits), Arg::Buf(Buf::ArgPart)],
        },
        Launch { kernel: "argmax_step", typed_by: None, grid: Grid::Fixed(1, 1, 1), block: 1024, args: vec![Arg::Buf(Buf::ArgPart), Arg::GridX(grid), Arg::Buf(Buf::Tok), Arg::Buf(Buf::Pos)] },
    ])
}

/// The schedule in the pieces it is generated as: the prologue, each layer, the epilogue.
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduleParts {
    pub prologue: Out,
    pub layers: Vec<Out>,
    /// The decode step's tail, which prefill also runs on the prompt's last row.
    pub epilogue: Vec<Launch>,
}

impl ScheduleParts {
    /// The pieces in launch order.
    pub fn schedule(&self) -> Schedule {
        let mut decode = self.prologue.decode.clone();
        let mut prefill = self.prologue.prefill.clone();
        let mut layers = Vec::new();
        for l in &self.layers {
            layers.push(LayerSteps { decode: decode.len()..decode.len() + l.decode.len(), prefill: prefill.len()..prefill.len() + l.prefill.len() });
            decode.extend(l.decode.iter().cloned());
            prefill.extend(l.prefill.iter().cloned());
        }
        decode.extend(self.epilogue.iter().cloned());
        Schedule { decode, prefill, epilogue: self.epilogue.clone(), layers }
    }
}

/// The CUDA schedule of a plan in its pieces, or the first op the kernels cannot run.
pub fn cuda_schedule_parts(desc: &Description, plan: &Plan) -> Result<ScheduleParts, Unsupported> {
    let d = crate::description::shape_dims(desc);
    Ok(ScheduleParts {
        prologue: lower_prologue(&plan.prologue, &d)?,
        layers: plan.layers.iter().map(|lp| lower_layer(lp, &d)).collect::<Result<_, _>>()?,
        epilogue: lower_epilogue(&plan.epilogue, &d)?,
    })
}

/// The whole CUDA schedule of a plan, or the first op the kernels cannot run.
pub fn cuda_schedule(desc: &Description, plan: &Plan) -> Result<Schedule, Unsupported> {
    cuda_schedule_parts(desc, plan).map(|p| p.schedule())
}

// ---- The schedule as Rust tokens (the generated `cuda::schedule()`).

fn grid_tokens(g: &Grid) -> TokenStream {
    match *g {
        Grid::Matvec { weight, in_features, rows, nr } => {
            let w = weight_tokens(weight.0, weight.1);
            quote!(Grid::Matvec { weight: (#w), in_features: #in_features, rows: #rows, nr: #nr })
        }
        Grid::MatvecRows { weight, in_features, rows, nr } => {
            let w = weight_tokens(weight.0, weight.1);
            quote!(Grid::MatvecRows { weight: (#w), in_features: #in_features, rows: #rows, nr: #nr })
        }
        Grid::ExpertTiles { weight, in_features, rows, nr, experts, top_k } => {
            let w = weight_tokens(weight.0, weight.1);
            quote!(Grid::ExpertTiles { weight: (#w), in_features: #in_features, rows: #rows, nr: #nr, experts: #experts, top_k: #top_k })
        }
        Grid::HeadSplits { heads } => quote!(Grid::HeadSplits { heads: #heads }),
        Grid::Fixed(x, y, z) => quote!(Grid::Fixed(#x, #y, #z)),
        Grid::Rows => quote!(Grid::Rows),
        Grid::HeadRowsZ { heads } => quote!(Grid::HeadRowsZ { heads: #heads }),
        Grid::HeadRowsY { heads } => quote!(Grid::HeadRowsY { heads: #heads }),
        Grid::Elements { width } => quote!(Grid::Elements { width: #width }),
    }
}

fn buf_tokens(b: Buf) -> TokenStream {
    let table = |t: RopeTable| match t {
        RopeTable::Global => quote!(RopeTable::Global),
        RopeTable::Local => quote!(RopeTable::Local),
    };
    match b {
        Buf::Cos(t) => {
            let t = table(t);
            quote!(Buf::Cos(#t))
        }
        Buf::Sin(t) => {
            let t = table(t);
            quote!(Buf::Sin(#t))
        }
        Buf::KCache(l) => quote!(Buf::KCache(#l)),
        Buf::VCache(l) => quote!(Buf::VCache(#l)),
        other => {
            let v = quote::format_ident!("{}", format!("{other:?}"));
            quote!(Buf::#v)
        }
    }
}

fn weight_tokens(r: Role, l: Option<u32>) -> TokenStream {
    let v = quote::format_ident!("{}", format!("{r:?}"));
    let l = match l {
        Some(l) => quote!(Some(#l)),
        None => quote!(None),
    };
    quote!(Role::#v, #l)
}

fn arg_tokens(a: &Arg) -> TokenStream {
    match *a {
        Arg::Buf(b) => {
            let b = buf_tokens(b);
            quote!(Arg::Buf(#b))
        }
        Arg::Weight(r, l) => {
            let w = weight_tokens(r, l);
            quote!(Arg::Weight(#w))
        }
        Arg::Null => quote!(Arg::Null),
        Arg::I32(v) => quote!(Arg::I32(#v)),
        Arg::GridX(g) => {
            let g = grid_tokens(&g);
            quote!(Arg::GridX(#g))
        }
        Arg::Ctx => quote!(Arg::Ctx),
        Arg::Elements { width } => quote!(Arg::Elements { width: #width }),
    }
}

fn launch_tokens(l: &Launch) -> TokenStream {
    let (k, g, b) = (l.kernel, grid_tokens(&l.grid), l.block);
    let typed = match l.typed_by {
        Some((r, layer)) => {
            let w = weight_tokens(r, layer);
            quote!(Some((#w)))
        }
        None => quote!(None),
    };
    let args = l.args.iter().map(arg_tokens);
    quote!(Launch { kernel: #k, typed_by: #typed, grid: #g, block: #b, args: Vec::from([#(#args),*]) })
}

fn step_tokens(s: &Step) -> TokenStream {
    match s {
        Step::Kernel(l) => {
            let l = launch_tokens(l);
            quote!(Step::Kernel(#l))
        }
        Step::Gemm(g) => {
            let w = weight_tokens(g.weight.0, g.weight.1);
            let (i, o) = (buf_tokens(g.input), buf_tokens(g.out));
            let (col, ldc, n, k, acc) = (g.out_col, g.ldc, g.n, g.k, g.accumulate);
            quote!(Step::Gemm(Gemm { weight: (#w), input: #i, out: #o, out_col: #col, ldc: #ldc, n: #n, k: #k, accumulate: #acc }))
        }
    }
}

/// The generated `cuda::schedule()` and the functions it reads like a forward pass from: the
/// prologue, one function per layer (its decode launches and its prefill steps), the epilogue.
/// Or, where the kernels cannot run the plan, `schedule()` returning the refusal.
pub fn schedule_tokens(arch: &str, plan: &Plan, parts: &Result<ScheduleParts, Unsupported>) -> TokenStream {
    let p = match parts {
        Ok(p) => p,
        Err(Unsupported(what)) => {
            return quote! {
                /// This arch on the CUDA backend: refused, naming the plan op no kernel takes.
                pub fn schedule() -> Result<Schedule, PlanError> {
                    Err(PlanError::Unsupported { arch: #arch.to_string(), what: #what.to_string() })
                }
            }
        }
    };
    let piece = |name: &proc_macro2::Ident, doc: &str, o: &Out| {
        let d = o.decode.iter().map(launch_tokens);
        let s = o.prefill.iter().map(step_tokens);
        quote! {
            #[doc = #doc]
            fn #name() -> (Vec<Launch>, Vec<Step>) {
                (Vec::from([#(#d),*]), Vec::from([#(#s),*]))
            }
        }
    };
    let mut fns = vec![piece(&quote::format_ident!("prologue"), " The embedding: `x = token_embd[tok] * scale` (prefill: every prompt row).", &p.prologue)];
    let mut calls = vec![];
    for (lp, o) in plan.layers.iter().zip(&p.layers) {
        let f = quote::format_ident!("layer_{}", lp.layer);
        let doc = format!(" Layer {}: {:?} attention, RoPE {}.", lp.layer, lp.attention, if lp.rope { "on" } else { "off" });
        fns.push(piece(&f, &doc, o));
        calls.push(quote!(#f()));
    }
    let epi = p.epilogue.iter().map(launch_tokens);
    quote! {
        /// The decode step (one CUDA graph), a prefill pass and its epilogue, in launch order.
        pub fn schedule() -> Result<Schedule, PlanError> {
            let (mut decode, mut prefill) = prologue();
            let mut layers = Vec::new();
            for (d, p) in [#(#calls),*] {
                layers.push(LayerSteps { decode: decode.len()..decode.len() + d.len(), prefill: prefill.len()..prefill.len() + p.len() });
                decode.extend(d);
                prefill.extend(p);
            }
            let epilogue = epilogue();
            decode.extend(epilogue.iter().cloned());
            Ok(Schedule { decode, prefill, epilogue, layers })
        }

        #(#fns)*

        /// Final norm + LM head, then the argmax that writes the next token and advances the position.
        fn epilogue() -> Vec<Launch> {
            Vec::from([#(#epi),*])
        }
    }
}
