//! The CUDA schedule as data, and how it lands on a device: the launch list of the decode step and
//! the steps of a prefill pass (both derived by thin-codegen from the description's plan and
//! emitted into `generated/<arch>/mod.rs`), the buffer layout they need, grids resolved for the
//! machine, and the kernel cache key. The runtime executes a [`Schedule`]; it knows no arch flags.
//! Pure data, compiled and unit-tested without a GPU or CUDA toolkit.

use std::collections::BTreeMap;

use std::borrow::Cow;

use crate::arch::ShapeDims;
use crate::codecs::{q4_1, q8_0};
use crate::dtype::DType;
use crate::role::Role;
use crate::weight_format::{ScaleKind, ScaleSection, WeightLayout};

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
/// keeps resident); blocks then stride over the rows. (Runs 18, 19 and 23 measured 2 and 3 slower.)
pub const MATVEC_BLOCKS_PER_SM: u32 = 4;
/// No matvec grid is larger (the LM head's per-block argmax candidates are sized by it).
pub const MATVEC_MAX_BLOCKS: u32 = 4096;
/// Most (row, slot) pairs of one expert a grouped prefill MoE block takes at once (its tile):
/// each weight packet it loads is dotted with that many staged inputs.
pub const MOE_TILE_ROWS: usize = 8;
/// Shared memory a grouped MoE block stages its tile's inputs in (f32 rows; under the 48 KiB of
/// static shared memory a kernel may declare, with room for its reductions).
pub const MOE_STAGE_BYTES: usize = 40 * 1024;
/// Output groups a grouped MoE block takes through its tile (the grid's x covers the rest):
/// enough that staging the tile's inputs is small against streaming the weights.
pub const MOE_GROUPS_PER_BLOCK: usize = 8;
/// Byte alignment of every region in the device arenas (16-byte vector loads need 16; 256 matches cudaMalloc).
pub const ALIGN: usize = 256;
/// Weight storage types the kernels have a traits block for (`kernels/decode.cu.j2`): a kernel
/// that reads weights exists once per type, named [`instance`].
pub const WEIGHT_TYPES: [DType; 6] = [DType::Bf16, DType::F32, DType::F8E4m3, DType::Mxfp4, DType::Q8_0, DType::Q4_1];

/// The element type prefill's GEMMs read for weights stored as `t` (and their input rows): the
/// type itself for bf16 and f32; bf16 for a quantized type, whose matrix the `dequant_<type>`
/// kernel decodes into [`Buf::PW`] before the GEMM.
pub fn gemm_type(t: DType) -> DType {
    match t {
        DType::F32 => DType::F32,
        _ => DType::Bf16,
    }
}

/// The row postscale section the runtime adds to an MXFP4 matrix of `shape` stored in
/// `stored_len` bytes without one (the kernels always read a postscale: one instance for both);
/// `None` for every other tensor.
fn added_postscale(dtype: DType, shape: &[u64], stored_len: u64) -> Option<ScaleSection> {
    if dtype != DType::Mxfp4 || WeightLayout::of(dtype, shape, false).ok()?.byte_len != stored_len {
        return None;
    }
    WeightLayout::of(dtype, shape, true).ok()?.scales.into_iter().find(|s| s.kind == ScaleKind::Row)
}

/// Bytes a tensor of `stored_len` bytes takes on the device, laid out by [`device_bytes`].
pub fn device_len(dtype: DType, shape: &[u64], stored_len: u64) -> u64 {
    match dtype {
        DType::Q8_0 => q8_0::split_len(stored_len as usize / q8_0::BLOCK_BYTES) as u64,
        DType::Q4_1 => q4_1::split_len(stored_len as usize / q4_1::BLOCK_BYTES) as u64,
        _ => added_postscale(dtype, shape, stored_len).map_or(stored_len, |p| p.offset + 2 * p.count),
    }
}

/// A tensor's bytes as the kernels read them: as stored, except
/// - an MXFP4 matrix without a row postscale, which gets a section of bf16 ones where the layout
///   puts one;
/// - GGUF Q8_0 blocks (an f16 scale, then 32 int8: 34 bytes, no 16-byte alignment), split into
///   the int8 values, row-major, then (64-byte aligned) the f16 scales, so the kernels load 16
///   values at a time; likewise Q4_1 (d, m, 16 nibble bytes: 20) into the nibble bytes, then the
///   (d, m) pairs. The same bytes, moved.
pub fn device_bytes<'a>(dtype: DType, shape: &[u64], bytes: Cow<'a, [u8]>) -> Result<Cow<'a, [u8]>, String> {
    match dtype {
        DType::Q8_0 => return q8_0::split_blocks(&bytes).map(Cow::Owned).map_err(|e| e.to_string()),
        DType::Q4_1 => return q4_1::split_blocks(&bytes).map(Cow::Owned).map_err(|e| e.to_string()),
        _ => {}
    }
    let Some(post) = added_postscale(dtype, shape, bytes.len() as u64) else { return Ok(bytes) };
    let mut out = bytes.into_owned();
    out.resize(post.offset as usize, 0);
    for _ in 0..post.count {
        out.extend_from_slice(&half::bf16::ONE.to_le_bytes());
    }
    Ok(Cow::Owned(out))
}

/// Whether prefill dequantizes weights of type `t` before a GEMM.
pub fn dequantized_for_gemm(t: DType) -> bool {
    gemm_type(t) != t
}

/// The kernel that runs `kernel` over weights stored as `t` (`norm_qkv_bf16`).
pub fn instance(kernel: &str, t: DType) -> String {
    format!("{kernel}_{}", t.name())
}

/// A tensor of the archive by role and layer.
pub type WeightRef = (Role, Option<u32>);

/// Which RoPE table a layer rotates with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RopeTable {
    Global,
    Local,
}

/// What a generated module tells the CUDA runtime about its arch: shapes, the schedule thin-codegen
/// derived from the plan, and the kernel sources it rendered at those shapes.
#[derive(Debug, Clone)]
pub struct CudaArch {
    pub arch: &'static str,
    pub fingerprint: &'static str,
    pub dims: ShapeDims,
    pub max_positions: usize,
    pub inv_freq_global: Vec<f64>,
    pub inv_freq_local: Vec<f64>,
    pub schedule: Schedule,
    /// The kernel source; weight-reading kernels under `#ifdef THIN_WEIGHTS_<type>`.
    pub kernels: &'static str,
}

/// The forward pass on the GPU, in launch order.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    /// One decode step: embed, every layer, final norm + LM head + argmax (which advances the
    /// position). Captured once into a CUDA graph.
    pub decode: Vec<Launch>,
    /// One prefill pass over the prompt rows in `PToks` at positions `*Pos ..`: every projection
    /// a GEMM over all rows, attention causal over the cache. Leaves the residual rows in `PX`.
    pub prefill: Vec<Step>,
    /// What runs on the prompt's last row after the prefill passes (the decode step's tail).
    pub epilogue: Vec<Launch>,
    /// Each layer's part of `decode` and `prefill`, in layer order: what a layer kept on the host
    /// (`--residency hybrid`) replaces with the CPU engine's layer. Between two layers the residual
    /// stream (`X`, prefill's `PX`) is the only state that crosses.
    pub layers: Vec<LayerSteps>,
}

