//! Host-side plan of the CUDA decode step: what an arch needs on the device (buffer layout), which
//! kernels run in which order with which arguments (the launch list captured into one CUDA graph),
//! and the kernel cache key. Pure data, compiled and unit-tested without a GPU or CUDA toolkit.

use std::collections::BTreeMap;

use crate::role::Role;

/// Warps per block of every matvec kernel (one output row per warp at a time). The kernel
/// template receives the same constant, so plan and kernels cannot disagree.
pub const MATVEC_WARPS: u32 = 8;
/// Warps per block of the split attention kernel: a load round covers 4 rows per warp, so one
/// cluster of 8 single-round blocks takes 256 rows (run 22: 8 beat 4 and 16).
pub const ATTN_WARPS: u32 = 8;
/// KV-cache rows per attention block (flash-decoding split).
pub const ATTN_CHUNK: usize = 64;
/// Splits of one head's decode attention per thread-block cluster on sm_90+ (the kernel's
/// `ATTN_CLUSTER`): they merge through distributed shared memory. The split count is a multiple.
pub const ATTN_CLUSTER: usize = 8;
/// Matvec grids stop growing at this many blocks per multiprocessor (what their `__launch_bounds__`
/// keeps resident); blocks then stride over the rows.
pub const MATVEC_BLOCKS_PER_SM: u32 = 4;
/// No matvec grid is larger (the LM head's per-block argmax candidates are sized by it).
pub const MATVEC_MAX_BLOCKS: u32 = 4096;
/// Byte alignment of every region in the device arenas (16-byte vector loads need 16; 256 matches cudaMalloc).
pub const ALIGN: usize = 256;

/// Which RoPE table a layer rotates with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RopeTable {
    Global,
    Local,
}

/// One layer as the decode step sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerSpec {
    pub rope: Option<RopeTable>,
    /// Sliding-window length (attend to the last `window` positions), or full attention.
    pub window: Option<usize>,
}

/// What a generated module tells the CUDA runtime about its arch: shapes, per-layer kinds and the
/// kernel sources thin-codegen rendered at those shapes.
#[derive(Debug, Clone)]
pub struct CudaArch {
    pub arch: &'static str,
    pub fingerprint: &'static str,
    pub vocab: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub max_positions: usize,
    /// Gemma-style post-attention and post-FFN norms before each residual add.
    pub sandwich: bool,
    /// Per-head RMS norm of q and k before RoPE.
    pub qk_norm: bool,
    pub tied_embeddings: bool,
    pub moe: bool,
    pub attn_softcap: Option<f32>,
    pub final_softcap: Option<f32>,
    pub inv_freq_global: Vec<f64>,
    pub inv_freq_local: Vec<f64>,
    pub layers: Vec<LayerSpec>,
    /// Kernel sources, weights stored as bf16 and as f32.
    pub kernels_bf16: &'static str,
    pub kernels_f32: &'static str,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    #[error("{arch}: the CUDA backend has no {what} yet; use --backend cpu")]
    Unsupported { arch: String, what: &'static str },
    #[error("context length {ctx} must be between 1 and the arch's max_position_embeddings {max}")]
    Context { ctx: usize, max: usize },
    #[error("{arch}: no persistent decode step (it needs a dense pre-norm arch without softcaps whose largest matvec input fits 40 KiB); unset THIN_PERSISTENT")]
    NoPersistent { arch: String },
}

/// A device buffer of the decode step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Buf {
    /// Residual stream `[hidden]` f32.
    X,
    /// q | k | v of the current token, f32.
    Qkv,
    /// Attention output `[heads * head_dim]` f32.
    Att,
    /// A projection output before its post-norm (sandwich archs) `[hidden]` f32.
    O,
    /// MLP activation `[ffn]` f32.
    Act,
    Logits,
    /// Attention partials `[heads, splits, head_dim + 2]` f32.
    Part,
    /// The current token id (i32), written by the host or by the previous step's argmax.
    Tok,
    /// The current position (i32); the step's last kernel increments it.
    Pos,
    Cos(RopeTable),
    Sin(RopeTable),
    KCache(usize),
    VCache(usize),
    /// Prefill rows `[rows, hidden]` f32: the residual stream of every prompt token.
    PX,
    /// Prefill rows normed, in the weights' type (GEMM input) `[rows, hidden]`.
    PXn,
    /// Prefill q | k | v rows `[rows, qkv]` f32.
    PQkv,
    /// Prefill attention partials `[rows, heads, 1, head_dim + 2]` f32.
    PPart,
    /// Prefill attention output rows in the weights' type `[rows, heads * head_dim]`.
    PAtt,
    /// Prefill projection rows before a post-norm `[rows, hidden]` f32.
    PO,
    PGate,
    PUp,
    /// Prefill MLP activation rows in the weights' type `[rows, ffn]`.
    PAct,
    /// Prefill token ids (i32).
    PToks,
    /// Per head, the attention blocks of the current layer done so far (i32; the last resets it).
    AttnCount,
    /// The LM head's best (logit, index as f32 bits) per block, `[MATVEC_MAX_BLOCKS, 2]`.
    ArgPart,
    /// The persistent step's per-layer arguments, `[layers]` of [`LAYER_ARGS_BYTES`] ([`layer_args`]).
    LayerTable,
    /// The persistent step's grid barrier: arrival count and generation (u32 each, zero at start).
    GridBar,
}

/// Bytes of one layer's entry in [`Buf::LayerTable`]: the kernel's `struct LayerArgs`, 15
/// pointers then two i32 (it static_asserts the same size).
pub const LAYER_ARGS_BYTES: usize = 128;
/// The persistent step's grid stops at this many blocks per multiprocessor (the runtime asks the
/// driver how many stay resident; the plan itself launches one per multiprocessor).
pub const PERSISTENT_MAX_BLOCKS_PER_SM: u32 = 2;
/// The persistent step's kernel (resolved only where its plan is used).
pub const PERSISTENT_KERNEL: &str = "decode_persistent";
/// Most bytes of the persistent step's one shared staging buffer (the largest matvec input): static
/// shared memory is 48 KiB a block, and attention and the reductions take a few KiB beside it.
pub const PERSISTENT_MAX_STAGE_BYTES: usize = 40 * 1024;

/// Whether the persistent decode step exists for an arch: dense, pre-norm (the kernel runs the
/// five-phase Llama layer), no softcaps, and its largest matvec input fits the staging buffer.
/// thin-codegen renders the kernel only where this holds.
pub fn persistent_fits(a: &CudaArch) -> bool {
    let dense_prenorm = !a.moe && !a.sandwich && a.attn_softcap.is_none() && a.final_softcap.is_none();
    dense_prenorm && persistent_stage_fits(a.hidden, a.heads * a.head_dim, a.ffn)
}

/// The staging-buffer half of [`persistent_fits`] (thin-codegen asks it from the description).
pub fn persistent_stage_fits(hidden: usize, q_dim: usize, ffn: usize) -> bool {
    hidden.max(q_dim).max(ffn) * 4 <= PERSISTENT_MAX_STAGE_BYTES
}

/// Offsets of every buffer in one device arena.
#[derive(Debug, Clone)]
pub struct Layout {
    pub ctx: usize,
    /// Bytes per weight element (2: bf16, 4: f32); the matvec grids depend on it.
    pub wbytes: usize,
    pub splits: usize,
    /// Matvec grids stop growing at this many blocks per multiprocessor (default
    /// [`MATVEC_BLOCKS_PER_SM`]; fewer leave room for the next kernel's blocks to start early).
    pub matvec_blocks_per_sm: u32,
    /// The same cap for the FFN down projection alone (None: `matvec_blocks_per_sm`). An A/B knob:
    /// each down block stages the whole FFN-wide input, fewer blocks read less of it from L2, but
    /// 2 or 3 a multiprocessor were slower than 4 on the H200 (run 23).
    pub down_blocks_per_sm: Option<u32>,
    /// Most prompt tokens one prefill pass takes (longer prompts go in chunks).
    pub prefill_rows: usize,
    pub total_bytes: usize,
    regions: BTreeMap<Buf, (usize, usize)>,
}

fn align(x: usize) -> usize {
    x.div_ceil(ALIGN) * ALIGN
}

impl Layout {
    /// Lay out the decode activations, `prefill_rows` rows of prefill activations (GEMM inputs in
    /// the weights' type of `wbytes` bytes), the RoPE tables and a bf16 KV cache of `ctx` positions.
    pub fn new(a: &CudaArch, ctx: usize, prefill_rows: usize, wbytes: usize) -> Result<Layout, PlanError> {
        if ctx == 0 || ctx > a.max_positions {
            return Err(PlanError::Context { ctx, max: a.max_positions });
        }
        let splits = ctx.div_ceil(ATTN_CHUNK).next_multiple_of(ATTN_CLUSTER);
        let (q, kv) = (a.heads * a.head_dim, a.kv_heads * a.head_dim);
        let half = a.head_dim / 2;
        let mut sizes: Vec<(Buf, usize)> = vec![
            (Buf::X, a.hidden * 4),
            (Buf::Qkv, (q + 2 * kv) * 4),
            (Buf::Att, q * 4),
            (Buf::O, a.hidden * 4),
            (Buf::Act, a.ffn * 4),
            (Buf::Logits, a.vocab * 4),
            (Buf::Part, a.heads * splits * (a.head_dim + 2) * 4),
            (Buf::Tok, 4),
            (Buf::Pos, 4),
            (Buf::AttnCount, a.heads * 4),
            (Buf::ArgPart, MATVEC_MAX_BLOCKS as usize * 8),
            (Buf::LayerTable, a.layers.len() * LAYER_ARGS_BYTES),
            (Buf::GridBar, 8),
        ];
        let r = prefill_rows.max(1);
        sizes.extend([
            (Buf::PX, r * a.hidden * 4),
            (Buf::PXn, r * a.hidden * wbytes),
            (Buf::PQkv, r * (q + 2 * kv) * 4),
            (Buf::PPart, r * a.heads * (a.head_dim + 2) * 4),
            (Buf::PAtt, r * q * wbytes),
            (Buf::PO, r * a.hidden * 4),
            (Buf::PGate, r * a.ffn * 4),
            (Buf::PUp, r * a.ffn * 4),
            (Buf::PAct, r * a.ffn * wbytes),
            (Buf::PToks, r * 4),
        ]);
        for t in [RopeTable::Global, RopeTable::Local] {
            if a.layers.iter().any(|l| l.rope == Some(t)) {
                sizes.push((Buf::Cos(t), ctx * half * 4));
                sizes.push((Buf::Sin(t), ctx * half * 4));
            }
        }
        for l in 0..a.layers.len() {
            sizes.push((Buf::KCache(l), ctx * kv * 2));
            sizes.push((Buf::VCache(l), ctx * kv * 2));
        }
        let mut regions = BTreeMap::new();
        let mut off = 0;
        for (b, n) in sizes {
            regions.insert(b, (off, n));
            off += align(n);
        }
        Ok(Layout { ctx, wbytes, splits, matvec_blocks_per_sm: MATVEC_BLOCKS_PER_SM, down_blocks_per_sm: None, prefill_rows: r, total_bytes: off, regions })
    }

    /// At most `max` decode attention splits a head (rounded down to whole clusters, at least one):
    /// each split is a block of the attention grid, and blocks past the visible span only exit, so
    /// a grid sized for the whole context spends launch slots on empty blocks at short spans. The
    /// partial buffer keeps its size (an upper bound).
    pub fn limit_splits(&mut self, max: usize) {
        self.splits = self.splits.min((max / ATTN_CLUSTER).max(1) * ATTN_CLUSTER);
    }