/// One layer's launches in [`Schedule::decode`] and steps in [`Schedule::prefill`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerSteps {
    pub decode: std::ops::Range<usize>,
    pub prefill: std::ops::Range<usize>,
}

impl Schedule {
    /// Every kernel launch: the decode step's, prefill's kernels (not its GEMMs), the epilogue's.
    pub fn launches(&self) -> impl Iterator<Item = &Launch> {
        let prefill = self.prefill.iter().filter_map(|s| match s {
            Step::Kernel(l) => Some(l),
            Step::Gemm(_) => None,
        });
        self.decode.iter().chain(prefill).chain(&self.epilogue)
    }

    /// Prefill's GEMMs, in order.
    pub fn gemms(&self) -> impl Iterator<Item = &Gemm> {
        self.prefill.iter().filter_map(|s| match s {
            Step::Gemm(g) => Some(g),
            Step::Kernel(_) => None,
        })
    }

    /// Every kernel the schedule launches, each once, in first-use order.
    pub fn kernels(&self) -> Vec<&'static str> {
        let mut out = Vec::new();
        for l in self.launches() {
            if !out.contains(&l.kernel) {
                out.push(l.kernel);
            }
        }
        out
    }

    /// Every weight the schedule reads, each once, in first-use order (launches, then GEMMs).
    pub fn weights(&self) -> Vec<WeightRef> {
        let mut seen = std::collections::BTreeSet::new();
        let args = self.launches().flat_map(|l| &l.args).filter_map(|a| match *a {
            Arg::Weight(r, layer) => Some((r, layer)),
            _ => None,
        });
        args.chain(self.gemms().map(|g| g.weight)).filter(|w| seen.insert(*w)).collect()
    }

    /// Every buffer a launch or GEMM names.
    pub fn buffers(&self) -> std::collections::BTreeSet<Buf> {
        let args = self.launches().flat_map(|l| &l.args).filter_map(|a| match *a {
            Arg::Buf(b) => Some(b),
            _ => None,
        });
        args.chain(self.gemms().flat_map(|g| [g.input, g.out])).collect()
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    #[error("{arch}: the CUDA backend has no kernels for {what} yet; use --backend cpu")]
    Unsupported { arch: String, what: String },
    #[error("context length {ctx} must be between 1 and the arch's max_position_embeddings {max}")]
    Context { ctx: usize, max: usize },
    #[error("a prefill pass of {rows} rows: the layout holds 1 to {max}")]
    PrefillRows { rows: usize, max: usize },
    #[error("{kernel} reads {a:?} {a_layer:?} stored as {a_type} and {b:?} {b_layer:?} stored as {b_type}: one launch takes one weight type")]
    MixedLaunch { kernel: &'static str, a: Role, a_layer: Option<u32>, a_type: &'static str, b: Role, b_layer: Option<u32>, b_type: &'static str },
    #[error("weight {role:?} {layer:?} is stored as {dtype}; the CUDA kernels read {supported}")]
    WeightType { role: Role, layer: Option<u32>, dtype: &'static str, supported: String },
    #[error("weight {role:?} {layer:?} is absent from the archive")]
    MissingWeight { role: Role, layer: Option<u32> },
    #[error("streamed layer {layer} cannot go through a ring of {slots}: {why}")]
    Ring { layer: u32, slots: usize, why: String },
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
    /// Prefill rows normed, in the weights' GEMM type ([`gemm_type`]) `[rows, hidden]`.
    PXn,
    /// Prefill q | k | v rows `[rows, qkv]` f32.
    PQkv,
    /// Prefill attention partials `[rows, heads, 1, head_dim + 2]` f32.
    PPart,
    /// Prefill attention output rows in the O weights' GEMM type `[rows, heads * head_dim]`.
    PAtt,
    /// Prefill projection rows before a post-norm `[rows, hidden]` f32.
    PO,
    PGate,
    PUp,
    /// Prefill MLP activation rows in the down weights' GEMM type `[rows, ffn]`.
    PAct,
    /// Prefill token ids (i32).
    PToks,
    /// Per head, the attention blocks of the current layer done so far (i32; the last resets it).
    AttnCount,
    /// The LM head's best (logit, index as f32 bits) per block, `[MATVEC_MAX_BLOCKS, 2]`.
    ArgPart,
    /// Prefill: the quantized matrix of the next GEMM decoded to bf16 (the largest such matrix).
    PW,
    /// MoE router logits `[experts]` f32.
    MoeLogits,
    /// MoE routing of the token: the `top_k` chosen experts' indices (i32), best first, then their
    /// weights (f32), `[2 * top_k]`. Written and read on the device only: the decode step never
    /// brings the choice to the host.
    MoeRoute,
    /// The chosen experts' activations `act(gate) * up`, expert after expert, `[top_k * ffn]` f32.
    MoeAct,
    /// Prefill rows of [`Buf::MoeLogits`], [`Buf::MoeRoute`], [`Buf::MoeAct`] (the activations of
    /// (row, slot) pair `row * top_k + slot` at that pair's offset).
    PMoeLogits,
    PMoeRoute,
    PMoeAct,
    /// Prefill's rows grouped by expert (i32, written by `moe_group` on the device): `[experts + 1]`
    /// offsets, expert e's pairs at `[off[e], off[e + 1])` of the list that follows, `[rows * top_k]`
    /// pairs `row * top_k + slot`, by expert, ascending within one.
    PMoeGroups,
    /// Prefill: each (row, slot) pair's down projection before its route weight, `[rows * top_k,
    /// hidden]` f32, summed into the residual row by row in slot order (`moe_combine`).
    PMoeDown,
}

impl Buf {
    /// The layer whose KV cache this is (K or V), if it is one.
    pub fn kv_layer(self) -> Option<usize> {
        match self {
            Buf::KCache(l) | Buf::VCache(l) => Some(l),
            _ => None,
        }
    }
}

/// A launch's grid as the schedule states it; [`Layout::grid`] resolves it for the machine (its
/// multiprocessor count), the layout (attention splits) and a prefill pass's rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grid {
    /// A matvec over `rows` outputs of `nr` rows of `weight` of `in_features` each
    /// ([`matvec_grid`]; the weight's storage type sets how many threads share a row).
    Matvec { weight: WeightRef, in_features: usize, rows: usize, nr: usize },
    /// One block per head and decode attention split: `(heads, splits, 1)`.
    HeadSplits { heads: usize },
    /// [`Grid::Matvec`]'s blocks once for each row of the pass, rows in y: `(matvec, rows, 1)`
    /// (decode: one row). The MoE router and the decode step's expert kernels (prefill's take
    /// [`Grid::ExpertTiles`]).
    MatvecRows { weight: WeightRef, in_features: usize, rows: usize, nr: usize },
    /// Prefill's grouped MoE kernels: the matvec of `rows` outputs of `nr` rows of `weight` of
    /// `in_features`, split over x (each block [`MOE_GROUPS_PER_BLOCK`] output groups), once for
    /// each tile of one expert's pairs in y, as many as any routing of the pass can make
    /// ([`moe_tiles`]); blocks past the routing's last tile return.
    ExpertTiles { weight: WeightRef, in_features: usize, rows: usize, nr: usize, experts: usize, top_k: usize },
    /// Exactly this grid.
    Fixed(u32, u32, u32),
    /// One block per prefill row: `(rows, 1, 1)`.
    Rows,
    /// One block per head and prefill row, rows in z: `(heads, 1, rows)`.
    HeadRowsZ { heads: usize },
    /// One block per head and prefill row, rows in y: `(heads, rows, 1)`.
    HeadRowsY { heads: usize },
    /// One thread per element of `rows × width`, 256 a block (at most 65,535 blocks; the kernel strides).
    Elements { width: usize },
}

/// One kernel argument, resolved to a device pointer or a value at capture time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    Buf(Buf),
    Weight(Role, Option<u32>),
    /// A null pointer (an optional weight this arch does not have).
    Null,
    I32(i32),
    /// The x size of a grid as resolved (argmax_step: how many per-block candidates the LM head left).
    GridX(Grid),
    /// The KV cache's positions (i32).
    Ctx,
    /// Elements of a prefill pass of `rows × width` (i32).
    Elements { width: usize },
}