    /// (offset, bytes) of a buffer; `None` if this arch does not use it.
    pub fn get(&self, b: Buf) -> Option<(usize, usize)> {
        self.regions.get(&b).copied()
    }

    pub fn regions(&self) -> impl Iterator<Item = (Buf, usize, usize)> + '_ {
        self.regions.iter().map(|(b, (o, n))| (*b, *o, *n))
    }

    /// Bytes of the KV cache alone.
    pub fn kv_bytes(&self) -> usize {
        self.regions.iter().filter(|(b, _)| matches!(b, Buf::KCache(_) | Buf::VCache(_))).map(|(_, (_, n))| *n).sum()
    }
}

/// One kernel argument, resolved to a device pointer or a value at capture time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    Buf(Buf),
    Weight(Role, Option<u32>),
    /// A null pointer (an optional weight this arch does not have).
    Null,
    I32(i32),
}

/// One kernel launch of the decode step.
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    pub kernel: &'static str,
    pub grid: (u32, u32, u32),
    pub block: u32,
    pub args: Vec<Arg>,
}

/// Every kernel name the decode step may launch (the runtime resolves them once at load).
pub const KERNELS: &[&str] = &[
    "embed",
    "norm_qkv",
    "qk_rope_kv",
    "attn_partial",
    "attn_combine",
    "attn_combine_rows",
    "rows_embed",
    "rows_norm",
    "rows_act",
    "o_residual",
    "o_proj",
    "down_residual",
    "down_proj",
    "norm_residual",
    "norm_gateup",
    "norm_lm_head",
    "argmax_step",
    "attn_decode",
];

/// Threads that share one output's dot products in the matvec kernels (the template's
/// `Mv<IN, NR>::T`, `nr` weight rows per output): the fewest of 32, 64, 128, 256 that leave each
/// thread at most 8 16-byte weight vectors, else 256.
pub fn matvec_group_threads(in_features: usize, wbytes: usize, nr: usize) -> u32 {
    let nv = in_features * wbytes / 16;
    [32u32, 64, 128].into_iter().find(|&t| nr * nv.div_ceil(t as usize) <= 8).unwrap_or(256)
}

/// Grid of a matvec over `rows` outputs of `nr` weight rows of `in_features`: enough blocks for
/// every output group (a block takes 256 / group-threads at a time), at most `per_sm` per
/// multiprocessor ([`Layout::matvec_blocks_per_sm`]).
pub fn matvec_grid(in_features: usize, rows: usize, nr: usize, wbytes: usize, sm_count: u32, per_sm: u32) -> (u32, u32, u32) {
    let per_block = (MATVEC_WARPS * 32 / matvec_group_threads(in_features, wbytes, nr)) as usize;
    let need = rows.div_ceil(per_block) as u32;
    (need.min(sm_count.max(1) * per_sm.max(1)).min(MATVEC_MAX_BLOCKS).max(1), 1, 1)
}

fn check_supported(a: &CudaArch) -> Result<(), PlanError> {
    let unsupported = |what| Err(PlanError::Unsupported { arch: a.arch.to_string(), what });
    if a.moe {
        return unsupported("mixture-of-experts kernels");
    }
    if a.attn_softcap.is_some() {
        return unsupported("attention softcap");
    }
    if a.final_softcap.is_some() {
        return unsupported("final logit softcap");
    }
    Ok(())
}

/// The RoPE table arguments and QK-norm weights of one layer's `qk_rope_kv`, and its rope flag.
fn rope_args(a: &CudaArch, spec: &LayerSpec, l: usize) -> [Arg; 5] {
    let li = Some(l as u32);
    let table = spec.rope.unwrap_or(RopeTable::Global);
    let (cos, sin) = if spec.rope.is_some() { (Arg::Buf(Buf::Cos(table)), Arg::Buf(Buf::Sin(table))) } else { (Arg::Null, Arg::Null) };
    let (qn, kn) = if a.qk_norm { (Arg::Weight(Role::AttnQNorm, li), Arg::Weight(Role::AttnKNorm, li)) } else { (Arg::Null, Arg::Null) };
    [qn, kn, cos, sin, Arg::I32(spec.rope.is_some() as i32)]
}

/// How many kernels a decode step is cut into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fusion {
    /// Five kernels a layer: norm+QKV; QK-norm+RoPE+KV write+split attention+combine (the last
    /// block of a head merges); O projection + residual; norm+gate/up+activation; down + residual.
    Fused,
    /// Seven: QK-norm/RoPE/KV write, split attention and combine as kernels of their own (the
    /// pieces prefill also uses); kept to measure what the fusion buys and to bisect.
    Unfused,
    /// One kernel for the whole step: co-resident blocks run the Fused phases with a grid barrier
    /// between them (no kernel boundaries). Only where [`persistent_fits`].
    Persistent,
}

/// Layer `l`'s entry of [`Buf::LayerTable`], in the kernel's `struct LayerArgs` order: 15
/// pointers (attn_norm, q, k, v, o, ffn_norm, gate, up, down, q_norm, k_norm, cos, sin, k cache,
/// v cache; null where absent) then use_rope and window.
pub fn layer_args(a: &CudaArch, l: usize) -> Vec<Arg> {
    let li = Some(l as u32);
    let w = |r| Arg::Weight(r, li);
    let [qn, kn, cos, sin, use_rope] = rope_args(a, &a.layers[l], l);
    let window = Arg::I32(a.layers[l].window.map_or(0, |x| x as i32));
    vec![
        w(Role::AttnNorm),
        w(Role::AttnQ),
        w(Role::AttnK),
        w(Role::AttnV),
        w(Role::AttnO),
        w(Role::FfnNorm),
        w(Role::FfnGate),
        w(Role::FfnUp),
        w(Role::FfnDown),
        qn,
        kn,
        cos,
        sin,
        Arg::Buf(Buf::KCache(l)),
        Arg::Buf(Buf::VCache(l)),
        use_rope,
        window,
    ]
}