/// One kernel launch.
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    pub kernel: &'static str,
    /// The tensor whose storage type picks the kernel's instance ([`instance`]): the weight it
    /// reads, or for a kernel writing a GEMM input, that GEMM's weight. `None`: one kernel for all.
    pub typed_by: Option<WeightRef>,
    pub grid: Grid,
    pub block: u32,
    pub args: Vec<Arg>,
}

/// `out[:, col..col + n] (+)= input · W^T` over the pass's rows: a cuBLAS GEMM of prefill, weights
/// `[n, k]` in their stored type, input rows in the same type (written by a launch typed by this
/// GEMM's weight), output rows f32 with stride `ldc`.
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

/// Threads that share one output's dot products in the matvec kernels (the template's
/// `Mv<IN, NR>::T`, `nr` weight rows per output, `vec` weights per 16-byte vector, the traits
/// block's VEC): the fewest of 32, 64, 128, 256 that leave each thread at most 8 16-byte weight
/// vectors, else 256.
pub fn matvec_group_threads(in_features: usize, vec: usize, nr: usize) -> u32 {
    let nv = in_features / vec;
    [32u32, 64, 128].into_iter().find(|&t| nr * nv.div_ceil(t as usize) <= 8).unwrap_or(256)
}

/// Grid of a matvec over `rows` outputs of `nr` weight rows of `in_features`: enough blocks for
/// every output group (a block takes 256 / group-threads at a time), at most `per_sm` per
/// multiprocessor.
pub fn matvec_grid(in_features: usize, rows: usize, nr: usize, vec: usize, sm_count: u32, per_sm: u32) -> (u32, u32, u32) {
    let per_block = (MATVEC_WARPS * 32 / matvec_group_threads(in_features, vec, nr)) as usize;
    let need = rows.div_ceil(per_block) as u32;
    (need.min(sm_count.max(1) * per_sm.max(1)).min(MATVEC_MAX_BLOCKS).max(1), 1, 1)
}

/// (Row, slot) pairs of one expert a grouped MoE block over inputs of `in_features` takes at once:
/// as many f32 input rows as [`MOE_STAGE_BYTES`] holds, 1 to [`MOE_TILE_ROWS`] (the kernels'
/// `moe_tile<IN>()`).
pub fn moe_tile(in_features: usize) -> usize {
    (MOE_STAGE_BYTES / 4 / in_features.max(1)).clamp(1, MOE_TILE_ROWS)
}

/// The most tiles of `tile` pairs that `pairs` (row, slot) pairs over `experts` experts can make:
/// each expert that has any makes ceil(count / tile), less than count / tile + 1.
pub fn moe_tiles(pairs: usize, experts: usize, tile: usize) -> usize {
    pairs.div_ceil(tile) + experts.min(pairs)
}

/// Offsets of every buffer in one device arena, and the schedule's grids and values resolved for a
/// machine and an archive's weight types.
#[derive(Debug, Clone)]
pub struct Layout {
    pub ctx: usize,
    /// Decode attention splits a head: the context in chunks of [`ATTN_CHUNK`] rows, rounded up
    /// to whole clusters.
    pub splits: usize,
    /// Multiprocessors of the device the grids are sized for.
    pub sm_count: u32,
    /// Most prompt tokens one prefill pass takes (longer prompts go in chunks).
    pub prefill_rows: usize,
    pub total_bytes: usize,
    /// The storage type of every weight the schedule reads.
    pub types: BTreeMap<WeightRef, DType>,
    regions: BTreeMap<Buf, (usize, usize)>,
}

fn align(x: usize) -> usize {
    x.div_ceil(ALIGN) * ALIGN
}

/// Bytes per element of a GEMM input type (f32 or bf16).
fn elem_bytes(t: DType) -> usize {
    if t == DType::F32 { 4 } else { 2 }
}

/// Weights per 16-byte vector of a storage type the matvecs read (the traits block's VEC).
pub fn weights_per_vec(t: DType) -> usize {
    match t {
        DType::F32 => 4,
        DType::F16 | DType::Bf16 => 8,
        DType::F8E4m3 | DType::Q8_0 => 16,
        DType::Mxfp4 | DType::Q4_1 => 32,
    }
}

impl Layout {
    /// Lay out every buffer `a`'s schedule names: decode activations, `prefill_rows` rows of
    /// prefill activations (GEMM inputs sized for the widest weight type), the RoPE tables and a
    /// bf16 KV cache of `ctx` positions for each layer that has one. `type_of` gives each weight's
    /// storage type; every launch's weights must share one, of [`WEIGHT_TYPES`].
    pub fn new(a: &CudaArch, ctx: usize, prefill_rows: usize, type_of: &dyn Fn(WeightRef) -> Option<DType>, sm_count: u32) -> Result<Layout, PlanError> {
        if ctx == 0 || ctx > a.max_positions {
            return Err(PlanError::Context { ctx, max: a.max_positions });
        }
        let mut types = BTreeMap::new();
        for w in a.schedule.weights() {
            let t = type_of(w).ok_or(PlanError::MissingWeight { role: w.0, layer: w.1 })?;
            if !w.0.is_norm() && !WEIGHT_TYPES.contains(&t) {
                let supported = WEIGHT_TYPES.iter().map(|t| t.name()).collect::<Vec<_>>().join(", ");
                return Err(PlanError::WeightType { role: w.0, layer: w.1, dtype: t.name(), supported });
            }
            types.insert(w, t);
        }
        check_launch_types(&a.schedule, &types)?;
        let wbytes = types.iter().filter(|(w, _)| !w.0.is_norm()).map(|(_, t)| elem_bytes(gemm_type(*t))).max().unwrap_or(4);
        // The largest quantized matrix a prefill GEMM reads, decoded to bf16.
        let pw = a.schedule.gemms().filter(|g| dequantized_for_gemm(types[&g.weight])).map(|g| g.n * g.k * 2).max();
        let splits = ctx.div_ceil(ATTN_CHUNK).next_multiple_of(ATTN_CLUSTER);
        let d = &a.dims;
        let (hidden, heads, head_dim, ffn, vocab) = (d.hidden_size as usize, d.num_heads as usize, d.head_dim as usize, d.intermediate_size as usize, d.vocab_size as usize);
        let (experts, top_k) = (d.num_experts as usize, d.top_k as usize);
        let (q, kv) = (d.q_dim() as usize, d.kv_dim() as usize);
        let half = head_dim / 2;
        let r = prefill_rows.max(1);
        let bytes = |b: Buf| match b {
            Buf::X | Buf::O => hidden * 4,
            Buf::Qkv => (q + 2 * kv) * 4,
            Buf::Att => q * 4,
            Buf::Act => ffn * 4,
            Buf::Logits => vocab * 4,
            Buf::Part => heads * splits * (head_dim + 2) * 4,
            Buf::Tok | Buf::Pos => 4,
            Buf::AttnCount => heads * 4,
            Buf::ArgPart => MATVEC_MAX_BLOCKS as usize * 8,
            Buf::PX | Buf::PO => r * hidden * 4,
            Buf::PXn => r * hidden * wbytes,
            Buf::PQkv => r * (q + 2 * kv) * 4,
            Buf::PPart => r * heads * (head_dim + 2) * 4,
            Buf::PAtt => r * q * wbytes,
            Buf::PGate | Buf::PUp => r * ffn * 4,
            Buf::PAct => r * ffn * wbytes,
            Buf::PToks => r * 4,
            Buf::PW => pw.unwrap_or(0),
            Buf::Cos(_) | Buf::Sin(_) => ctx * half * 4,
            Buf::KCache(_) | Buf::VCache(_) => ctx * kv * 2,
            Buf::MoeLogits => experts * 4,
            Buf::MoeRoute => 2 * top_k * 4,
            Buf::MoeAct => top_k * ffn * 4,
            Buf::PMoeLogits => r * experts * 4,
            Buf::PMoeRoute => r * 2 * top_k * 4,
            Buf::PMoeAct => r * top_k * ffn * 4,
            Buf::PMoeGroups => (experts + 1 + r * top_k) * 4,
            Buf::PMoeDown => r * top_k * hidden * 4,
        };
        // Tok and Pos are written by the host even where no kernel of the schedule reads them.
        let mut bufs = a.schedule.buffers();
        bufs.extend([Buf::Tok, Buf::Pos]);
        if pw.is_some() {
            bufs.insert(Buf::PW);
        }
        let mut regions = BTreeMap::new();
        let mut off = 0;
        for b in bufs {
            let n = bytes(b);
            regions.insert(b, (off, n));
            off += align(n);
        }
        Ok(Layout { ctx, splits, sm_count, prefill_rows: r, total_bytes: off, types, regions })
    }

    /// (offset, bytes) of a buffer; `None` if the schedule does not use it.
    pub fn get(&self, b: Buf) -> Option<(usize, usize)> {
        self.regions.get(&b).copied()
    }

    pub fn regions(&self) -> impl Iterator<Item = (Buf, usize, usize)> + '_ {
        self.regions.iter().map(|(b, (o, n))| (*b, *o, *n))
    }

    /// This layout without the KV cache of `layers` (layers the CPU engine computes, whose cache
    /// is in host memory), the other buffers packed again in the same order.
    pub fn without_kv_of(&self, layers: &[u32]) -> Layout {
        let mut regions = BTreeMap::new();
        let mut off = 0;
        for (&b, &(_, n)) in &self.regions {
            if b.kv_layer().is_some_and(|l| layers.contains(&(l as u32))) {
                continue;
            }
            regions.insert(b, (off, n));
            off += align(n);
        }
        Layout { total_bytes: off, regions, ..self.clone() }
    }

    /// Bytes of the KV cache alone.
    pub fn kv_bytes(&self) -> usize {
        self.regions.iter().filter(|(b, _)| b.kv_layer().is_some()).map(|(_, (_, n))| *n).sum()
    }

    /// The storage type of a weight the schedule reads.
    pub fn type_of(&self, w: WeightRef) -> Option<DType> {
        self.types.get(&w).copied()
    }

    /// The kernel a launch runs here: its instance for its weights' type, or the kernel itself.
    pub fn kernel(&self, l: &Launch) -> String {
        match l.typed_by.and_then(|w| self.type_of(w)) {
            Some(t) => instance(l.kernel, t),
            None => l.kernel.to_string(),
        }
    }

    /// The grid of a launch here, in a prefill pass of `rows` rows (decode: 1).
    pub fn grid(&self, g: Grid, rows: usize) -> (u32, u32, u32) {
        let r = rows as u32;
        match g {
            Grid::Matvec { weight, in_features, rows: out, nr } => {
                let vec = self.type_of(weight).map_or(4, weights_per_vec);
                matvec_grid(in_features, out, nr, vec, self.sm_count, MATVEC_BLOCKS_PER_SM)
            }
            Grid::MatvecRows { weight, in_features, rows: out, nr } => {
                let vec = self.type_of(weight).map_or(4, weights_per_vec);
                (matvec_grid(in_features, out, nr, vec, self.sm_count, MATVEC_BLOCKS_PER_SM).0, r, 1)
            }
            Grid::ExpertTiles { weight, in_features, rows: out, nr, experts, top_k } => {
                let vec = self.type_of(weight).map_or(4, weights_per_vec);
                let per_block = (MATVEC_WARPS * 32 / matvec_group_threads(in_features, vec, nr)) as usize * MOE_GROUPS_PER_BLOCK;
                (out.div_ceil(per_block) as u32, moe_tiles(rows * top_k, experts, moe_tile(in_features)) as u32, 1)
            }
            Grid::HeadSplits { heads } => (heads as u32, self.splits as u32, 1),
            Grid::Fixed(x, y, z) => (x, y, z),
            Grid::Rows => (r, 1, 1),
            Grid::HeadRowsZ { heads } => (heads as u32, 1, r),
            Grid::HeadRowsY { heads } => (heads as u32, r, 1),
            Grid::Elements { width } => ((rows * width).div_ceil(256).min(65535) as u32, 1, 1),
        }
    }

    /// The value of an argument that is not a pointer, in a prefill pass of `rows` rows (decode: 1).
    pub fn value(&self, a: Arg, rows: usize) -> Option<i32> {
        match a {
            Arg::I32(v) => Some(v),
            Arg::GridX(g) => Some(self.grid(g, rows).0 as i32),
            Arg::Ctx => Some(self.ctx as i32),
            Arg::Elements { width } => Some((rows * width) as i32),
            Arg::Buf(_) | Arg::Weight(..) | Arg::Null => None,
        }
    }
}