/// The persistent step: one launch of `sm_count` blocks (one per multiprocessor; the runtime
/// widens the grid to what the driver says stays resident), [`PERSISTENT_KERNEL`] over the layer table.
fn persistent_launch(a: &CudaArch, layout: &Layout, sm_count: u32) -> Result<Vec<Launch>, PlanError> {
    if !persistent_fits(a) {
        return Err(PlanError::NoPersistent { arch: a.arch.to_string() });
    }
    let head = if a.tied_embeddings { Role::TokenEmbd } else { Role::LmHead };
    let b = Arg::Buf;
    Ok(vec![Launch {
        kernel: PERSISTENT_KERNEL,
        grid: (sm_count.clamp(1, MATVEC_MAX_BLOCKS), 1, 1),
        block: MATVEC_WARPS * 32,
        args: vec![
            b(Buf::LayerTable),
            Arg::Weight(Role::TokenEmbd, None),
            Arg::Weight(Role::OutputNorm, None),
            Arg::Weight(head, None),
            b(Buf::Tok),
            b(Buf::Pos),
            b(Buf::X),
            b(Buf::Qkv),
            b(Buf::Att),
            b(Buf::Act),
            b(Buf::Logits),
            b(Buf::Part),
            b(Buf::AttnCount),
            b(Buf::ArgPart),
            b(Buf::GridBar),
            Arg::I32(layout.splits as i32),
        ],
    }])
}

/// The decode step's epilogue: final norm + LM head, then argmax (which advances the position).
/// Prefill runs it after the prompt's last row, whichever [`Fusion`] the decode step has (the
/// persistent step runs it as phases of its one kernel, so it is planned here on its own).
pub fn epilogue_launches(a: &CudaArch, layout: &Layout, sm_count: u32) -> Result<Vec<Launch>, PlanError> {
    let mut all = decode_launches(a, layout, sm_count, Fusion::Fused)?;
    Ok(all.split_off(all.len() - 2))
}

/// The whole decode step, in order: embed, per layer (see [`Fusion`]), then final norm + LM head
/// and argmax (which also advances the position).
pub fn decode_launches(a: &CudaArch, layout: &Layout, sm_count: u32, fusion: Fusion) -> Result<Vec<Launch>, PlanError> {
    check_supported(a)?;
    if fusion == Fusion::Persistent {
        return persistent_launch(a, layout, sm_count);
    }
    let (q, kv) = (a.heads * a.head_dim, a.kv_heads * a.head_dim);
    let mv = |inf, rows| matvec_grid(inf, rows, 1, layout.wbytes, sm_count, layout.matvec_blocks_per_sm);
    let block = MATVEC_WARPS * 32;
    let mut out = vec![Launch {
        kernel: "embed",
        grid: ((a.hidden.div_ceil(256)) as u32, 1, 1),
        block: 256,
        args: vec![Arg::Weight(Role::TokenEmbd, None), Arg::Buf(Buf::Tok), Arg::Buf(Buf::X)],
    }];
    for (l, spec) in a.layers.iter().enumerate() {
        let li = Some(l as u32);
        let w = |r| Arg::Weight(r, li);
        out.push(Launch {
            kernel: "norm_qkv",
            grid: mv(a.hidden, q + 2 * kv),
            block,
            args: vec![Arg::Buf(Buf::X), w(Role::AttnNorm), w(Role::AttnQ), w(Role::AttnK), w(Role::AttnV), Arg::Buf(Buf::Qkv)],
        });
        if fusion == Fusion::Fused {
            let [qn, kn, cos, sin, use_rope] = rope_args(a, spec, l);
            let window = Arg::I32(spec.window.map_or(0, |x| x as i32));
            out.push(Launch {
                kernel: "attn_decode",
                grid: (a.heads as u32, layout.splits as u32, 1),
                block: ATTN_WARPS * 32,
                args: vec![
                    Arg::Buf(Buf::Qkv),
                    qn,
                    kn,
                    cos,
                    sin,
                    Arg::Buf(Buf::Pos),
                    Arg::Buf(Buf::KCache(l)),
                    Arg::Buf(Buf::VCache(l)),
                    use_rope,
                    window,
                    Arg::Buf(Buf::Part),
                    Arg::Buf(Buf::AttnCount),
                    Arg::Buf(Buf::Att),
                ],
            });
        } else {
            unfused_attention(a, layout, l, &mut out);
        }
        if a.sandwich {
            out.push(Launch { kernel: "o_proj", grid: mv(q, a.hidden), block, args: vec![Arg::Buf(Buf::Att), w(Role::AttnO), Arg::Buf(Buf::O)] });
            out.push(Launch { kernel: "norm_residual", grid: (1, 1, 1), block: 256, args: vec![Arg::Buf(Buf::O), w(Role::AttnPostNorm), Arg::Buf(Buf::X)] });
        } else {
            out.push(Launch { kernel: "o_residual", grid: mv(q, a.hidden), block, args: vec![Arg::Buf(Buf::Att), w(Role::AttnO), Arg::Buf(Buf::X)] });
        }
        mlp_launches(a, layout, l, sm_count, &mut out);
    }
    let head = if a.tied_embeddings { Role::TokenEmbd } else { Role::LmHead };
    let head_grid = mv(a.hidden, a.vocab);
    out.push(Launch {
        kernel: "norm_lm_head",
        grid: head_grid,
        block,
        args: vec![Arg::Buf(Buf::X), Arg::Weight(Role::OutputNorm, None), Arg::Weight(head, None), Arg::Buf(Buf::Logits), Arg::Buf(Buf::ArgPart)],
    });
    out.push(Launch {
        kernel: "argmax_step",
        grid: (1, 1, 1),
        block: 1024,
        args: vec![Arg::Buf(Buf::ArgPart), Arg::I32(head_grid.0 as i32), Arg::Buf(Buf::Tok), Arg::Buf(Buf::Pos)],
    });
    Ok(out)
}