impl Launch {
    /// The weights it reads.
    pub fn weights(&self) -> impl Iterator<Item = WeightRef> + '_ {
        self.args.iter().filter_map(|a| match *a {
            Arg::Weight(r, l) => Some((r, l)),
            _ => None,
        })
    }
}

impl Step {
    /// The weights it reads.
    pub fn weights(&self) -> Vec<WeightRef> {
        match self {
            Step::Kernel(l) => l.weights().collect(),
            Step::Gemm(g) => vec![g.weight],
        }
    }
}

/// When one streamed layer passes through the ring in a pass over a list of steps (the decode
/// step's launches, or a prefill pass's steps).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct RingUse {
    pub layer: u32,
    /// Its index among the streamed layers modulo the slots.
    pub slot: usize,
    /// The first and last step that read its matrices: the first waits for its copy.
    pub first: usize,
    pub last: usize,
    /// The step whose completion frees its slot: the last use of the layer `slots` before it in
    /// the ring, which its copy waits for; `None` for the first `slots` layers, whose copies may
    /// start with the pass.
    pub after: Option<usize>,
}

/// How `streamed` (in ring order, a matrix of each in the slot `index % slots`) passes through a
/// ring of `slots` buffers over `steps` (each step's weights): the copy of a layer can wait for
/// the last use of the layer before it in its slot, and the first use of a layer can wait for its
/// copy, only if every streamed layer is read, first read in ring order, and first read after the
/// previous layer of its slot was last read. Norm weights and weights outside the layers never
/// stream.
pub fn ring_uses(steps: &[Vec<WeightRef>], streamed: &[u32], slots: usize) -> Result<Vec<RingUse>, PlanError> {
    let err = |layer, why: String| PlanError::Ring { layer, slots, why };
    if slots == 0 {
        return match streamed.first() {
            Some(&l) => Err(err(l, "no slots".into())),
            None => Ok(Vec::new()),
        };
    }
    let mut uses: Vec<RingUse> = Vec::with_capacity(streamed.len());
    for (i, &layer) in streamed.iter().enumerate() {
        let reads = |ws: &Vec<WeightRef>| ws.iter().any(|&(r, l)| l == Some(layer) && !r.is_norm());
        let first = steps.iter().position(reads).ok_or_else(|| err(layer, "the pass never reads it".into()))?;
        let last = steps.iter().rposition(reads).unwrap_or(first);
        if let Some(prev) = uses.last() {
            if first <= prev.first {
                return Err(err(layer, format!("it is first read at step {first}, not after layer {} (step {}), the one before it in the ring", prev.layer, prev.first)));
            }
        }
        let after = i.checked_sub(slots).map(|j| uses[j].last);
        if let Some(a) = after {
            if first <= a {
                return Err(err(layer, format!("it is first read at step {first}, while layer {} still holds slot {} until step {a}", uses[i - slots].layer, i % slots)));
            }
        }
        uses.push(RingUse { layer, slot: i % slots, first, last, after });
    }
    Ok(uses)
}