/// The unfused decode attention of layer `l`: QK-norm/RoPE/KV write, split attention, combine into `Att`.
fn unfused_attention(a: &CudaArch, layout: &Layout, l: usize, out: &mut Vec<Launch>) {
    let spec = &a.layers[l];
    let [qn, kn, cos, sin, use_rope] = rope_args(a, spec, l);
    let window = Arg::I32(spec.window.map_or(0, |x| x as i32));
    out.push(Launch {
        kernel: "qk_rope_kv",
        grid: (1, 1, 1),
        block: 256,
        args: vec![Arg::Buf(Buf::Qkv), qn, kn, cos, sin, Arg::Buf(Buf::Pos), Arg::Buf(Buf::KCache(l)), Arg::Buf(Buf::VCache(l)), use_rope],
    });
    out.push(Launch {
        kernel: "attn_partial",
        grid: (a.heads as u32, layout.splits as u32, 1),
        block: ATTN_WARPS * 32,
        args: vec![
            Arg::Buf(Buf::Qkv),
            Arg::Buf(Buf::KCache(l)),
            Arg::Buf(Buf::VCache(l)),
            Arg::Buf(Buf::Pos),
            window,
            Arg::I32(ATTN_CHUNK as i32),
            Arg::Buf(Buf::Part),
        ],
    });
    out.push(Launch {
        kernel: "attn_combine",
        grid: (a.heads as u32, 1, 1),
        block: a.head_dim as u32,
        args: vec![Arg::Buf(Buf::Part), Arg::I32(layout.splits as i32), Arg::Buf(Buf::Att)],
    });
}

/// `out[:, col..col + n] (+)= input · W^T` over `rows` rows: a cuBLAS GEMM of prefill, weights
/// `[n, k]` in their stored type, input rows in the same type, output rows f32 with stride `ldc`.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemm {
    pub weight: (Role, Option<u32>),
    pub input: Buf,
    pub out: Buf,
    pub out_col: usize,
    pub ldc: usize,
    pub n: usize,
    pub k: usize,
    pub accumulate: bool,
}

/// One step of a prefill pass.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    Kernel(Launch),
    Gemm(Gemm),
}

/// A prefill pass over `rows` prompt tokens already in `PToks`, at positions `*Pos ..`: every
/// projection a GEMM over all rows, attention causal over the cache. Leaves the last row's
/// residual in `PX`; the runtime then runs the decode step's final norm, LM head and argmax.
pub fn prefill_steps(a: &CudaArch, layout: &Layout, rows: usize) -> Result<Vec<Step>, PlanError> {
    check_supported(a)?;
    if rows == 0 || rows > layout.prefill_rows {
        return Err(PlanError::Context { ctx: rows, max: layout.prefill_rows });
    }
    let (q, kv, h, ffn) = (a.heads * a.head_dim, a.kv_heads * a.head_dim, a.hidden, a.ffn);
    let r = rows as u32;
    let k = |kernel, grid, block, args| Step::Kernel(Launch { kernel, grid, block, args });
    let gemm = |weight, input, out, out_col, ldc, n, k, accumulate| Step::Gemm(Gemm { weight, input, out, out_col, ldc, n, k, accumulate });
    let mut out = vec![k("rows_embed", (r, 1, 1), 256, vec![Arg::Weight(Role::TokenEmbd, None), Arg::Buf(Buf::PToks), Arg::Buf(Buf::PX)])];
    for (l, spec) in a.layers.iter().enumerate() {
        let li = Some(l as u32);
        let w = |role| Arg::Weight(role, li);
        out.push(k("rows_norm", (r, 1, 1), 256, vec![Arg::Buf(Buf::PX), w(Role::AttnNorm), Arg::Buf(Buf::PXn)]));
        let qkv_w = q + 2 * kv;
        out.push(gemm((Role::AttnQ, li), Buf::PXn, Buf::PQkv, 0, qkv_w, q, h, false));
        out.push(gemm((Role::AttnK, li), Buf::PXn, Buf::PQkv, q, qkv_w, kv, h, false));
        out.push(gemm((Role::AttnV, li), Buf::PXn, Buf::PQkv, q + kv, qkv_w, kv, h, false));
        let [qn, kn, cos, sin, use_rope] = rope_args(a, spec, l);
        out.push(k(
            "qk_rope_kv",
            (r, 1, 1),
            256,
            vec![Arg::Buf(Buf::PQkv), qn, kn, cos, sin, Arg::Buf(Buf::Pos), Arg::Buf(Buf::KCache(l)), Arg::Buf(Buf::VCache(l)), use_rope],
        ));
        out.push(k(
            "attn_partial",
            (a.heads as u32, 1, r),
            ATTN_WARPS * 32,
            vec![
                Arg::Buf(Buf::PQkv),
                Arg::Buf(Buf::KCache(l)),
                Arg::Buf(Buf::VCache(l)),
                Arg::Buf(Buf::Pos),
                Arg::I32(spec.window.map_or(0, |x| x as i32)),
                Arg::I32(layout.ctx as i32),
                Arg::Buf(Buf::PPart),
            ],
        ));
        out.push(k("attn_combine_rows", (a.heads as u32, r, 1), a.head_dim as u32, vec![Arg::Buf(Buf::PPart), Arg::I32(1), Arg::Buf(Buf::PAtt)]));
        if a.sandwich {
            out.push(gemm((Role::AttnO, li), Buf::PAtt, Buf::PO, 0, h, h, q, false));
            out.push(k("norm_residual", (r, 1, 1), 256, vec![Arg::Buf(Buf::PO), w(Role::AttnPostNorm), Arg::Buf(Buf::PX)]));
        } else {
            out.push(gemm((Role::AttnO, li), Buf::PAtt, Buf::PX, 0, h, h, q, true));
        }
        out.push(k("rows_norm", (r, 1, 1), 256, vec![Arg::Buf(Buf::PX), w(Role::FfnNorm), Arg::Buf(Buf::PXn)]));
        out.push(gemm((Role::FfnGate, li), Buf::PXn, Buf::PGate, 0, ffn, ffn, h, false));
        out.push(gemm((Role::FfnUp, li), Buf::PXn, Buf::PUp, 0, ffn, ffn, h, false));
        let n = rows * ffn;
        out.push(k("rows_act", (n.div_ceil(256).min(65535) as u32, 1, 1), 256, vec![Arg::Buf(Buf::PGate), Arg::Buf(Buf::PUp), Arg::Buf(Buf::PAct), Arg::I32(n as i32)]));
        if a.sandwich {
            out.push(gemm((Role::FfnDown, li), Buf::PAct, Buf::PO, 0, h, h, ffn, false));
            out.push(k("norm_residual", (r, 1, 1), 256, vec![Arg::Buf(Buf::PO), w(Role::FfnPostNorm), Arg::Buf(Buf::PX)]));
        } else {
            out.push(gemm((Role::FfnDown, li), Buf::PAct, Buf::PX, 0, h, h, ffn, true));
        }
    }
    Ok(out)
}

/// norm + gate/up + activation, then down + residual (through the post-norm on sandwich archs).
fn mlp_launches(a: &CudaArch, layout: &Layout, l: usize, sm_count: u32, out: &mut Vec<Launch>) {
    let w = |r| Arg::Weight(r, Some(l as u32));
    let block = MATVEC_WARPS * 32;
    out.push(Launch {
        kernel: "norm_gateup",
        grid: matvec_grid(a.hidden, a.ffn, 2, layout.wbytes, sm_count, layout.matvec_blocks_per_sm),
        block,
        args: vec![Arg::Buf(Buf::X), w(Role::FfnNorm), w(Role::FfnGate), w(Role::FfnUp), Arg::Buf(Buf::Act)],
    });
    let grid = matvec_grid(a.ffn, a.hidden, 1, layout.wbytes, sm_count, layout.down_blocks_per_sm.unwrap_or(layout.matvec_blocks_per_sm));
    if a.sandwich {
        out.push(Launch { kernel: "down_proj", grid, block, args: vec![Arg::Buf(Buf::Act), w(Role::FfnDown), Arg::Buf(Buf::O)] });
        out.push(Launch { kernel: "norm_residual", grid: (1, 1, 1), block: 256, args: vec![Arg::Buf(Buf::O), w(Role::FfnPostNorm), Arg::Buf(Buf::X)] });
    } else {
        out.push(Launch { kernel: "down_residual", grid, block, args: vec![Arg::Buf(Buf::Act), w(Role::FfnDown), Arg::Buf(Buf::X)] });
    }
}

/// Every weight the launches read, each once, in first-use order.
pub fn weights_used(launches: &[Launch]) -> Vec<(Role, Option<u32>)> {
    let mut seen = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    for l in launches {
        for a in &l.args {
            if let Arg::Weight(r, layer) = a {
                if seen.insert((*r, *layer)) {
                    out.push((*r, *layer));
                }
            }
        }
    }
    out
}

/// Key of a compiled kernel module in the on-disk cache: blake3 of the source, the arch, the GPU
/// target (e.g. `sm_90`) and the driver version, so any change recompiles and nothing else does.
pub fn kernel_cache_key(source: &str, arch: &str, gpu_target: &str, driver_version: i32) -> String {
    let mut h = blake3::Hasher::new();
    for part in [source.as_bytes(), arch.as_bytes(), gpu_target.as_bytes(), &driver_version.to_le_bytes()] {
        h.update(&(part.len() as u64).to_le_bytes());
        h.update(part);
    }
    h.finalize().to_hex().to_string()
}