/// Every launch's matrices share one storage type (its instance's), and every prefill GEMM reads
/// its input in its weight's type: the type of the launch that last wrote that buffer.
fn check_launch_types(s: &Schedule, types: &BTreeMap<WeightRef, DType>) -> Result<(), PlanError> {
    let mixed = |kernel, a: WeightRef, ta: DType, b: WeightRef, tb: DType| PlanError::MixedLaunch {
        kernel,
        a: a.0,
        a_layer: a.1,
        a_type: ta.name(),
        b: b.0,
        b_layer: b.1,
        b_type: tb.name(),
    };
    let check = |l: &Launch| -> Result<(), PlanError> {
        let Some(by) = l.typed_by else { return Ok(()) };
        let t = types[&by];
        for a in &l.args {
            if let Arg::Weight(r, layer) = *a {
                let u = types[&(r, layer)];
                if !r.is_norm() && u != t {
                    return Err(mixed(l.kernel, by, t, (r, layer), u));
                }
            }
        }
        Ok(())
    };
    s.decode.iter().try_for_each(check)?;
    let mut written: BTreeMap<Buf, (&'static str, WeightRef)> = BTreeMap::new();
    for step in &s.prefill {
        match step {
            Step::Kernel(l) => {
                check(l)?;
                if let (Some(by), Some(Arg::Buf(out))) = (l.typed_by, l.args.last()) {
                    written.insert(*out, (l.kernel, by));
                }
            }
            Step::Gemm(g) => {
                if let Some(&(kernel, by)) = written.get(&g.input) {
                    if gemm_type(types[&by]) != gemm_type(types[&g.weight]) {
                        return Err(mixed(kernel, by, types[&by], g.weight, types[&g.weight]));
                    }
                }
            }
        }
    }
    Ok(())
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

    const HEAD: WeightRef = (Role::TokenEmbd, None);
    const HEAD_GRID: Grid = Grid::Matvec { weight: HEAD, in_features: 64, rows: 1000, nr: 1 };

    /// Every weight stored as bf16 but norms (f32).
    fn bf16(w: WeightRef) -> Option<DType> {
        Some(if w.0.is_norm() { DType::F32 } else { DType::Bf16 })
    }

    /// A two-layer arch whose schedule names a handful of buffers (layer 1 without RoPE).
    fn arch() -> CudaArch {
        let w = |r, l| Arg::Weight(r, l);
        let launch = |kernel, grid, args| Launch { kernel, typed_by: None, grid, block: 256, args };
        let decode = vec![
            launch("embed", Grid::Fixed(1, 1, 1), vec![w(Role::TokenEmbd, None), Arg::Buf(Buf::Tok), Arg::Buf(Buf::X)]),
            launch("attn_decode", Grid::HeadSplits { heads: 4 }, vec![Arg::Buf(Buf::Cos(RopeTable::Global)), Arg::Buf(Buf::KCache(0)), Arg::Buf(Buf::Part)]),
            launch("attn_decode", Grid::HeadSplits { heads: 4 }, vec![Arg::Null, Arg::Buf(Buf::KCache(1)), Arg::Buf(Buf::Part)]),
            Launch { typed_by: Some(HEAD), ..launch("norm_lm_head", HEAD_GRID, vec![Arg::Buf(Buf::X), w(Role::TokenEmbd, None), Arg::Buf(Buf::ArgPart)]) },
            launch("argmax_step", Grid::Fixed(1, 1, 1), vec![Arg::Buf(Buf::ArgPart), Arg::GridX(HEAD_GRID)]),
        ];
        let prefill = vec![
            Step::Kernel(Launch { typed_by: Some(HEAD), ..launch("rows_embed", Grid::Rows, vec![w(Role::TokenEmbd, None), Arg::Buf(Buf::PToks), Arg::Buf(Buf::PX)]) }),
            Step::Kernel(Launch { typed_by: Some((Role::AttnQ, Some(0))), ..launch("rows_norm", Grid::Rows, vec![Arg::Buf(Buf::PX), w(Role::AttnNorm, Some(0)), Arg::Buf(Buf::PXn)]) }),
            Step::Gemm(Gemm { weight: (Role::AttnQ, Some(0)), input: Buf::PXn, out: Buf::PQkv, out_col: 0, ldc: 256, n: 128, k: 64, accumulate: false }),
        ];
        CudaArch {
            arch: "test",
            fingerprint: "fp",
            dims: ShapeDims {
                family: crate::arch::Family::Llama,
                vocab_size: 1000,
                hidden_size: 64,
                num_layers: 1,
                num_heads: 4,
                num_kv_heads: 2,
                head_dim: 32,
                intermediate_size: 128,
                num_experts: 0,
                top_k: 0,
                tie_word_embeddings: true,
            },
            max_positions: 4096,
            inv_freq_global: crate::cpu::rope_inv_freq(32, 10000.0),
            inv_freq_local: crate::cpu::rope_inv_freq(32, 10000.0),
            schedule: Schedule { epilogue: decode[3..].to_vec(), decode, prefill, layers: vec![LayerSteps { decode: 1..2, prefill: 1..3 }, LayerSteps { decode: 2..3, prefill: 3..3 }] },
            kernels: "",
        }
    }

    #[test]
    fn layout_holds_what_the_schedule_names_aligned_and_disjoint() {
        let a = arch();
        let l = Layout::new(&a, 100, 32, &bf16, 132).unwrap();
        let mut regions: Vec<_> = l.regions().collect();
        regions.sort_by_key(|r| r.1);
        for w in regions.windows(2) {
            assert!(w[0].1 + w[0].2 <= w[1].1, "{:?} overlaps {:?}", w[0], w[1]);
        }
        for (b, off, n) in &regions {
            assert_eq!(off % ALIGN, 0, "{b:?}");
            assert!(*n > 0, "{b:?}");
        }
        assert_eq!(l.get(Buf::KCache(1)).unwrap().1, 100 * 2 * 32 * 2);
        assert_eq!(l.kv_bytes(), 2 * 100 * 64 * 2, "K caches only: the schedule names no V cache");
        // 100 positions: 2 chunks of 64, rounded up to a whole cluster of splits.
        assert_eq!(l.splits, ATTN_CLUSTER);
        assert_eq!(l.get(Buf::Part).unwrap().1, 4 * ATTN_CLUSTER * 34 * 4);
        assert_eq!(l.get(Buf::PXn).unwrap().1, 32 * 64 * 2, "GEMM inputs in the weights' type");
        assert!(l.get(Buf::Cos(RopeTable::Local)).is_none(), "no layer uses the local table");
        assert!(l.get(Buf::Act).is_none() && l.get(Buf::Pos).is_some(), "only named buffers, and the host's Tok and Pos");
        let (last, off, n) = regions.last().copied().unwrap();
        assert!(off + n <= l.total_bytes, "{last:?}");
    }

    /// The MoE buffers: per row the router logits, the route (top-k indices and weights) and the
    /// chosen experts' activations; the MoE grids: the matvec's blocks once per row of the pass.
    #[test]
    fn moe_buffers_and_grids() {
        let mut a = arch();
        (a.dims.num_experts, a.dims.top_k) = (8, 2);
        let down = (Role::MoeDown, Some(0));
        let g = Grid::MatvecRows { weight: down, in_features: 128, rows: 64, nr: 2 };
        let bufs = [Buf::X, Buf::MoeLogits, Buf::MoeRoute, Buf::MoeAct, Buf::PX, Buf::PMoeLogits, Buf::PMoeRoute, Buf::PMoeAct].map(Arg::Buf);
        a.schedule.decode.push(Launch { kernel: "moe_down", typed_by: Some(down), grid: g, block: 256, args: [&bufs[..], &[Arg::Weight(Role::MoeDown, Some(0))]].concat() });
        let l = Layout::new(&a, 64, 32, &bf16, 132).unwrap();
        let sizes: Vec<usize> = [Buf::MoeLogits, Buf::MoeRoute, Buf::MoeAct, Buf::PMoeLogits, Buf::PMoeRoute, Buf::PMoeAct].iter().map(|b| l.get(*b).unwrap().1).collect();
        assert_eq!(sizes, [8 * 4, 2 * 2 * 4, 2 * 128 * 4, 32 * 8 * 4, 32 * 2 * 2 * 4, 32 * 2 * 128 * 4]);
        let x = matvec_grid(128, 64, 2, 8, 132, MATVEC_BLOCKS_PER_SM).0;
        assert_eq!((l.grid(g, 1), l.grid(g, 7)), ((x, 1, 1), (x, 7, 1)));
    }

    /// Prefill's grouped MoE: the groups (offsets, then every pair) and the per-pair down outputs
    /// sized for the most rows; the tile grid covers the most tiles any routing makes.
    #[test]
    fn moe_grouped_buffers_and_grids() {
        let mut a = arch();
        (a.dims.num_experts, a.dims.top_k) = (8, 2);
        let gate = (Role::MoeGate, Some(0));
        let g = Grid::ExpertTiles { weight: gate, in_features: 64, rows: 512, nr: 2, experts: 8, top_k: 2 };
        let bufs = [Buf::PX, Buf::PMoeGroups, Buf::PMoeAct, Buf::PMoeDown].map(Arg::Buf);
        a.schedule.prefill.push(Step::Kernel(Launch { kernel: "moe_gateup_grouped", typed_by: Some(gate), grid: g, block: 256, args: [&bufs[..], &[Arg::Weight(gate.0, gate.1)]].concat() }));
        let l = Layout::new(&a, 64, 32, &bf16, 132).unwrap();
        assert_eq!((l.get(Buf::PMoeGroups).unwrap().1, l.get(Buf::PMoeDown).unwrap().1), ((8 + 1 + 32 * 2) * 4, 32 * 2 * 64 * 4));
        // bf16 rows of 64: 32 threads an output, 8 outputs a group pass, 8 passes a block: x = 512 / 64.
        assert_eq!(moe_tile(64), MOE_TILE_ROWS);
        assert_eq!((l.grid(g, 1), l.grid(g, 7)), ((8, 1 + 2, 1), (8, 2 + 8, 1)));
        // Tiles of OLMoE's gate/up (inputs of 2048: 5 rows fit) and down (1024: 8).
        assert_eq!((moe_tile(2048), moe_tile(1024), moe_tile(1 << 20)), (5, 8, 1));
        // The bound holds for every routing: 7 pairs, tiles of 3, 3 experts.
        for counts in [[7, 0, 0], [3, 3, 1], [1, 1, 5], [2, 2, 3], [4, 3, 0]] {
            assert!(counts.iter().map(|c: &usize| c.div_ceil(3)).sum::<usize>() <= moe_tiles(7, 3, 3), "{counts:?}");
        }
    }

    #[test]
    fn layout_without_a_layers_kv_packs_the_rest() {
        let l = Layout::new(&arch(), 128, 16, &bf16, 132).unwrap();
        let kv = |l: &Layout, i| (l.get(Buf::KCache(i)), l.get(Buf::VCache(i)));
        let w = l.without_kv_of(&[1]);
        assert_eq!(kv(&w, 1), (None, None));
        assert!(kv(&w, 0).0.is_some());
        assert_eq!(w.kv_bytes(), l.kv_bytes() - l.get(Buf::KCache(1)).unwrap().1 - l.get(Buf::VCache(1)).map_or(0, |v| v.1));
        assert!(w.total_bytes < l.total_bytes);
        let mut end = 0;
        for (_, off, n) in w.regions() {
            assert!(off >= end && off % ALIGN == 0);
            end = off + n;
        }
        assert!(end <= w.total_bytes);
        assert_eq!(l.without_kv_of(&[]).total_bytes, l.total_bytes);
    }

    #[test]
    fn layout_rejects_bad_context() {
        let a = arch();
        assert_eq!(Layout::new(&a, 0, 32, &bf16, 132).unwrap_err(), PlanError::Context { ctx: 0, max: 4096 });
        assert!(Layout::new(&a, 4097, 32, &bf16, 132).is_err());
    }

    #[test]
    fn grids_and_values_resolve_for_the_machine_and_the_pass() {
        let a = arch();
        let l = Layout::new(&a, 4096, 32, &bf16, 132).unwrap();
        assert_eq!(l.grid(Grid::HeadSplits { heads: 4 }, 1), (4, 64, 1));
        assert_eq!(l.grid(Grid::Rows, 7), (7, 1, 1));
        assert_eq!(l.grid(Grid::HeadRowsZ { heads: 4 }, 7), (4, 1, 7));
        assert_eq!(l.grid(Grid::HeadRowsY { heads: 4 }, 7), (4, 7, 1));
        assert_eq!(l.grid(Grid::Elements { width: 1536 }, 512), (3072, 1, 1));
        assert_eq!(l.grid(Grid::Elements { width: 1 << 20 }, 512), (65535, 1, 1));
        assert_eq!(l.value(Arg::GridX(HEAD_GRID), 1), Some(l.grid(HEAD_GRID, 1).0 as i32));
        assert_eq!(l.kernel(&l_launch(&a, "norm_lm_head")), "norm_lm_head_bf16", "the instance for the head's type");
        assert_eq!(l.kernel(&l_launch(&a, "argmax_step")), "argmax_step", "one kernel for all types");
        assert_eq!(l.value(Arg::Ctx, 1), Some(4096));
        assert_eq!(l.value(Arg::Elements { width: 10 }, 7), Some(70));
        assert_eq!(l.value(Arg::Buf(Buf::X), 1), None);
    }

    #[test]
    fn schedule_lists_its_kernels_weights_and_buffers_once() {
        let s = arch().schedule;
        assert_eq!(s.kernels(), ["embed", "attn_decode", "norm_lm_head", "argmax_step", "rows_embed", "rows_norm"]);
        assert_eq!(s.weights(), [(Role::TokenEmbd, None), (Role::AttnNorm, Some(0)), (Role::AttnQ, Some(0))]);
        assert!(s.buffers().contains(&Buf::PQkv), "a GEMM's output is a buffer of the schedule");
    }

    /// Steps reading the matrices of `layers` (and a norm of layer 9, which never streams).
    fn steps(layers: &[&[u32]]) -> Vec<Vec<WeightRef>> {
        layers.iter().map(|ls| ls.iter().map(|&l| (Role::AttnQ, Some(l))).chain([(Role::AttnNorm, Some(9)), (Role::TokenEmbd, None)]).collect()).collect()
    }

    #[test]
    fn ring_uses_order_copies_and_waits() {
        // Layers 0..4 in order, two steps each; layer 0 resident, 1..3 streamed through 2 slots.
        let s = steps(&[&[], &[0], &[0], &[1], &[1], &[2], &[2], &[3], &[3], &[]]);
        let u = ring_uses(&s, &[1, 2, 3], 2).unwrap();
        assert_eq!(
            u,
            [
                RingUse { layer: 1, slot: 0, first: 3, last: 4, after: None },
                RingUse { layer: 2, slot: 1, first: 5, last: 6, after: None },
                RingUse { layer: 3, slot: 0, first: 7, last: 8, after: Some(4) },
            ]
        );
        // One slot: each copy waits for the previous layer's last read.
        let u = ring_uses(&s, &[1, 2, 3], 1).unwrap();
        assert_eq!(u.iter().map(|u| (u.slot, u.after)).collect::<Vec<_>>(), [(0, None), (0, Some(4)), (0, Some(6))]);
        assert_eq!(ring_uses(&s, &[], 0).unwrap(), []);
        assert!(matches!(ring_uses(&s, &[1], 0), Err(PlanError::Ring { layer: 1, .. })));
    }

    #[test]
    fn ring_uses_refuse_what_would_overwrite_a_slot_in_use() {
        // A step reading layers 1 and 2 together: fine with two slots, not with one.
        let s = steps(&[&[1], &[1, 2], &[2], &[3]]);
        assert!(ring_uses(&s, &[1, 2, 3], 2).is_ok());
        let e = ring_uses(&s, &[1, 2, 3], 1).unwrap_err();
        assert!(e.to_string().contains("layer 1 still holds slot 0 until step 1"), "{e}");
        // Layer 1 read again after layer 3 started: slot 0 would be overwritten under it.
        let s = steps(&[&[1], &[2], &[3], &[1]]);
        assert!(ring_uses(&s, &[1, 2, 3], 2).unwrap_err().to_string().contains("layer 1 still holds slot 0 until step 3"));
        // Ring order is use order; a streamed layer the pass never reads is refused.
        let s = steps(&[&[2], &[1]]);
        assert!(ring_uses(&s, &[1, 2], 2).unwrap_err().to_string().contains("not after layer 1"));
        assert!(ring_uses(&steps(&[&[1], &[2]]), &[1, 2, 5], 2).unwrap_err().to_string().contains("never reads it"));
        // Norms of a streamed layer do not count as reads.
        assert!(ring_uses(&steps(&[&[1]]), &[9], 2).is_err());
    }

    fn l_launch(a: &CudaArch, kernel: &str) -> Launch {
        a.schedule.decode.iter().find(|l| l.kernel == kernel).cloned().unwrap()
    }

    #[test]
    fn weight_types_pick_instances_grids_and_refuse_mixing() {
        let a = arch();
        // The head in f32: four bytes an element, so more threads share a row of 64.
        let f32_head = |w: WeightRef| if w == HEAD { Some(DType::F32) } else { bf16(w) };
        let l = Layout::new(&a, 64, 32, &f32_head, 132).unwrap();
        assert_eq!(l.kernel(&l_launch(&a, "norm_lm_head")), "norm_lm_head_f32");
        assert_eq!(l.grid(HEAD_GRID, 1), matvec_grid(64, 1000, 1, 4, 132, MATVEC_BLOCKS_PER_SM));
        // FP8 and MXFP4: 16 and 32 weights a vector, so fewer threads share a row.
        assert_eq!((matvec_group_threads(2048, weights_per_vec(DType::F8E4m3), 2), matvec_group_threads(11008, weights_per_vec(DType::Mxfp4), 1)), (32, 64));
        assert_eq!(l.get(Buf::PXn).unwrap().1, 32 * 64 * 4, "GEMM inputs sized for the widest type");
        // rows_norm writes q's GEMM input in q's type: a q of another type than rows_norm's is refused.
        let mut b = arch();
        if let Step::Kernel(k) = &mut b.schedule.prefill[1] {
            k.typed_by = Some(HEAD);
        }
        let e = Layout::new(&b, 64, 32, &f32_head, 132).unwrap_err();
        assert!(matches!(e, PlanError::MixedLaunch { kernel: "rows_norm", .. }), "{e}");
        // q in FP8: its GEMM reads it decoded to bf16 from PW (128 x 64 bf16), after rows_norm
        // wrote bf16 rows (rows_norm is typed by the embedding here, bf16: the same GEMM type).
        let fp8 = |w: WeightRef| if w.0 == Role::AttnQ { Some(DType::F8E4m3) } else { bf16(w) };
        let l = Layout::new(&a, 64, 32, &fp8, 132).unwrap();
        assert_eq!((l.get(Buf::PW).unwrap().1, l.get(Buf::PXn).unwrap().1), (128 * 64 * 2, 32 * 64 * 2));
        assert!(Layout::new(&a, 64, 32, &bf16, 132).unwrap().get(Buf::PW).is_none(), "no scratch without a quantized GEMM");
        let f16 = |w: WeightRef| if w.0 == Role::AttnQ { Some(DType::F16) } else { bf16(w) };
        assert!(matches!(Layout::new(&a, 64, 32, &f16, 132).unwrap_err(), PlanError::WeightType { role: Role::AttnQ, .. }), "no f16 instance");
        let none = |w: WeightRef| if w.0 == Role::AttnQ { None } else { bf16(w) };
        assert!(matches!(Layout::new(&a, 64, 32, &none, 132).unwrap_err(), PlanError::MissingWeight { role: Role::AttnQ, .. }));
    }

    /// What the runtime uploads and what planning counts for it agree, per storage type: MXFP4
    /// without a postscale gets one of bf16 ones, GGUF blocks are split, the rest pass as stored.
    #[test]
    fn device_bytes_and_device_len_agree() {
        let shape = [4u64, 64];
        let mx = |post| WeightLayout::of(DType::Mxfp4, &shape, post).unwrap().byte_len as usize;
        let cases: [(DType, usize); 5] = [(DType::Bf16, 512), (DType::Mxfp4, mx(false)), (DType::Mxfp4, mx(true)), (DType::Q8_0, 8 * 34), (DType::Q4_1, 8 * 20)];
        for (t, n) in cases {
            let stored: Vec<u8> = (0..n).map(|i| i as u8).collect();
            let dev = device_bytes(t, &shape, Cow::Borrowed(&stored[..])).unwrap();
            assert_eq!(dev.len() as u64, device_len(t, &shape, n as u64), "{t:?} of {n} bytes");
            assert_eq!(&dev[..16], &stored[if t == DType::Q8_0 { 2 } else if t == DType::Q4_1 { 4 } else { 0 }..][..16], "{t:?}: the first block's values lead");
        }
        // The added postscale: ones after the stored bytes, where the layout with one puts it.
        let bare: Vec<u8> = vec![7; mx(false)];
        let dev = device_bytes(DType::Mxfp4, &shape, Cow::Borrowed(&bare[..])).unwrap();
        assert_eq!((dev.len(), &dev[..bare.len()]), (mx(true), &bare[..]));
        let one = half::bf16::ONE.to_le_bytes();
        assert!(dev[dev.len() - 8..].chunks(2).all(|c| c == one), "four bf16 ones");
        // A stacked expert tensor [experts, rows, cols] is one matrix of experts * rows rows (the
        // MoE kernels index expert e's row r as e * rows + r): one postscale per such row.
        let stacked = [2u64, 4, 64];
        let bare = WeightLayout::of(DType::Mxfp4, &stacked, false).unwrap().byte_len as usize;
        let dev = device_bytes(DType::Mxfp4, &stacked, Cow::Owned(vec![7; bare])).unwrap();
        assert_eq!(dev.len() as u64, WeightLayout::of(DType::Mxfp4, &stacked, true).unwrap().byte_len);
        assert_eq!(dev.len() as u64, device_len(DType::Mxfp4, &stacked, bare as u64));
        assert!(dev[dev.len() - 16..].chunks(2).all(|c| c == one), "eight bf16 ones");
    }

    #[test]
    fn matvec_grid_caps_at_the_machine() {
        // bf16 rows of 2048: a warp per row, 8 rows a block.
        assert_eq!(matvec_group_threads(2048, 8, 1), 32);
        assert_eq!(matvec_grid(2048, 960, 1, 8, 132, MATVEC_BLOCKS_PER_SM), (120, 1, 1));
        assert_eq!(matvec_grid(2048, 128256, 1, 8, 132, MATVEC_BLOCKS_PER_SM), (132 * MATVEC_BLOCKS_PER_SM, 1, 1));
        assert_eq!(matvec_grid(2048, 1, 1, 8, 132, MATVEC_BLOCKS_PER_SM), (1, 1, 1));
        // Gate and up rows together: two warps an output.
        assert_eq!(matvec_group_threads(2048, 8, 2), 64);
        // Long rows share a row over more threads: fewer rows a block, more blocks.
        assert_eq!(matvec_group_threads(11008, 8, 1), 256);
        assert_eq!(matvec_group_threads(8192, 8, 1), 128);
        assert_eq!(matvec_group_threads(2048, 4, 1), 64);
        assert_eq!(matvec_group_threads(576, 8, 1), 32);
        assert_eq!(matvec_grid(11008, 300, 1, 8, 132, MATVEC_BLOCKS_PER_SM), (300, 1, 1));
        assert_eq!(matvec_grid(8192, 300, 1, 8, 132, MATVEC_BLOCKS_PER_SM), (150, 1, 1));
        assert_eq!(matvec_grid(2048, 1 << 30, 1, 8, 100_000, MATVEC_BLOCKS_PER_SM).0, MATVEC_MAX_BLOCKS);
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