/// cos/sin tables `[ctx, head_dim/2]` for one table of the arch, as the CPU reference computes them.
pub fn rope_tables(a: &CudaArch, t: RopeTable, ctx: usize) -> (Vec<f32>, Vec<f32>) {
    let inv = match t {
        RopeTable::Global => &a.inv_freq_global,
        RopeTable::Local => &a.inv_freq_local,
    };
    crate::cpu::rope_tables(inv, ctx)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama_like(layers: usize) -> CudaArch {
        CudaArch {
            arch: "test",
            fingerprint: "fp",
            vocab: 1000,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
            ffn: 128,
            max_positions: 4096,
            sandwich: false,
            qk_norm: false,
            tied_embeddings: true,
            moe: false,
            attn_softcap: None,
            final_softcap: None,
            inv_freq_global: crate::cpu::rope_inv_freq(32, 10000.0),
            inv_freq_local: crate::cpu::rope_inv_freq(32, 10000.0),
            layers: (0..layers).map(|l| LayerSpec { rope: if l % 4 == 3 { None } else { Some(RopeTable::Global) }, window: None }).collect(),
            kernels_bf16: "",
            kernels_f32: "",
        }
    }

    #[test]
    fn layout_regions_are_aligned_disjoint_and_sized() {
        let a = llama_like(3);
        let l = Layout::new(&a, 100, 32, 2).unwrap();
        let mut regions: Vec<_> = l.regions().collect();
        regions.sort_by_key(|r| r.1);
        for w in regions.windows(2) {
            assert!(w[0].1 + w[0].2 <= w[1].1, "{:?} overlaps {:?}", w[0], w[1]);
        }
        for (b, off, n) in &regions {
            assert_eq!(off % ALIGN, 0, "{b:?}");
            assert!(*n > 0, "{b:?}");
        }
        assert_eq!(l.get(Buf::KCache(2)).unwrap().1, 100 * 2 * 32 * 2);
        assert_eq!(l.kv_bytes(), 3 * 2 * 100 * 64 * 2);
        // 100 positions: 2 chunks of 64, rounded up to a whole cluster of splits.
        assert_eq!(l.splits, ATTN_CLUSTER);
        assert_eq!(l.get(Buf::Part).unwrap().1, 4 * ATTN_CLUSTER * 34 * 4);
        assert!(l.get(Buf::Cos(RopeTable::Local)).is_none(), "no layer uses the local table");
        let (last, off, n) = regions.last().copied().unwrap();
        assert!(off + n <= l.total_bytes, "{last:?}");
    }

    #[test]
    fn layout_rejects_bad_context() {
        let a = llama_like(1);
        assert_eq!(Layout::new(&a, 0, 32, 2).unwrap_err(), PlanError::Context { ctx: 0, max: 4096 });
        assert!(Layout::new(&a, 4097, 32, 2).is_err());
    }

    #[test]
    fn launch_list_covers_every_layer_and_weight() {
        let a = llama_like(4);
        let l = Layout::new(&a, 256, 32, 2).unwrap();
        let launches = decode_launches(&a, &l, 132, Fusion::Unfused).unwrap();
        assert_eq!(launches.len(), 1 + 4 * 7 + 2);
        assert_eq!(launches[0].kernel, "embed");
        assert_eq!(launches.last().unwrap().kernel, "argmax_step");
        for la in &launches {
            assert!(KERNELS.contains(&la.kernel), "{} is not in KERNELS", la.kernel);
            assert!(la.block <= 1024 && la.block % 32 == 0, "{la:?}");
            assert!(la.grid.0 >= 1 && la.grid.1 >= 1);
            for arg in &la.args {
                if let Arg::Buf(b) = arg {
                    assert!(l.get(*b).is_some(), "{} uses {b:?}, which the layout lacks", la.kernel);
                }
            }
        }
        // layer 3 is a NoPE layer: no table, rope flag 0.
        let rope: Vec<_> = launches.iter().filter(|x| x.kernel == "qk_rope_kv").collect();
        assert_eq!(rope[3].args[3], Arg::Null);
        assert_eq!(rope[3].args[8], Arg::I32(0));
        assert_eq!(rope[0].args[8], Arg::I32(1));
        let w = weights_used(&launches);
        assert_eq!(w.len(), 1 + 4 * 9 + 1, "embedding (tied head), 9 per layer, output norm: {w:?}");
        assert!(w.contains(&(Role::FfnDown, Some(3))));
        assert!(!w.contains(&(Role::LmHead, None)));
        let attn = launches.iter().find(|x| x.kernel == "attn_partial").unwrap();
        // 256 positions: 4 chunks of 64, rounded up to a whole cluster of splits.
        assert_eq!(attn.grid, (4, ATTN_CLUSTER as u32, 1));
    }

    #[test]
    fn fused_step_has_five_kernels_a_layer_and_the_same_weights() {
        for sandwich in [false, true] {
            let mut a = llama_like(4);
            a.sandwich = sandwich;
            a.qk_norm = sandwich;
            let l = Layout::new(&a, 256, 32, 2).unwrap();
            let fused = decode_launches(&a, &l, 132, Fusion::Fused).unwrap();
            let unfused = decode_launches(&a, &l, 132, Fusion::Unfused).unwrap();
            assert_eq!(fused.len(), 1 + 4 * if sandwich { 7 } else { 5 } + 2);
            assert_eq!(unfused.len(), fused.len() + 4 * 2);
            let mut wf = weights_used(&fused);
            let mut wu = weights_used(&unfused);
            wf.sort();
            wu.sort();
            assert_eq!(wf, wu, "fusion changes kernels, never which weights are read");
            for k in &fused {
                assert!(KERNELS.contains(&k.kernel), "{}", k.kernel);
                assert!(!matches!(k.kernel, "qk_rope_kv" | "attn_partial" | "attn_combine"), "{} left unfused", k.kernel);
            }
        }
    }

    #[test]
    fn residual_adds_follow_a_kernel_that_leaves_the_residual_alone() {
        // o_residual and down_residual read their residual rows before their PDL wait (the
        // matvec template's `res`): the kernel just before them must not write X.
        const LEAVE_X: &[&str] = &["attn_decode", "attn_combine", "norm_gateup"];
        for fusion in [Fusion::Fused, Fusion::Unfused] {
            let a = llama_like(3);
            let launches = decode_launches(&a, &Layout::new(&a, 256, 32, 2).unwrap(), 132, fusion).unwrap();
            let mut seen = 0;
            for w in launches.windows(2) {
                if matches!(w[1].kernel, "o_residual" | "down_residual") {
                    assert!(LEAVE_X.contains(&w[0].kernel), "{} comes right after {}", w[1].kernel, w[0].kernel);
                    seen += 1;
                }
            }
            assert_eq!(seen, 2 * 3);
        }
    }

    #[test]
    fn attention_splits_limit_to_whole_clusters() {
        let a = llama_like(1);
        let mut l = Layout::new(&a, 4096, 32, 2).unwrap();
        assert_eq!(l.splits, 4096 / ATTN_CHUNK);
        let part = l.get(Buf::Part).unwrap();
        l.limit_splits(3 * ATTN_CLUSTER + 1);
        assert_eq!(l.splits, 3 * ATTN_CLUSTER);
        l.limit_splits(1);
        assert_eq!(l.splits, ATTN_CLUSTER, "never below one cluster");
        assert_eq!(l.get(Buf::Part).unwrap(), part, "the partial buffer keeps its (upper-bound) size");
        let attn = decode_launches(&a, &l, 132, Fusion::Fused).unwrap().into_iter().find(|x| x.kernel == "attn_decode").unwrap();
        assert_eq!(attn.grid, (4, ATTN_CLUSTER as u32, 1));
    }

    #[test]
    fn down_cap_applies_to_the_down_projection_only() {
        let mut a = llama_like(2);
        (a.hidden, a.ffn) = (2048, 11008);
        let mut l = Layout::new(&a, 256, 32, 2).unwrap();
        let grids = |l: &Layout| -> Vec<(&str, u32)> {
            decode_launches(&a, l, 132, Fusion::Fused).unwrap().iter().map(|k| (k.kernel, k.grid.0)).collect()
        };
        let base = grids(&l);
        assert!(base.contains(&("down_residual", 132 * MATVEC_BLOCKS_PER_SM)));
        l.down_blocks_per_sm = Some(2);
        let capped = grids(&l);
        for (b, c) in base.iter().zip(&capped) {
            assert_eq!(c.1, if b.0 == "down_residual" { 264 } else { b.1 }, "{}", b.0);
        }
    }

    #[test]
    fn matvec_grid_caps_at_the_machine() {
        // bf16 rows of 2048: a warp per row, 8 rows a block.
        assert_eq!(matvec_group_threads(2048, 2, 1), 32);
        assert_eq!(matvec_grid(2048, 960, 1, 2, 132, MATVEC_BLOCKS_PER_SM), (120, 1, 1));
        assert_eq!(matvec_grid(2048, 128256, 1, 2, 132, MATVEC_BLOCKS_PER_SM), (132 * MATVEC_BLOCKS_PER_SM, 1, 1));
        assert_eq!(matvec_grid(2048, 1, 1, 2, 132, MATVEC_BLOCKS_PER_SM), (1, 1, 1));
        // Gate and up rows together: two warps an output.
        assert_eq!(matvec_group_threads(2048, 2, 2), 64);
        // Long rows share a row over more threads: fewer rows a block, more blocks.
        assert_eq!(matvec_group_threads(11008, 2, 1), 256);
        assert_eq!(matvec_group_threads(8192, 2, 1), 128);
        assert_eq!(matvec_group_threads(2048, 4, 1), 64);
        assert_eq!(matvec_group_threads(576, 2, 1), 32);
        assert_eq!(matvec_grid(11008, 300, 1, 2, 132, MATVEC_BLOCKS_PER_SM), (300, 1, 1));
        assert_eq!(matvec_grid(8192, 300, 1, 2, 132, MATVEC_BLOCKS_PER_SM), (150, 1, 1));
        assert_eq!(matvec_grid(2048, 1 << 30, 1, 2, 100_000, MATVEC_BLOCKS_PER_SM).0, MATVEC_MAX_BLOCKS);
    }

    #[test]
    fn sandwich_and_qk_norm_change_the_launches() {
        let mut a = llama_like(1);
        a.sandwich = true;
        a.qk_norm = true;
        a.tied_embeddings = false;
        let l = Layout::new(&a, 64, 32, 2).unwrap();
        let launches = decode_launches(&a, &l, 132, Fusion::Unfused).unwrap();
        let names: Vec<_> = launches.iter().map(|x| x.kernel).collect();
        assert_eq!(
            names,
            ["embed", "norm_qkv", "qk_rope_kv", "attn_partial", "attn_combine", "o_proj", "norm_residual", "norm_gateup", "down_proj", "norm_residual", "norm_lm_head", "argmax_step"]
        );
        let w = weights_used(&launches);
        assert!(w.contains(&(Role::AttnQNorm, Some(0))) && w.contains(&(Role::FfnPostNorm, Some(0))) && w.contains(&(Role::LmHead, None)));
    }

    #[test]
    fn unsupported_features_are_named() {
        let mut a = llama_like(1);
        a.moe = true;
        let l = Layout::new(&a, 64, 32, 2).unwrap();
        let e = decode_launches(&a, &l, 132, Fusion::Unfused).unwrap_err();
        assert!(e.to_string().contains("mixture-of-experts"), "{e}");
    }

    #[test]
    fn prefill_is_gemms_around_row_kernels() {
        let a = llama_like(2);
        let l = Layout::new(&a, 256, 32, 2).unwrap();
        let steps = prefill_steps(&a, &l, 20).unwrap();
        let gemms: Vec<&Gemm> = steps.iter().filter_map(|s| if let Step::Gemm(g) = s { Some(g) } else { None }).collect();
        assert_eq!(gemms.len(), 2 * 7, "q, k, v, o, gate, up, down per layer");
        let qkv = 4 * 32 + 2 * 2 * 32;
        assert_eq!((gemms[1].out_col, gemms[1].ldc, gemms[1].n, gemms[1].k), (128, qkv, 32 * 2, 64), "k lands after q in the qkv rows");
        assert!(gemms.iter().filter(|g| g.accumulate).all(|g| g.out == Buf::PX), "only the residual GEMMs accumulate");
        assert_eq!(gemms.iter().filter(|g| g.accumulate).count(), 4);
        for s in &steps {
            match s {
                Step::Kernel(k) => {
                    assert!(KERNELS.contains(&k.kernel), "{}", k.kernel);
                    for arg in &k.args {
                        if let Arg::Buf(b) = arg {
                            assert!(l.get(*b).is_some(), "{b:?}");
                        }
                    }
                }
                Step::Gemm(g) => {
                    let (_, bytes) = l.get(g.out).unwrap();
                    assert!((20 - 1) * g.ldc + g.out_col + g.n <= bytes / 4, "{g:?} writes past its buffer");
                }
            }
        }
        let attn = steps.iter().find_map(|s| if let Step::Kernel(k) = s { (k.kernel == "attn_partial").then_some(k) } else { None }).unwrap();
        assert_eq!(attn.grid, (4, 1, 20), "a block per head and prompt row, one split");
        assert!(prefill_steps(&a, &l, 33).is_err(), "more rows than the layout holds");
        assert!(prefill_steps(&a, &l, 0).is_err());
    }

    #[test]
    fn cache_key_changes_with_each_input_only() {
        let k = kernel_cache_key("src", "a", "sm_90", 13000);
        assert_eq!(k, kernel_cache_key("src", "a", "sm_90", 13000));
        assert_eq!(k.len(), 64);
        for other in [
            kernel_cache_key("src2", "a", "sm_90", 13000),
            kernel_cache_key("src", "b", "sm_90", 13000),
            kernel_cache_key("src", "a", "sm_89", 13000),
            kernel_cache_key("src", "a", "sm_90", 12080),
            kernel_cache_key("sr", "ca", "sm_90", 13000),
        ] {
            assert_ne!(k, other);
        }
    }
}
