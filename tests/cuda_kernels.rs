//! Every CUDA kernel against the CPU reference ops (`thin_core::cpu`) on random inputs: one test
//! per CUDA-capable arch compiled in, the engine brought up on random bf16 weights.
//!
//! Each check writes random inputs into a kernel's buffers, runs that one kernel (or prefill GEMM)
//! outside the decode graph, reads the outputs back and compares them with the reference computed
//! on the host from the same inputs and weights. Metric: `max_rel` = max |gpu - cpu| over the
//! output / (max |cpu| + 1e-6); `max_abs` is reported too. On a GPU host:
//!
//!   cargo test --release --features cuda,smollm2-135m,llama3.2-1b,smollm3-3b,gemma3-270m,olmoe-1b-7b --test cuda_kernels -- --nocapture
//!
//! `THIN_KERNEL_REPORT=path` appends one JSON line per check to `path`. Without a CUDA driver the
//! tests print "skipped: no CUDA driver" and pass.
//!
//! Per arch: the kernel constants and RoPE tables; embed, norm_lm_head (logits and its per-block
//! argmax candidates), argmax_step (after norm_lm_head and on made-up candidates), attn_combine_rows
//! on made-up partials, rows_embed, rows_act; then for layer 0, the last layer and the first NoPE
//! layer: norm_qkv, attn_decode (cache row, attention output, block counter) at positions 0 and
//! 150, norm_gateup, the O and down projections as scheduled (`*_residual`, or `*_proj` and
//! `norm_residual` on sandwich archs), qk_rope_kv, attn_partial + attn_combine_rows, and
//! prefill's rows_norm, the seven GEMMs, qk_rope_kv and attn_partial + attn_combine_rows over 7
//! rows, and `norm_residual` over prefill rows where scheduled; on a mixture-of-experts arch
//! (OLMoE) moe_router and moe_topk (renormalised and not, a tie among the best), decode and over
//! 7 prefill rows, then moe_gateup and moe_down (decode) and prefill's grouped moe_group,
//! moe_gateup_grouped, moe_down_grouped and moe_combine (7 rows, two experts in every row, a
//! second run bit for bit) on random routes instead of the dense MLP's kernels and GEMMs; a
//! last check fails if any
//! kernel instance the module defines never ran. The decode forms of qk_rope_kv, attn_partial and
//! attn_combine_rows (over `Qkv` and the split partials) are launched by hand from the schedule's
//! prefill launches: the split merge is only reached that way. Each arch runs six times: bf16 weights,
//! then layer 0 and the embedding in f32 (every kernel instance of both types runs), then every
//! matrix in FP8 e4m3 with row scales, then every matrix in MXFP4 (layer 0 and the embedding with
//! a row postscale, the rest without), then every matrix in GGUF Q8_0 blocks, then in Q4_1
//! blocks: the quantized instances, and prefill's dequant before its GEMMs. Not covered:
//! the decode graph and the prefill pass as wholes (except in `*_stream_equals_all`: whole
//! prefill passes and decode graphs with layers streamed against every weight resident, bit for
//! bit; `THIN_STREAM_ARCHIVE=x.thin` adds a real archive of one of the archs).
#![cfg(feature = "cuda")]
#![cfg_attr(not(any(feature = "smollm2-135m", feature = "llama3.2-1b", feature = "smollm3-3b", feature = "gemma3-270m", feature = "olmoe-1b-7b")), allow(dead_code, unused_imports))]

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::sync::Mutex;

use thin_core::cpu::{self, AttnParams};
use thin_core::cuda::plan::{self, Arg, Buf, CudaArch, Gemm, Grid, Launch, RopeTable, Step};
use thin_core::cuda::runtime::CudaOptions;
use thin_core::cuda::runtime::{CudaEngine, CudaError, WeightSource};
use thin_core::dtype::DType;
use thin_core::engine::{Engine, WeightView};
use thin_core::role::Role;
use thin_core::weight_format::WeightLayout;

/// KV positions of the engine under test: the default `thin run`/`thin bench` cache, so the decode
/// attention runs with the grid it has there (64 splits).
const CTX: usize = 4096;
/// Prompt rows of the prefill checks.
const ROWS: usize = 7;
/// Positions of the attention checks: the first; 150 (5 decode splits of 32 rows, one cluster); 329 (11
/// splits: the span past 256 rows where H200 fidelity after a 128-token prompt degraded, see
/// README; two clusters); 2000 (63 splits of 32 rows, eight clusters).
const POSITIONS: [usize; 4] = [0, 150, 329, 2000];
/// f32 outputs of the thin kernels: f32 sums in another order, rsqrtf and __expf stay near 1e-6.
const TOL_F32: f32 = 1e-4;
/// cuBLAS GEMMs (f32 accumulation, tensor-core order unknown).
const TOL_GEMM: f32 = 1e-3;
/// bf16-rounded outputs: a result one f32 ulp off the reference may round to the neighbouring
/// bf16, at most 2^-7 of that element.
const TOL_BF16: f32 = 1.0 / 128.0;

/// One GPU at a time: the tests share the device, and their tables print whole.
static GPU: Mutex<()> = Mutex::new(());

/// What the reference needs beyond `CudaArch`, as the arch's generated CPU engine has it.
struct Ref {
    eps: f32,
    /// The embedding scale as applied to bf16 weights (HF rounds it to the weights' dtype).
    emb_scale: f32,
    /// ... and to f32 weights.
    emb_scale_f32: f32,
    attn_scale: f32,
    /// `gate = act(gate) * up`.
    act: fn(&mut [f32], &[f32]),
}

/// Llama-family constants: no embedding scale, attention scale 1/sqrt(head_dim), SwiGLU.
fn llama_ref(eps: f32, head_dim: usize) -> Ref {
    Ref { eps, emb_scale: 1.0, emb_scale_f32: 1.0, attn_scale: 1.0 / (head_dim as f32).sqrt(), act: cpu::swiglu }
}

// ---- Random numbers, bf16, bytes.

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// splitmix64.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(mix(seed))
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u32 << 24) as f32
    }
    /// Uniform in [-a, a).
    fn sym(&mut self, a: f32) -> f32 {
        a * (2.0 * self.unit() - 1.0)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn vec(&mut self, n: usize, a: f32) -> Vec<f32> {
        (0..n).map(|_| self.sym(a)).collect()
    }
}

/// f32 -> bf16 bits, round to nearest even (NaN stays NaN), as the kernels' `f32_to_bf16`.
fn to_bf16(f: f32) -> u16 {
    let u = f.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return ((u >> 16) | 0x40) as u16;
    }
    (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

fn from_bf16(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

fn round_bf16(f: f32) -> f32 {
    from_bf16(to_bf16(f))
}

/// `n` values of `f` as little-endian bytes, drawn on every core in chunks of 2^20 values, each
/// chunk from its own seed (the same bytes whatever the thread count).
fn random_bytes<const W: usize>(seed: u64, n: usize, f: impl Fn(&mut Rng) -> [u8; W] + Sync) -> Vec<u8> {
    let mut out = vec![0u8; n * W];
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
    let mut work: Vec<Vec<(usize, &mut [u8])>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, chunk) in out.chunks_mut(W << 20).enumerate() {
        work[i % threads].push((i, chunk));
    }
    std::thread::scope(|s| {
        for w in work {
            let f = &f;
            s.spawn(move || {
                for (i, chunk) in w {
                    let mut r = Rng::new(seed ^ mix(i as u64 + 1));
                    chunk.chunks_exact_mut(W).for_each(|v| v.copy_from_slice(&f(&mut r)));
                }
            });
        }
    });
    out
}

// ---- Random weights.

/// One layer as its decode attention launch has it: RoPE table (none: a NoPE layer) and window.
#[derive(Debug, Clone, Copy)]
struct LayerFacts {
    rope: Option<RopeTable>,
    window: Option<usize>,
}

/// What the schedule says of each layer, in order (one attn_decode launch a layer).
fn layer_facts(a: &CudaArch) -> Vec<LayerFacts> {
    a.schedule
        .decode
        .iter()
        .filter(|l| l.kernel == "attn_decode")
        .map(|l| LayerFacts {
            rope: match l.args[3] {
                Arg::Buf(Buf::Cos(t)) => Some(t),
                _ => None,
            },
            window: match l.args[9] {
                Arg::I32(w) if w > 0 => Some(w as usize),
                _ => None,
            },
        })
        .collect()
}

/// Whether the schedule reads `role` of some layer (or, per-layer `false`, the global one).
fn reads(a: &CudaArch, role: Role) -> bool {
    a.schedule.weights().iter().any(|w| w.0 == role)
}

/// GGUF blocks of `block_bytes` per 32 values, rows of `cols`, made by the codec's `quantize_row`.
fn gguf_blocks(x: &[f32], cols: usize, block_bytes: usize, quantize_row: fn(&[f32], &mut [u8]) -> Result<(), thin_core::codecs::CodecError>) -> Vec<u8> {
    let row_bytes = cols / 32 * block_bytes;
    let mut blocks = vec![0u8; x.len() / cols * row_bytes];
    for (xr, br) in x.chunks(cols).zip(blocks.chunks_mut(row_bytes)) {
        quantize_row(xr, br).expect("quantize a row of GGUF blocks");
    }
    blocks
}

/// Whether the arch normalises the whole Q and K projections (a kernel of its own) rather than per head.
fn whole_qk_norm(a: &CudaArch) -> bool {
    a.schedule.decode.iter().any(|l| l.kernel == "qk_norm_whole")
}

/// Every kernel the module source defines (`extern "C" __global__ void [attributes] name(`).
fn defined_kernels(src: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, m) in src.match_indices("extern \"C\" __global__ void ") {
        let mut rest = &src[i + m.len()..];
        if let Some(r) = rest.strip_prefix("__launch_bounds__(") {
            rest = r[r.find(')').expect("launch bounds close") + 1..].trim_start();
        }
        rest = rest.strip_prefix("ATTN_CLUSTER_DIMS ").unwrap_or(rest);
        out.push(rest[..rest.find('(').expect("kernel parameters")].trim().to_string());
    }
    out
}

/// A model of `CudaArch`'s shapes with random weights: matrices uniform in ±1/sqrt(in)
/// (activations stay O(1)), f32 norm vectors 1 ± 0.1. Three instances of each per-layer tensor:
/// layer 0's, the last layer's, and one all other layers share (the engine uploads every layer).
/// Matrices are bf16; or (`Mix::F32Layer0`) f32 for layer 0 and the embedding and bf16 for the
/// rest: one archive of two storage types, each launch taking its weights' kernel instance; or
/// (`Mix::Fp8`) every matrix FP8 e4m3 with its f32 row scales, quantized by the CPU codec
/// (thin_core::codecs::fp8) and laid out as the archive stores them (weight_format.rs).
/// The storage types of a random model's matrices (norms are f32 in all).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Mix {
    Bf16,
    F32Layer0,
    Fp8,
    /// Every matrix MXFP4; layer 0's and the embedding with a fitted bf16 row postscale, the
    /// others without (the runtime adds ones).
    Mxfp4,
    /// Every matrix GGUF Q8_0 blocks, then Q4_1 blocks (the runtime splits them at upload).
    Q8_0,
    Q4_1,
}

struct RandomWeights {
    last: u32,
    /// Experts of a MoE arch (0: dense); its stacked expert tensors are matrices of
    /// `experts * rows` rows, shaped `[experts, rows, cols]`.
    experts: usize,
    /// Rows and columns of each role's matrix (the same in every layer).
    rows: BTreeMap<Role, usize>,
    cols: BTreeMap<Role, usize>,
    tensors: BTreeMap<(Role, u8), (DType, Vec<u8>)>,
}

impl RandomWeights {
    fn new(a: &CudaArch, seed: u64, types: Mix) -> RandomWeights {
        let (h, q, kv) = ((a.dims.hidden_size as usize), (a.dims.num_heads as usize) * (a.dims.head_dim as usize), (a.dims.num_kv_heads as usize) * (a.dims.head_dim as usize));
        let mut shapes = vec![(Role::TokenEmbd, (a.dims.vocab_size as usize), h), (Role::OutputNorm, 1, h)];
        if reads(a, Role::LmHead) {
            shapes.push((Role::LmHead, (a.dims.vocab_size as usize), h));
        }
        let mut per_layer = vec![
            (Role::AttnNorm, 1, h),
            (Role::AttnQ, q, h),
            (Role::AttnK, kv, h),
            (Role::AttnV, kv, h),
            (Role::AttnO, h, q),
            (Role::FfnNorm, 1, h),
        ];
        let (ffn, experts) = (a.dims.intermediate_size as usize, a.dims.num_experts as usize);
        if reads(a, Role::MoeRouter) {
            per_layer.extend([(Role::MoeRouter, experts, h), (Role::MoeGate, experts * ffn, h), (Role::MoeUp, experts * ffn, h), (Role::MoeDown, experts * h, ffn)]);
        } else {
            per_layer.extend([(Role::FfnGate, ffn, h), (Role::FfnUp, ffn, h), (Role::FfnDown, h, ffn)]);
        }
        if reads(a, Role::AttnQNorm) {
            // Per head (one head's width) or over the whole projection (the qk_norm_whole kernel).
            let (qn, kn) = if whole_qk_norm(a) { (q, kv) } else { ((a.dims.head_dim as usize), (a.dims.head_dim as usize)) };
            per_layer.extend([(Role::AttnQNorm, 1, qn), (Role::AttnKNorm, 1, kn)]);
        }
        if reads(a, Role::AttnPostNorm) {
            per_layer.extend([(Role::AttnPostNorm, 1, h), (Role::FfnPostNorm, 1, h)]);
        }
        let mut tensors = BTreeMap::new();
        let rows: BTreeMap<Role, usize> = shapes.iter().chain(&per_layer).map(|&(r, n, _)| (r, n)).collect();
        let cols: BTreeMap<Role, usize> = shapes.iter().chain(&per_layer).map(|&(r, _, c)| (r, c)).collect();
        let all = shapes.iter().map(|s| (*s, 0u8)).chain(per_layer.iter().flat_map(|s| (0..3u8).map(move |v| (*s, v))));
        for ((role, rows, cols), v) in all {
            let seed = seed ^ mix(((role as u64) << 8) | v as u64);
            let amp = 1.0 / (cols as f32).sqrt();
            let t = match types {
                _ if role.is_norm() => DType::F32,
                Mix::F32Layer0 if v == 0 => DType::F32,
                Mix::Fp8 => DType::F8E4m3,
                Mix::Mxfp4 => DType::Mxfp4,
                Mix::Q8_0 => DType::Q8_0,
                Mix::Q4_1 => DType::Q4_1,
                _ => DType::Bf16,
            };
            // The matrix's values before quantization (the f32 ones' bytes).
            let weights = || -> Vec<f32> { random_bytes(seed, rows * cols, |r| r.sym(amp).to_le_bytes()).chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect() };
            let bytes = match (role.is_norm(), t) {
                (true, _) => random_bytes(seed, rows * cols, |r| (1.0 + r.sym(0.1)).to_le_bytes()),
                (false, DType::F32) => random_bytes(seed, rows * cols, |r| r.sym(amp).to_le_bytes()),
                (false, DType::F8E4m3) => {
                    let (mut values, mut scales) = (vec![0u8; rows * cols], vec![0f32; rows]);
                    thin_core::codecs::fp8::quantize(&weights(), cols, &mut values, &mut scales).expect("fp8 quantize");
                    let scales: Vec<u8> = scales.iter().flat_map(|f| f.to_le_bytes()).collect();
                    WeightLayout::of(t, &[rows as u64, cols as u64], false).expect("fp8 layout").assemble(&values, &[&scales])
                }
                (false, DType::Mxfp4) => {
                    let (mut values, mut scales) = (vec![0u8; rows * cols / 2], vec![0u8; rows * cols / 32]);
                    let layout = |post| WeightLayout::of(t, &[rows as u64, cols as u64], post).expect("mxfp4 layout");
                    if v == 0 {
                        let mut post = vec![half::bf16::ONE; rows];
                        thin_core::codecs::mxfp4::quantize_with_postscale(&weights(), cols, &mut values, &mut scales, &mut post).expect("mxfp4 quantize");
                        let post: Vec<u8> = post.iter().flat_map(|p| p.to_le_bytes()).collect();
                        layout(true).assemble(&values, &[&scales, &post])
                    } else {
                        thin_core::codecs::mxfp4::quantize(&weights(), cols, &mut values, &mut scales).expect("mxfp4 quantize");
                        layout(false).assemble(&values, &[&scales])
                    }
                }
                (false, DType::Q8_0) => gguf_blocks(&weights(), cols, thin_core::codecs::q8_0::BLOCK_BYTES, thin_core::codecs::q8_0::quantize_row),
                (false, DType::Q4_1) => gguf_blocks(&weights(), cols, thin_core::codecs::q4_1::BLOCK_BYTES, thin_core::codecs::q4_1::quantize_row),
                (false, _) => random_bytes(seed, rows * cols, |r| to_bf16(r.sym(amp)).to_le_bytes()),
            };
            tensors.insert((role, v), (t, bytes));
        }
        RandomWeights { last: layer_facts(a).len() as u32 - 1, experts, rows, cols, tensors }
    }

    fn raw(&self, role: Role, layer: Option<u32>) -> Option<(DType, &[u8])> {
        let v = match layer {
            _ if role.is_per_layer() != layer.is_some() => return None,
            None | Some(0) => 0,
            Some(l) if l == self.last => 1,
            Some(_) => 2,
        };
        self.tensors.get(&(role, v)).map(|(t, b)| (*t, &b[..]))
    }

    /// A tensor's values as f32 (bf16 widens exactly; FP8 as the CPU codec decodes it, `e4m3 * scale`).
    fn f32(&self, role: Role, layer: Option<u32>) -> Vec<f32> {
        self.rows_f32(role, layer, 0, self.rows[&role])
    }

    /// Rows `r0..r1` of a tensor's matrix as f32.
    fn rows_f32(&self, role: Role, layer: Option<u32>, r0: usize, r1: usize) -> Vec<f32> {
        let (rows, cols) = (self.rows[&role], self.cols[&role]);
        let floats = |b: &[u8]| b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect::<Vec<f32>>();
        match self.raw(role, layer).unwrap_or_else(|| panic!("{role:?} layer {layer:?} is not in the random model")) {
            (DType::F32, b) => floats(&b[r0 * cols * 4..r1 * cols * 4]),
            (DType::F8E4m3, b) => {
                let off = (rows * cols).next_multiple_of(64);
                let scales = floats(&b[off..off + 4 * rows]);
                WeightView::F8E4m3 { values: &b[..rows * cols], scales: &scales, cols }.slice(r0 * cols, r1 * cols).to_f32_vec()
            }
            (DType::Q8_0, b) => WeightView::Q8_0 { blocks: b, cols }.slice(r0 * cols, r1 * cols).to_f32_vec(),
            (DType::Q4_1, b) => WeightView::Q4_1 { blocks: b, cols }.slice(r0 * cols, r1 * cols).to_f32_vec(),
            (DType::Mxfp4, b) => {
                let e = (rows * cols / 2).next_multiple_of(64);
                let p = (e + rows * cols / 32).next_multiple_of(64);
                let post: Vec<half::bf16> = b.get(p..p + 2 * rows).map(|s| s.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]])).collect()).unwrap_or_default();
                let postscale = (!post.is_empty()).then_some(&post[..]);
                WeightView::Mxfp4 { values: &b[..rows * cols / 2], scales: &b[e..e + rows * cols / 32], postscale, cols }.slice(r0 * cols, r1 * cols).to_f32_vec()
            }
            (_, b) => b[r0 * cols * 2..r1 * cols * 2].chunks_exact(2).map(|c| from_bf16(u16::from_le_bytes([c[0], c[1]]))).collect(),
        }
    }

    /// Expert `e`'s matrix of a stacked expert tensor as f32.
    fn expert_f32(&self, role: Role, layer: Option<u32>, e: usize) -> Vec<f32> {
        let per = self.rows[&role] / self.experts;
        self.rows_f32(role, layer, e * per, (e + 1) * per)
    }
}

impl WeightSource for RandomWeights {
    fn dtype(&self, role: Role, layer: Option<u32>) -> Option<DType> {
        self.raw(role, layer).map(|(t, _)| t)
    }
    fn bytes(&self, role: Role, layer: Option<u32>) -> Result<Cow<'_, [u8]>, String> {
        self.raw(role, layer).map(|(_, b)| Cow::Borrowed(b)).ok_or_else(|| format!("{role:?} layer {layer:?} is not in the random model"))
    }
    fn shape(&self, role: Role, layer: Option<u32>) -> Option<Vec<u64>> {
        let (rows, cols) = (self.rows[&role] as u64, self.cols[&role] as u64);
        self.raw(role, layer).map(|_| match role {
            // Stacked as the converter stores them: [experts, rows, cols].
            Role::MoeGate | Role::MoeUp | Role::MoeDown => vec![self.experts as u64, rows / self.experts as u64, cols],
            _ => vec![rows, cols],
        })
    }
}

// ---- Checks.

struct Check {
    kernel: String,
    layer: Option<usize>,
    case: String,
    max_abs: f32,
    max_rel: f32,
    tol: f32,
    pass: bool,
}

/// max |got - want| and that over max |want|; NaN where the reference has none counts as infinite.
fn compare(got: &[f32], want: &[f32]) -> (f32, f32) {
    let mut max_abs = if got.len() == want.len() { 0.0f32 } else { f32::INFINITY };
    for (g, w) in got.iter().zip(want) {
        let d = (g - w).abs();
        let d = if d.is_nan() && !(g.is_nan() && w.is_nan()) {
            f32::INFINITY
        } else if d.is_nan() {
            0.0
        } else {
            d
        };
        max_abs = max_abs.max(d);
    }
    let scale = want.iter().fold(0.0f32, |m, w| m.max(w.abs()));
    (max_abs, max_abs / (scale + 1e-6))
}

fn report(arch: &str, checks: &[Check]) {
    println!("{arch}: {} kernel checks against the CPU reference", checks.len());
    println!("{:<28} {:<40} {:>5} {:>10} {:>10} {:>9}  result", "kernel", "case", "layer", "max_abs", "max_rel", "tol");
    for c in checks {
        let layer = c.layer.map_or("-".to_string(), |l| l.to_string());
        let result = if c.pass { "PASS" } else { "FAIL" };
        println!("{:<28} {:<40} {layer:>5} {:>10.3e} {:>10.3e} {:>9.2e}  {result}", c.kernel, c.case, c.max_abs, c.max_rel, c.tol);
    }
    if let Some(path) = std::env::var_os("THIN_KERNEL_REPORT") {
        let mut out = String::new();
        for c in checks {
            let j = serde_json::json!({"arch": arch, "kernel": c.kernel, "case": c.case, "layer": c.layer, "max_abs": c.max_abs, "max_rel": c.max_rel, "tol": c.tol, "pass": c.pass});
            out.push_str(&format!("{j}\n"));
        }
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&path).unwrap_or_else(|e| panic!("opening {path:?}: {e}"));
        f.write_all(out.as_bytes()).unwrap_or_else(|e| panic!("writing {path:?}: {e}"));
    }
    let failed: Vec<String> =
        checks.iter().filter(|c| !c.pass).map(|c| format!("  {} [{}] layer {:?}: max_rel {:.3e} (max_abs {:.3e}) > tol {:.2e}", c.kernel, c.case, c.layer, c.max_rel, c.max_abs, c.tol)).collect();
    assert!(failed.is_empty(), "{arch}: {} of {} kernel checks failed:\n{}", failed.len(), checks.len(), failed.join("\n"));
}

/// `constexpr int|float NAME = VALUE;` lines of a rendered kernel source.
fn kernel_consts(src: &str) -> BTreeMap<&str, f64> {
    src.lines()
        .filter_map(|l| {
            let rest = l.trim().strip_prefix("constexpr ")?;
            let (name, value) = rest.split_once(' ')?.1.split_once(" = ")?;
            Some((name, value.strip_suffix(';')?.trim_end_matches('f').parse().ok()?))
        })
        .collect()
}

fn matvec(w: &[f32], x: &[f32]) -> Vec<f32> {
    let mut out = vec![0.0; w.len() / x.len()];
    cpu::matvec(WeightView::F32(w), x, &mut out);
    out
}

/// The layer a launch belongs to (its weights' or KV cache's), `None` for the global ones.
fn layer_of(l: &Launch) -> Option<usize> {
    l.args.iter().find_map(|a| match a {
        Arg::Weight(_, Some(x)) => Some(*x as usize),
        Arg::Buf(Buf::KCache(x)) => Some(*x),
        _ => None,
    })
}

/// The sampler's argmax over made-up candidates (value, index): -inf everywhere else.
fn argmax_of(vocab: usize, cands: &[(f32, i32)]) -> u32 {
    let mut logits = vec![f32::NEG_INFINITY; vocab];
    for &(v, i) in cands.iter().filter(|c| (0..vocab as i32).contains(&c.1)) {
        logits[i as usize] = v;
    }
    thin_core::sampler::argmax(&logits)
}

/// The first `kernel` launch of `list` (of layer `layer`, if given).
fn find(list: &[Launch], kernel: &str, layer: Option<usize>) -> Launch {
    list.iter().find(|l| l.kernel == kernel && (layer.is_none() || layer_of(l) == layer)).cloned().unwrap_or_else(|| panic!("no {kernel} launch for layer {layer:?}"))
}

/// An attention launch with its `window` argument (number `idx`) set: 0 = full attention.
fn with_window(la: &Launch, idx: usize, window: Option<usize>) -> Launch {
    let mut la = la.clone();
    assert!(matches!(la.args[idx], Arg::I32(_)), "{}: argument {idx} is not the window", la.kernel);
    la.args[idx] = Arg::I32(window.map_or(0, |w| w as i32));
    la
}

// ---- The checks of one arch.

struct T<'a> {
    a: &'a CudaArch,
    r: &'a Ref,
    w: &'a RandomWeights,
    e: &'a CudaEngine,
    emb: Vec<f32>,
    /// The untied LM head (tied: `emb`).
    head: Option<Vec<f32>>,
    tables: BTreeMap<RopeTable, (Vec<f32>, Vec<f32>)>,
    layers: Vec<LayerFacts>,
    fused: Vec<Launch>,
    /// The decode forms of prefill's attention pieces (see the module doc).
    unfused: Vec<Launch>,
    prefill: Vec<Launch>,
    gemms: Vec<Gemm>,
    rng: Rng,
    checks: Vec<Check>,
    /// Kernel instances that ran (`norm_qkv_bf16`).
    ran: BTreeSet<String>,
    h: usize,
    qd: usize,
    kvd: usize,
    hd: usize,
    ffn: usize,
    /// A mixture-of-experts MLP (the moe_* kernels): its experts and top k; (0, 0) dense.
    experts: usize,
    top_k: usize,
}

impl<'a> T<'a> {
    fn new(a: &'a CudaArch, r: &'a Ref, w: &'a RandomWeights, e: &'a CudaEngine, seed: u64) -> T<'a> {
        let splits = e.layout().splits as i32;
        let fused = e.launches().to_vec();
        let layers = layer_facts(a);
        let (mut prefill, mut gemms) = (Vec::new(), Vec::new());
        for s in &a.schedule.prefill {
            match s {
                Step::Kernel(l) => prefill.push(l.clone()),
                Step::Gemm(g) => gemms.push(g.clone()),
            }
        }
        // Prefill's attention pieces over the decode buffers: one query row (Qkv), the context in
        // splits of ATTN_CHUNK rows (Part), merged from `splits` partials (into PAtt, bf16).
        let unfused = prefill
            .iter()
            .filter_map(|l| {
                let mut d = l.clone();
                match l.kernel {
                    "qk_rope_kv" => d.args[0] = Arg::Buf(Buf::Qkv),
                    "attn_partial" => {
                        d.grid = Grid::HeadSplits { heads: (a.dims.num_heads as usize) };
                        (d.args[0], d.args[5], d.args[6]) = (Arg::Buf(Buf::Qkv), Arg::I32(plan::ATTN_CHUNK as i32), Arg::Buf(Buf::Part));
                    }
                    "attn_combine_rows" => (d.args[0], d.args[1]) = (Arg::Buf(Buf::Part), Arg::I32(splits)),
                    _ => return None,
                }
                Some(d)
            })
            .collect();
        let mut tables = BTreeMap::new();
        for (t, inv) in [(RopeTable::Global, &a.inv_freq_global), (RopeTable::Local, &a.inv_freq_local)] {
            if layers.iter().any(|l| l.rope == Some(t)) {
                tables.insert(t, cpu::rope_tables(inv, CTX));
            }
        }
        let (qd, kvd) = ((a.dims.num_heads as usize) * (a.dims.head_dim as usize), (a.dims.num_kv_heads as usize) * (a.dims.head_dim as usize));
        T {
            a,
            r,
            w,
            e,
            emb: w.f32(Role::TokenEmbd, None),
            head: reads(a, Role::LmHead).then(|| w.f32(Role::LmHead, None)),
            tables,
            layers,
            fused,
            unfused,
            prefill,
            gemms,
            rng: Rng::new(seed),
            checks: Vec::new(),
            ran: BTreeSet::new(),
            h: (a.dims.hidden_size as usize),
            qd,
            kvd,
            hd: (a.dims.head_dim as usize),
            ffn: (a.dims.intermediate_size as usize),
            experts: a.dims.num_experts as usize,
            top_k: a.dims.top_k as usize,
        }
    }

    fn write(&self, b: Buf, bytes: &[u8]) {
        self.e.write_buf(b, bytes).unwrap_or_else(|e| panic!("{}: writing {b:?}: {e}", self.a.arch))
    }
    fn put(&self, b: Buf, v: &[f32]) {
        self.write(b, &v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())
    }
    fn put_bf(&self, b: Buf, v: &[u16]) {
        self.write(b, &v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())
    }
    fn put_i32(&self, b: Buf, v: &[i32]) {
        self.write(b, &v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())
    }
    fn read(&self, b: Buf) -> Vec<u8> {
        self.e.read_buf(b).unwrap_or_else(|e| panic!("{}: reading {b:?}: {e}", self.a.arch))
    }
    fn get(&self, b: Buf) -> Vec<f32> {
        self.read(b).chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }
    fn get_bf(&self, b: Buf) -> Vec<f32> {
        self.read(b).chunks_exact(2).map(|c| from_bf16(u16::from_le_bytes([c[0], c[1]]))).collect()
    }
    fn get_i32(&self, b: Buf) -> Vec<i32> {
        self.read(b).chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }
    /// The storage type of a launch's weights (the instance it runs; GEMM inputs it writes are in it).
    fn ty(&self, la: &Launch) -> DType {
        la.typed_by.and_then(|w| self.e.layout().type_of(w)).expect("a typed launch")
    }
    /// A buffer of GEMM inputs, read in type `t`.
    fn get_as(&self, b: Buf, t: DType) -> Vec<f32> {
        if t == DType::F32 { self.get(b) } else { self.get_bf(b) }
    }
    /// `n` random values in ±a that type `t` holds exactly, written to `b` in `t`.
    fn put_rand_as(&mut self, b: Buf, n: usize, a: f32, t: DType) -> Vec<f32> {
        if t == DType::F32 {
            let v = self.rand(n, a);
            self.put(b, &v);
            v
        } else {
            let (bits, v) = self.rand_bf(n, a);
            self.put_bf(b, &bits);
            v
        }
    }
    /// A reference value as a kernel writing type `t` stores it, and the tolerance that leaves.
    fn round_as(x: f32, t: DType) -> f32 {
        if t == DType::F32 { x } else { round_bf16(x) }
    }
    fn tol_as(t: DType) -> f32 {
        if t == DType::F32 { TOL_F32 } else { TOL_BF16 }
    }

    /// Run one launch alone over `rows` rows (decode launches: 1) and wait for it.
    fn run(&mut self, la: &Launch, rows: usize) {
        self.ran.insert(self.e.layout().kernel(la));
        self.e.run_step(&Step::Kernel(la.clone()), rows).unwrap_or_else(|e| panic!("{}: running {}: {e}", self.a.arch, la.kernel))
    }
    fn rand(&mut self, n: usize, a: f32) -> Vec<f32> {
        self.rng.vec(n, a)
    }
    /// `n` random bf16 values in ±a: the bits and their values.
    fn rand_bf(&mut self, n: usize, a: f32) -> (Vec<u16>, Vec<f32>) {
        let bits: Vec<u16> = (0..n).map(|_| to_bf16(self.rng.sym(a))).collect();
        let vals = bits.iter().map(|&b| from_bf16(b)).collect();
        (bits, vals)
    }
    /// `rows` q | k | v rows; q larger, so that softmax has a clear peak.
    fn rand_qkv(&mut self, rows: usize) -> Vec<f32> {
        let mut v = Vec::new();
        for _ in 0..rows {
            v.extend(self.rand(self.qd, 3.0));
            v.extend(self.rand(2 * self.kvd, 1.0));
        }
        v
    }
    fn wt(&self, role: Role, l: usize) -> Vec<f32> {
        self.w.f32(role, Some(l as u32))
    }
    fn rms(&self, x: &[f32], g: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0; x.len()];
        cpu::rms_norm(x, g, self.r.eps, &mut out);
        out
    }
    fn check(&mut self, kernel: &str, layer: Option<usize>, case: impl Into<String>, got: &[f32], want: &[f32], tol: f32) {
        let (max_abs, max_rel) = compare(got, want);
        self.checks.push(Check { kernel: kernel.into(), layer, case: case.into(), max_abs, max_rel, tol, pass: max_rel <= tol });
    }

    /// The kernels were rendered with this arch's shapes and the reference's constants.
    /// The embedding scale the kernels apply to this model's embedding type.
    fn emb_scale(&self) -> f32 {
        // The bf16 instance rounds the scale as HF does; f32 and the quantized types (whose oracle is the CPU engine) keep it exact.
        if self.w.dtype(Role::TokenEmbd, None) == Some(DType::Bf16) { self.r.emb_scale } else { self.r.emb_scale_f32 }
    }

    fn constants(&mut self) {
        let src = self.a.kernels;
        let mut k = kernel_consts(src);
        // EMB_SCALE is in each weight type's traits block.
        let traits = |t: &str| {
            let i = src.find(&format!("namespace w_{t} {{")).unwrap_or_else(|| panic!("no traits block for {t}"));
            kernel_consts(&src[i..i + src[i..].find("}  // namespace").expect("namespace end")])
        };
        k.insert("EMB_SCALE_F32", traits("f32")["EMB_SCALE"]);
        k.insert("EMB_SCALE", traits("bf16")["EMB_SCALE"]);
        let a = self.a;
        let mut want = vec![
            ("VOCAB", (a.dims.vocab_size as usize) as f64),
            ("HIDDEN", (a.dims.hidden_size as usize) as f64),
            ("HEADS", (a.dims.num_heads as usize) as f64),
            ("KV_HEADS", (a.dims.num_kv_heads as usize) as f64),
            ("HEAD_DIM", (a.dims.head_dim as usize) as f64),
            ("FFN", (a.dims.intermediate_size as usize) as f64),
            ("EPS", self.r.eps as f64),
            ("EMB_SCALE", self.r.emb_scale as f64),
            ("EMB_SCALE_F32", self.r.emb_scale_f32 as f64),
            ("ATTN_SCALE", self.r.attn_scale as f64),
            ("ATTN_CHUNK", plan::ATTN_CHUNK as f64),
            ("MATVEC_WARPS", plan::MATVEC_WARPS as f64),
            ("ATTN_WARPS", plan::ATTN_WARPS as f64),
        ];
        if self.experts > 0 {
            // The grouped prefill kernels' tile, which the plan's grid (moe_tile) assumes.
            want.extend([("MOE_TILE_ROWS", plan::MOE_TILE_ROWS as f64), ("MOE_STAGE_FLOATS", (plan::MOE_STAGE_BYTES / 4) as f64)]);
        }
        let (mut worst, mut bad) = (0.0f32, Vec::new());
        for (name, v) in want {
            let got = k.get(name).copied().unwrap_or(f64::NAN);
            let rel = ((got - v) / v).abs() as f32;
            if rel.is_nan() || rel > 1e-6 {
                bad.push(format!("{name}={got} (want {v})"));
            }
            worst = worst.max(if rel.is_nan() { f32::INFINITY } else { rel });
        }
        let case = if bad.is_empty() { "decode.cu vs arch".to_string() } else { bad.join(", ") };
        self.checks.push(Check { kernel: "constants".into(), layer: None, case, max_abs: worst, max_rel: worst, tol: 1e-6, pass: bad.is_empty() });
    }

    /// The RoPE tables the engine uploaded are the CPU reference's.
    fn rope_tables(&mut self) {
        for t in self.tables.keys().copied().collect::<Vec<_>>() {
            let got = [self.get(Buf::Cos(t)), self.get(Buf::Sin(t))].concat();
            let (c, s) = &self.tables[&t];
            let want = [&c[..], &s[..]].concat();
            self.check("rope_table upload", None, format!("{t:?}"), &got, &want, 0.0);
        }
    }

    fn embed(&mut self) {
        let la = find(&self.fused, "embed", None);
        for tok in [self.rng.below(self.a.dims.vocab_size as usize), (self.a.dims.vocab_size as usize) - 1] {
            self.put_i32(Buf::Tok, &[tok as i32]);
            let poison = self.rand(self.h, 1.0);
            self.put(Buf::X, &poison);
            self.run(&la, 1);
            let mut want = vec![0.0; self.h];
            cpu::embedding(WeightView::F32(&self.emb), tok, self.h, self.emb_scale(), &mut want);
            let got = self.get(Buf::X);
            self.check("embed", None, format!("tok={tok}"), &got[..self.h], &want, TOL_F32);
        }
    }

    /// norm_lm_head: the logits, and each block's best (logit, index) in ArgPart; then the step's
    /// argmax_step over those candidates.
    fn norm_lm_head(&mut self) {
        let la = find(&self.fused, "norm_lm_head", None);
        let vocab = self.a.dims.vocab_size as usize;
        let x = self.rand(self.h, 2.0);
        self.put(Buf::X, &x);
        self.run(&la, 1);
        let xn = self.rms(&x, &self.w.f32(Role::OutputNorm, None));
        let want = matvec(self.head.as_deref().unwrap_or(&self.emb), &xn);
        let logits = self.get(Buf::Logits)[..vocab].to_vec();
        self.check("norm_lm_head", None, "logits", &logits, &want, TOL_F32);
        // Every candidate is a logit the kernel wrote, at its index (or none: -inf, i32::MAX), and
        // the best of them is the argmax of the logits (of the GPU's: near-ties stay consistent).
        let blocks = self.e.layout().grid(la.grid, 1).0 as usize;
        let cands: Vec<(f32, i32)> = self.get(Buf::ArgPart).chunks_exact(2).take(blocks).map(|c| (c[0], c[1].to_bits() as i32)).collect();
        let valid = |&(v, i): &(f32, i32)| if i == i32::MAX { v == f32::NEG_INFINITY } else { (0..vocab as i32).contains(&i) && v.to_bits() == logits[i as usize].to_bits() };
        let bad = cands.iter().filter(|c| !valid(c)).count();
        let best = thin_core::sampler::argmax(&logits);
        self.check("norm_lm_head", None, format!("{blocks} argmax candidates: invalid, best"), &[bad as f32, argmax_of(vocab, &cands) as f32], &[0.0, best as f32], 0.0);
        let am = find(&self.fused, "argmax_step", None);
        let pos = 1 + self.rng.below(CTX - 2) as i32;
        self.put_i32(Buf::Tok, &[-1]);
        self.put_i32(Buf::Pos, &[pos]);
        self.run(&am, 1);
        let got = [self.get_i32(Buf::Tok)[0] as f32, self.get_i32(Buf::Pos)[0] as f32, self.e.layout().value(am.args[1], 1).map_or(-1.0, |n| n as f32)];
        self.check("argmax_step", None, "after norm_lm_head: tok, pos, blocks", &got, &[best as f32, (pos + 1) as f32, blocks as f32], 0.0);
    }

    /// argmax_step on made-up candidates (distinct random indices; entries past the count are
    /// garbage it must not read): tok = the best (lowest index on ties, NaN never wins), pos += 1. Exact.
    fn argmax_step(&mut self) {
        let la = find(&self.fused, "argmax_step", None);
        let Some(blocks) = self.e.layout().value(la.args[1], 1) else { panic!("argmax_step: argument 1 is not the candidate count") };
        let (vocab, max) = ((self.a.dims.vocab_size as usize), plan::MATVEC_MAX_BLOCKS as usize);
        assert!(blocks >= 3 && max < vocab);
        let mut ids: Vec<i32> = (0..vocab as i32).collect();
        for case in ["random", "tie (lower index later) + NaN", "MATVEC_MAX_BLOCKS, best last"] {
            let n = if case.starts_with("MATVEC") { max } else { blocks as usize };
            for i in 0..n {
                ids.swap(i, i + self.rng.below(vocab - i));
            }
            let mut vals = self.rand(n, 10.0);
            if case.starts_with("MATVEC") {
                vals[n - 1] = 11.0;
            } else if case.starts_with("tie") {
                (vals[n / 2], vals[n - 1], vals[0]) = (11.0, 11.0, f32::NAN);
                if ids[n - 1] > ids[n / 2] {
                    ids.swap(n / 2, n - 1);
                }
            }
            let mut arg = Vec::with_capacity(2 * max);
            for b in 0..max {
                let (v, i) = if b < n { (vals[b], ids[b]) } else { (1e30, b as i32) };
                arg.extend([v, f32::from_bits(i as u32)]);
            }
            let mut la = la.clone();
            la.args[1] = Arg::I32(n as i32);
            let pos = 1 + self.rng.below(CTX - 2) as i32;
            self.put(Buf::ArgPart, &arg);
            self.put_i32(Buf::Tok, &[-1]);
            self.put_i32(Buf::Pos, &[pos]);
            self.run(&la, 1);
            let cands: Vec<(f32, i32)> = vals.iter().copied().zip(ids.iter().copied()).collect();
            let got = [self.get_i32(Buf::Tok)[0] as f32, self.get_i32(Buf::Pos)[0] as f32];
            self.check("argmax_step", None, format!("{n} candidates, {case}: tok, pos"), &got, &[argmax_of(vocab, &cands) as f32, (pos + 1) as f32], 0.0);
        }
    }

    /// The split merge on made-up partials: empty splits (l = 0, stale acc) anywhere, one kept.
    fn attn_combine(&mut self) {
        let la = find(&self.unfused, "attn_combine_rows", None);
        let (hd, splits) = (self.hd, self.e.layout().splits);
        let st = hd + 2;
        let mut part = vec![0.0f32; (self.a.dims.num_heads as usize) * splits * st];
        let mut want = vec![0.0f32; (self.a.dims.num_heads as usize) * hd];
        for (ps, out) in part.chunks_mut(splits * st).zip(want.chunks_mut(hd)) {
            let keep = self.rng.below(splits);
            for (s, e) in ps.chunks_mut(st).enumerate() {
                let empty = s != keep && self.rng.unit() < 0.3;
                (e[0], e[1]) = if empty { (f32::NEG_INFINITY, 0.0) } else { (self.rng.sym(5.0), 1.0 + 63.0 * self.rng.unit()) };
                let amp = if empty { 1e3 } else { e[1] };
                e[2..].iter_mut().for_each(|x| *x = self.rng.sym(amp));
            }
            let live: Vec<&[f32]> = ps.chunks(st).filter(|e| e[1] > 0.0).collect();
            let mx = live.iter().map(|e| e[0]).fold(f32::NEG_INFINITY, f32::max) as f64;
            let l: f64 = live.iter().map(|e| e[1] as f64 * (e[0] as f64 - mx).exp()).sum();
            for (d, o) in out.iter_mut().enumerate() {
                *o = (live.iter().map(|e| e[2 + d] as f64 * (e[0] as f64 - mx).exp()).sum::<f64>() / l) as f32;
            }
        }
        self.put(Buf::Part, &part);
        self.run(&la, 1);
        let t = self.ty(&la);
        want.iter_mut().for_each(|x| *x = Self::round_as(*x, t));
        let got = self.get_as(Buf::PAtt, t);
        self.check("attn_combine_rows", None, format!("{splits} splits, some empty, {}", t.name()), &got[..self.qd], &want, Self::tol_as(t));
    }

    /// q and k of one token as the kernels leave them: QK-norm (if any), then RoPE at `pos` (if the layer has it).
    fn qk_prep(&self, l: usize, pos: usize, q: &mut [f32], k: &mut [f32]) {
        if reads(self.a, Role::AttnQNorm) && !whole_qk_norm(self.a) {
            cpu::rms_norm_chunks(q, &self.wt(Role::AttnQNorm, l), self.r.eps);
            cpu::rms_norm_chunks(k, &self.wt(Role::AttnKNorm, l), self.r.eps);
        }
        if let Some(t) = self.layers[l].rope {
            let half = self.hd / 2;
            let (c, s) = &self.tables[&t];
            let (c, s) = (&c[pos * half..(pos + 1) * half], &s[pos * half..(pos + 1) * half]);
            cpu::rope(q, self.hd, c, s);
            cpu::rope(k, self.hd, c, s);
        }
    }

    fn attn_ref(&self, q: &[f32], k: &[f32], v: &[f32], pos: usize, window: Option<usize>) -> Vec<f32> {
        let p = AttnParams { num_heads: (self.a.dims.num_heads as usize), num_kv_heads: (self.a.dims.num_kv_heads as usize), head_dim: self.hd, scale: self.r.attn_scale, window, softcap: None };
        let mut out = vec![0.0; q.len()];
        cpu::attention(q, k, v, pos, p, &mut out);
        out
    }

    /// Every one of layer `l`'s CTX cache rows random (rows past the position must go unread).
    fn fill_cache(&mut self, l: usize) -> (Vec<f32>, Vec<f32>) {
        let (kb, k) = self.rand_bf(CTX * self.kvd, 1.0);
        let (vb, v) = self.rand_bf(CTX * self.kvd, 1.0);
        self.put_bf(Buf::KCache(l), &kb);
        self.put_bf(Buf::VCache(l), &vb);
        (k, v)
    }

    /// Layer `l`'s whole caches: as filled, but the `new` (pos, k, v) rows in bf16. Returns them as read.
    fn check_cache(&mut self, kernel: &str, l: usize, case: &str, mut k: Vec<f32>, mut v: Vec<f32>, new: &[(usize, Vec<f32>, Vec<f32>)]) -> (Vec<f32>, Vec<f32>) {
        let d = self.kvd;
        for (p, kr, vr) in new {
            k[p * d..(p + 1) * d].iter_mut().zip(kr).for_each(|(c, x)| *c = round_bf16(*x));
            v[p * d..(p + 1) * d].iter_mut().zip(vr).for_each(|(c, x)| *c = round_bf16(*x));
        }
        let (gk, gv) = (self.get_bf(Buf::KCache(l)), self.get_bf(Buf::VCache(l)));
        self.check(kernel, Some(l), format!("{case} k/v cache"), &[&gk[..], &gv[..]].concat(), &[k, v].concat(), TOL_BF16);
        (gk, gv)
    }

    /// attn_decode: QK-norm, RoPE, the k/v cache write at `pos`, split attention and, in the
    /// last block of each head, the merge into Att; it leaves AttnCount at zero for the next layer.
    fn attn_decode(&mut self, l: usize, pos: usize, window: Option<usize>) {
        let la = with_window(&find(&self.fused, "attn_decode", Some(l)), 9, window);
        let case = format!("pos={pos}{}", window.map_or(String::new(), |w| format!(" window={w}")));
        let (k0, v0) = self.fill_cache(l);
        let qkv = self.rand_qkv(1);
        self.put(Buf::Qkv, &qkv);
        self.put_i32(Buf::Pos, &[pos as i32]);
        self.put_i32(Buf::AttnCount, &vec![0; self.a.dims.num_heads as usize]);
        let poison = self.rand(self.qd, 1.0);
        self.put(Buf::Att, &poison);
        self.run(&la, 1);
        let (qd, kvd) = (self.qd, self.kvd);
        let (mut q, mut k, v) = (qkv[..qd].to_vec(), qkv[qd..qd + kvd].to_vec(), qkv[qd + kvd..].to_vec());
        self.qk_prep(l, pos, &mut q, &mut k);
        let (gk, gv) = self.check_cache("attn_decode", l, &case, k0, v0, &[(pos, k, v)]);
        // Over the cache as the kernel left it: its row `pos` (checked above) is what it attended to.
        let att = self.attn_ref(&q, &gk, &gv, pos, window);
        let got = self.get(Buf::Att);
        self.check("attn_decode", Some(l), format!("{case} att"), &got[..qd], &att, TOL_F32);
        let count: Vec<f32> = self.get_i32(Buf::AttnCount).iter().map(|&c| c as f32).collect();
        self.check("attn_decode", Some(l), format!("{case} AttnCount back to 0"), &count, &vec![0.0; count.len()], 0.0);
    }

    /// qk_rope_kv over `rows` rows of `buf` at positions pos..: q, k normed and rotated in place,
    /// v untouched, k and v written to cache rows pos..; a row past the last stays as written.
    fn qk_rope_kv(&mut self, la: &Launch, buf: Buf, rows: usize, l: usize, pos: usize) {
        let case = format!("pos={pos} rows={rows}");
        let (k0, v0) = self.fill_cache(l);
        let w = self.qd + 2 * self.kvd;
        let n = (rows + 1).min(self.e.layout().get(buf).expect("buffer").1 / (4 * w));
        let qkv = self.rand_qkv(n);
        self.put(buf, &qkv);
        self.put_i32(Buf::Pos, &[pos as i32]);
        self.run(la, rows);
        let mut want = qkv;
        let mut new = Vec::new();
        for (r, row) in want.chunks_mut(w).take(rows).enumerate() {
            let (q, kv) = row.split_at_mut(self.qd);
            let (k, v) = kv.split_at_mut(self.kvd);
            self.qk_prep(l, pos + r, q, k);
            new.push((pos + r, k.to_vec(), v.to_vec()));
        }
        let got = self.get(buf);
        self.check("qk_rope_kv", Some(l), format!("{case} q/k/v"), &got[..n * w], &want, TOL_F32);
        self.check_cache("qk_rope_kv", l, &case, k0, v0, &new);
    }

    /// attn_partial over `rows` query rows (row r at position pos + r, causal), then
    /// attn_combine_rows into PAtt (bf16): over the decode buffers (Qkv, Part, one row in
    /// ATTN_CHUNK splits) or prefill's (PQkv, PPart, one split a row).
    fn attn_partial(&mut self, part: &Launch, combine: &Launch, rows: usize, l: usize, pos: usize, window: Option<usize>) {
        let Arg::Buf(buf) = part.args[0] else { panic!("attn_partial: argument 0 is not the q rows") };
        let part = with_window(part, 4, window);
        let case = format!("{buf:?} pos={pos} rows={rows}{}", window.map_or(String::new(), |w| format!(" window={w}")));
        let (k, v) = self.fill_cache(l);
        let qkv = self.rand_qkv(rows);
        self.put(buf, &qkv);
        self.put_i32(Buf::Pos, &[pos as i32]);
        self.run(&part, rows);
        self.run(combine, rows);
        let w = self.qd + 2 * self.kvd;
        let t = self.ty(combine);
        let want: Vec<f32> = (0..rows).flat_map(|r| self.attn_ref(&qkv[r * w..r * w + self.qd], &k, &v, pos + r, window)).map(|x| Self::round_as(x, t)).collect();
        let got = self.get_as(Buf::PAtt, t);
        self.check(&format!("attn_partial+{}", combine.kernel), Some(l), case, &got[..rows * self.qd], &want, Self::tol_as(t));
    }

    /// qk_norm_whole over `rows` rows of `buf`: q normed over all its values with attn_q_norm, k
    /// over all of its with attn_k_norm, v and the row after the last untouched.
    fn qk_norm_whole(&mut self, la: &Launch, rows: usize, l: usize) {
        let Arg::Buf(buf) = la.args[0] else { panic!("qk_norm_whole: argument 0 is not the qkv rows") };
        let w = self.qd + 2 * self.kvd;
        let n = (rows + 1).min(self.e.layout().get(buf).expect("buffer").1 / (4 * w));
        let qkv = self.rand_qkv(n);
        self.put(buf, &qkv);
        self.run(la, rows);
        let (gq, gk) = (self.wt(Role::AttnQNorm, l), self.wt(Role::AttnKNorm, l));
        let mut want = qkv;
        for row in want.chunks_mut(w).take(rows) {
            let (q, kv) = row.split_at_mut(self.qd);
            let k = &mut kv[..self.kvd];
            q.copy_from_slice(&self.rms(q, &gq));
            k.copy_from_slice(&self.rms(k, &gk));
        }
        let got = self.get(buf);
        self.check("qk_norm_whole", Some(l), format!("{buf:?} rows={rows}"), &got[..n * w], &want, TOL_F32);
    }

    fn norm_qkv(&mut self, l: usize, amp: f32) {
        let la = find(&self.fused, "norm_qkv", Some(l));
        let x = self.rand(self.h, amp);
        self.put(Buf::X, &x);
        self.run(&la, 1);
        let xn = self.rms(&x, &self.wt(Role::AttnNorm, l));
        let want: Vec<f32> = [Role::AttnQ, Role::AttnK, Role::AttnV].iter().flat_map(|&r| matvec(&self.wt(r, l), &xn)).collect();
        let got = self.get(Buf::Qkv);
        self.check("norm_qkv", Some(l), format!("|x| < {amp}"), &got[..want.len()], &want, TOL_F32);
    }

    fn norm_gateup(&mut self, l: usize) {
        let la = find(&self.fused, "norm_gateup", Some(l));
        let x = self.rand(self.h, 2.0);
        self.put(Buf::X, &x);
        self.run(&la, 1);
        let xn = self.rms(&x, &self.wt(Role::FfnNorm, l));
        let mut want = matvec(&self.wt(Role::FfnGate, l), &xn);
        (self.r.act)(&mut want, &matvec(&self.wt(Role::FfnUp, l), &xn));
        let got = self.get(Buf::Act);
        self.check("norm_gateup", Some(l), "random x", &got[..self.ffn], &want, TOL_F32);
    }

    /// The MoE launches of layer `l` in schedule order, from its router on: the decode step's
    /// (router, top-k, gate/up, down), or prefill's (over its P buffers: router, top-k, then the
    /// grouped path: moe_group, moe_gateup_grouped, moe_down_grouped, moe_combine).
    fn moe_launches(&self, l: usize, prefill: bool) -> Vec<Launch> {
        let list = if prefill { &self.prefill } else { &self.fused };
        let want: &[&str] = if prefill {
            &["moe_router", "moe_topk", "moe_group", "moe_gateup_grouped", "moe_down_grouped", "moe_combine"]
        } else {
            &["moe_router", "moe_topk", "moe_gateup", "moe_down"]
        };
        let at = list.iter().position(|la| la.kernel == "moe_router" && layer_of(la) == Some(l)).unwrap_or_else(|| panic!("no moe_router launch for layer {l}"));
        let got: Vec<Launch> = list[at..].iter().take(want.len()).cloned().collect();
        assert_eq!(got.iter().map(|la| la.kernel).collect::<Vec<_>>(), want, "layer {l}'s MoE launches (prefill: {prefill})");
        got
    }

    /// Rows of a buffer a check may write: `rows` and, where it holds one more (prefill's), a row
    /// past the last that a kernel over `rows` rows must leave alone.
    fn rows_in(&self, b: Buf, rows: usize, row_bytes: usize) -> usize {
        (rows + 1).min(self.e.layout().get(b).expect("a buffer of the layout").1 / row_bytes)
    }

    /// A route of `rows` rows: top_k distinct random experts each, random weights; as written.
    /// The `shared` experts are in every row, at a slot that moves from row to row.
    fn rand_route(&mut self, b: Buf, rows: usize, shared: &[usize]) -> Vec<(Vec<usize>, Vec<f32>)> {
        let mut out = Vec::new();
        let mut bytes = Vec::new();
        for r in 0..rows {
            let mut ids: Vec<usize> = shared.iter().copied().chain((0..self.experts).filter(|e| !shared.contains(e))).collect();
            for i in shared.len()..self.top_k {
                ids.swap(i, i + self.rng.below(self.experts - i));
            }
            ids.truncate(self.top_k);
            ids.rotate_right(r % self.top_k);
            let w: Vec<f32> = (0..self.top_k).map(|_| 0.05 + self.rng.unit()).collect();
            bytes.extend(ids.iter().flat_map(|&e| (e as i32).to_le_bytes()));
            bytes.extend(w.iter().flat_map(|x| x.to_le_bytes()));
            out.push((ids, w));
        }
        self.write(b, &bytes);
        out
    }

    /// moe_router over `rows` rows: logits = Wr rmsnorm(x) * g, per row.
    fn moe_router(&mut self, la: &Launch, rows: usize, l: usize) {
        let (Arg::Buf(xb), Arg::Buf(out)) = (la.args[0], la.args[3]) else { panic!("moe_router: arguments {:?}", la.args) };
        let (h, e) = (self.h, self.experts);
        let x = self.rand(rows * h, 2.0);
        self.put(xb, &x);
        let n = self.rows_in(out, rows, 4 * e);
        let mut want = self.rand(n * e, 1.0);
        self.put(out, &want);
        self.run(la, rows);
        let (g, wr) = (self.wt(Role::FfnNorm, l), self.wt(Role::MoeRouter, l));
        for (xr, wr_out) in x.chunks(h).zip(want.chunks_mut(e)) {
            wr_out.copy_from_slice(&matvec(&wr, &self.rms(xr, &g)));
        }
        let got = self.get(out);
        self.check("moe_router", Some(l), format!("{xb:?} -> {out:?} rows={rows}"), &got[..n * e], &want, TOL_F32);
    }

    /// moe_topk over `rows` rows of random logits (row 0 with a tie among its best): the experts
    /// as thin_core::cpu::Router picks them (exact), their weights (renormalised or not).
    fn moe_topk(&mut self, la: &Launch, rows: usize, renorm: bool) {
        let (Arg::Buf(lb), Arg::Buf(rb)) = (la.args[0], la.args[2]) else { panic!("moe_topk: arguments {:?}", la.args) };
        let (e, k) = (self.experts, self.top_k);
        let mut logits = self.rand(rows * e, 4.0);
        (logits[3], logits[e - 2]) = (5.0, 5.0);
        self.put(lb, &logits);
        let mut la = la.clone();
        la.args[1] = Arg::I32(renorm as i32);
        self.run(&la, rows);
        let route = self.read(rb);
        let word = |i: usize| [route[4 * i], route[4 * i + 1], route[4 * i + 2], route[4 * i + 3]];
        let mut router = cpu::Router::new(e);
        let (mut got_ids, mut want_ids, mut got_w, mut want_w) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (r, lr) in logits.chunks(e).enumerate() {
            for (j, &(x, p)) in router.top(lr, k, renorm).iter().enumerate() {
                got_ids.push(i32::from_le_bytes(word(r * 2 * k + j)) as f32);
                got_w.push(f32::from_le_bytes(word(r * 2 * k + k + j)));
                want_ids.push(x as f32);
                want_w.push(p);
            }
        }
        let case = format!("{lb:?} rows={rows} renorm={renorm}");
        self.check("moe_topk", None, format!("{case}: experts"), &got_ids, &want_ids, 0.0);
        self.check("moe_topk", None, format!("{case}: weights"), &got_w, &want_w, TOL_F32);
    }

    /// moe_gateup over `rows` rows with a random route: act_j = act(Wg[e_j] n) * (Wu[e_j] n).
    fn moe_gateup(&mut self, la: &Launch, rows: usize, l: usize) {
        let (Arg::Buf(xb), Arg::Buf(rb), Arg::Buf(out)) = (la.args[0], la.args[4], la.args[5]) else { panic!("moe_gateup: arguments {:?}", la.args) };
        let (h, w) = (self.h, self.top_k * self.ffn);
        let x = self.rand(rows * h, 2.0);
        self.put(xb, &x);
        let route = self.rand_route(rb, rows, &[]);
        let n = self.rows_in(out, rows, 4 * w);
        let mut want = self.rand(n * w, 1.0);
        self.put(out, &want);
        self.run(la, rows);
        let g = self.wt(Role::FfnNorm, l);
        for ((xr, (ids, _)), wr) in x.chunks(h).zip(&route).zip(want.chunks_mut(w)) {
            let xn = self.rms(xr, &g);
            for (&e, a) in ids.iter().zip(wr.chunks_mut(self.ffn)) {
                let mut gate = matvec(&self.w.expert_f32(Role::MoeGate, Some(l as u32), e), &xn);
                (self.r.act)(&mut gate, &matvec(&self.w.expert_f32(Role::MoeUp, Some(l as u32), e), &xn));
                a.copy_from_slice(&gate);
            }
        }
        let got = self.get(out);
        self.check("moe_gateup", Some(l), format!("{xb:?} -> {out:?} rows={rows}"), &got[..n * w], &want, TOL_F32);
    }

    /// moe_down over `rows` rows with a random route: x += sum_j w_j Wd[e_j] act_j.
    fn moe_down(&mut self, la: &Launch, rows: usize, l: usize) {
        let (Arg::Buf(ab), Arg::Buf(rb), Arg::Buf(xb)) = (la.args[0], la.args[2], la.args[3]) else { panic!("moe_down: arguments {:?}", la.args) };
        let (h, ffn, w) = (self.h, self.ffn, self.top_k * self.ffn);
        let act = self.rand(rows * w, 0.5);
        self.put(ab, &act);
        let route = self.rand_route(rb, rows, &[]);
        let n = self.rows_in(xb, rows, 4 * h);
        let mut want = self.rand(n * h, 1.0);
        self.put(xb, &want);
        self.run(la, rows);
        for ((ar, (ids, wts)), xr) in act.chunks(w).zip(&route).zip(want.chunks_mut(h)) {
            for ((&e, &p), aj) in ids.iter().zip(wts).zip(ar.chunks(ffn)) {
                let y = matvec(&self.w.expert_f32(Role::MoeDown, Some(l as u32), e), aj);
                xr.iter_mut().zip(y).for_each(|(o, v)| *o += p * v);
            }
        }
        let got = self.get(xb);
        self.check("moe_down", Some(l), format!("{ab:?} -> {xb:?} rows={rows}"), &got[..n * h], &want, TOL_F32);
    }

    /// Every MoE kernel of layer `l`: the decode forms (one row), or prefill's (ROWS rows).
    fn moe(&mut self, l: usize, prefill: bool) {
        let launches = self.moe_launches(l, prefill);
        let rows = if prefill { ROWS } else { 1 };
        self.moe_router(&launches[0], rows, l);
        for renorm in [false, true] {
            self.moe_topk(&launches[1], rows, renorm);
        }
        if prefill {
            self.moe_grouped(&launches[2..], rows, l);
        } else {
            self.moe_gateup(&launches[2], rows, l);
            self.moe_down(&launches[3], rows, l);
        }
    }

    /// Prefill's experts grouped by expert over `rows` rows (moe_group, moe_gateup_grouped,
    /// moe_down_grouped, moe_combine) on a random route in which two experts are chosen by every
    /// row (more rows than a gate/up tile holds) and most by none: the lists exactly, the
    /// activations and each pair's down output against the CPU ops, the residual after
    /// moe_combine, and that residual again, bit for bit, from a second run.
    fn moe_grouped(&mut self, launches: &[Launch], rows: usize, l: usize) {
        let [group, gateup, down, combine] = launches else { panic!("four grouped MoE launches") };
        let (Arg::Buf(rb), Arg::Buf(gb)) = (group.args[0], group.args[2]) else { panic!("moe_group: arguments {:?}", group.args) };
        let (Arg::Buf(xb), Arg::Buf(ab)) = (gateup.args[0], gateup.args[5]) else { panic!("moe_gateup_grouped: arguments {:?}", gateup.args) };
        let Arg::Buf(db) = down.args[3] else { panic!("moe_down_grouped: arguments {:?}", down.args) };
        let (h, ffn, k, experts) = (self.h, self.ffn, self.top_k, self.experts);
        let (pairs, w) = (rows * k, k * ffn);
        let shared = [1, experts - 1];
        let route = self.rand_route(rb, rows, &shared);
        let case = format!("rows={rows}, experts {shared:?} in every row");
        let expert_of = |p: usize| route[p / k].0[p % k];

        // moe_group: each expert's pairs row * top_k + slot, ascending, after the offsets.
        self.put_i32(gb, &vec![-1; experts + 1 + pairs]);
        self.run(group, rows);
        let mut want = vec![0.0f32];
        let mut list = Vec::new();
        for e in 0..experts {
            list.extend((0..pairs).filter(|&p| expert_of(p) == e).map(|p| p as f32));
            want.push(list.len() as f32);
        }
        want.extend(list);
        let got: Vec<f32> = self.get_i32(gb).iter().map(|&v| v as f32).collect();
        self.check("moe_group", Some(l), case.clone(), &got[..want.len()], &want, 0.0);

        // moe_gateup_grouped: act of pair p = act(Wg[e] n) * (Wu[e] n), n the pair's row normed.
        let x = self.rand(rows * h, 2.0);
        self.put(xb, &x);
        let n = self.rows_in(ab, rows, 4 * w);
        let mut want = self.rand(n * w, 1.0);
        self.put(ab, &want);
        self.run(gateup, rows);
        let g = self.wt(Role::FfnNorm, l);
        // Each expert's matrices decoded once (most pairs share a few experts).
        let (rw, mut decoded) = (self.w, BTreeMap::new());
        let mut expert = |role: Role, e: usize| -> Vec<f32> { decoded.entry((role, e)).or_insert_with(|| rw.expert_f32(role, Some(l as u32), e)).clone() };
        for (p, a) in want.chunks_mut(ffn).take(pairs).enumerate() {
            let xn = self.rms(&x[p / k * h..][..h], &g);
            let mut gate = matvec(&expert(Role::MoeGate, expert_of(p)), &xn);
            (self.r.act)(&mut gate, &matvec(&expert(Role::MoeUp, expert_of(p)), &xn));
            a.copy_from_slice(&gate);
        }
        let act = self.get(ab);
        self.check("moe_gateup_grouped", Some(l), case.clone(), &act[..n * w], &want, TOL_F32);

        // moe_down_grouped: each pair's Wd[e] act, before its weight.
        let n = self.rows_in(db, pairs, 4 * h);
        let mut want = self.rand(n * h, 1.0);
        self.put(db, &want);
        self.run(down, rows);
        for (p, y) in want.chunks_mut(h).take(pairs).enumerate() {
            y.copy_from_slice(&matvec(&expert(Role::MoeDown, expert_of(p)), &act[p * ffn..][..ffn]));
        }
        let per_pair = self.get(db);
        self.check("moe_down_grouped", Some(l), case.clone(), &per_pair[..n * h], &want, TOL_F32);

        // moe_combine: x += sum_j w_j down_j over each row's slots; twice, the same bits.
        let n = self.rows_in(xb, rows, 4 * h);
        let x0 = self.rand(n * h, 1.0);
        let mut want = x0.clone();
        for (r, xr) in want.chunks_mut(h).take(rows).enumerate() {
            for (j, &wj) in route[r].1.iter().enumerate() {
                xr.iter_mut().zip(&per_pair[(r * k + j) * h..][..h]).for_each(|(o, d)| *o += wj * d);
            }
        }
        let mut runs = Vec::new();
        for _ in 0..2 {
            self.put(xb, &x0);
            self.run(down, rows);
            self.run(combine, rows);
            runs.push(self.get(xb));
        }
        self.check("moe_combine", Some(l), case.clone(), &runs[0][..n * h], &want, TOL_F32);
        self.check("moe_down_grouped + moe_combine", Some(l), format!("{case}: a second run, bit for bit"), &runs[1][..n * h], &runs[0][..n * h], 0.0);
    }

    /// `out (+)= W in`, W = `role` of layer `l` (`[hidden, in]`), a random `out` before.
    fn matvec_kernel(&mut self, la: &Launch, input: Buf, role: Role, out: Buf, add: bool, l: usize) {
        let w = self.wt(role, l);
        let x = self.rand(w.len() / self.h, 0.5);
        let y0 = self.rand(self.h, 1.0);
        self.put(input, &x);
        self.put(out, &y0);
        self.run(la, 1);
        let want: Vec<f32> = matvec(&w, &x).iter().zip(&y0).map(|(p, y)| if add { y + p } else { *p }).collect();
        let got = self.get(out);
        self.check(la.kernel, Some(l), format!("{input:?} -> {out:?}"), &got[..self.h], &want, TOL_F32);
    }

    fn rows_embed(&mut self) {
        let la = find(&self.prefill, "rows_embed", None);
        let (h, vocab) = (self.h, (self.a.dims.vocab_size as usize));
        let mut toks: Vec<i32> = (0..ROWS).map(|_| self.rng.below(vocab) as i32).collect();
        (toks[0], toks[ROWS - 1]) = (0, vocab as i32 - 1);
        self.put_i32(Buf::PToks, &toks);
        let mut want = self.rand((ROWS + 1) * h, 1.0);
        self.put(Buf::PX, &want);
        self.run(&la, ROWS);
        for (r, &t) in toks.iter().enumerate() {
            cpu::embedding(WeightView::F32(&self.emb), t as usize, h, self.emb_scale(), &mut want[r * h..(r + 1) * h]);
        }
        let got = self.get(Buf::PX);
        self.check("rows_embed", None, format!("rows={ROWS}"), &got[..want.len()], &want, TOL_F32);
    }

    fn rows_norm(&mut self, l: usize, role: Role) {
        let h = self.h;
        let la = self.prefill.iter().find(|k| k.kernel == "rows_norm" && k.args.contains(&Arg::Weight(role, Some(l as u32)))).cloned().expect("rows_norm launch");
        let x = self.rand(ROWS * h, 2.0);
        self.put(Buf::PX, &x);
        let t = self.ty(&la);
        let mut want = self.put_rand_as(Buf::PXn, (ROWS + 1) * h, 1.0, t);
        self.run(&la, ROWS);
        let g = self.wt(role, l);
        for (xr, wr) in x.chunks(h).zip(want.chunks_mut(h)) {
            wr.iter_mut().zip(self.rms(xr, &g)).for_each(|(o, n)| *o = Self::round_as(n, t));
        }
        let got = self.get_as(Buf::PXn, t);
        self.check("rows_norm", Some(l), format!("{} rows={ROWS} {}", role.name(), t.name()), &got[..want.len()], &want, Self::tol_as(t));
    }

    fn rows_act(&mut self) {
        let la = find(&self.prefill, "rows_act", None);
        let n = ROWS * self.ffn;
        let (g, u) = (self.rand(n, 4.0), self.rand(n, 2.0));
        self.put(Buf::PGate, &g);
        self.put(Buf::PUp, &u);
        let t = self.ty(&la);
        let mut want = self.put_rand_as(Buf::PAct, n + self.ffn, 1.0, t);
        self.run(&la, ROWS);
        let mut a = g;
        (self.r.act)(&mut a, &u);
        want[..n].iter_mut().zip(a).for_each(|(o, x)| *o = Self::round_as(x, t));
        let got = self.get_as(Buf::PAct, t);
        self.check("rows_act", None, format!("rows={ROWS} {}", t.name()), &got[..want.len()], &want, Self::tol_as(t));
    }

    /// One prefill GEMM: `out[:, col..col + n] (+)= in · W^T` over ROWS rows; the other columns
    /// and the row after the last stay as written.
    fn gemm(&mut self, g: &Gemm) {
        let mut w = self.w.f32(g.weight.0, g.weight.1);
        // The input rows in the weight's type, as the launch before the GEMM writes them.
        let t = self.e.layout().type_of(g.weight).expect("a weight of the schedule");
        if plan::dequantized_for_gemm(t) {
            // The GEMM reads the matrix decoded to bf16 by dequant_<type> (its own check is this one).
            w.iter_mut().for_each(|x| *x = round_bf16(*x));
            self.ran.insert(plan::instance("dequant", t));
        }
        let x = self.put_rand_as(g.input, ROWS * g.k, 1.0, t);
        let mut want = self.rand((ROWS + 1) * g.ldc, 1.0);
        self.put(g.out, &want);
        let name = format!("gemm {} {}", g.weight.0.name(), t.name());
        let case = format!("{:?} -> {:?}[{}..{}]{}", g.input, g.out, g.out_col, g.out_col + g.n, if g.accumulate { " +=" } else { "" });
        if let Err(e) = self.e.run_step(&Step::Gemm(g.clone()), ROWS) {
            // No cuBLAS is an error of its own, not a reason to stop the other checks.
            let (layer, inf) = (g.weight.1.map(|l| l as usize), f32::INFINITY);
            self.checks.push(Check { kernel: name, layer, case: format!("{case}: {e}"), max_abs: inf, max_rel: inf, tol: TOL_GEMM, pass: false });
            return;
        }
        let mut p = vec![0.0; ROWS * g.n];
        cpu::matmul(WeightView::F32(&w), &x, g.k, &mut p);
        for (wr, pr) in want.chunks_mut(g.ldc).zip(p.chunks(g.n)) {
            for (o, v) in wr[g.out_col..g.out_col + g.n].iter_mut().zip(pr) {
                *o = if g.accumulate { *o + v } else { *v };
            }
        }
        let got = self.get(g.out);
        self.check(&name, g.weight.1.map(|l| l as usize), case, &got[..want.len()], &want, TOL_GEMM);
    }

    /// `x += rmsnorm(y) * g` per row, `la` one of the schedule's norm_residual launches (sandwich
    /// archs): the decode form (O into X) on one row, the prefill form (PO into PX) on ROWS.
    fn norm_residual(&mut self, la: &Launch, l: usize) {
        let h = self.h;
        let (Arg::Buf(from), Arg::Weight(role, _), Arg::Buf(into)) = (la.args[0], la.args[1], la.args[2]) else { panic!("norm_residual: arguments {:?}", la.args) };
        let rows = if from == Buf::PO { ROWS } else { 1 };
        let y = self.rand(rows * h, 2.0);
        let mut want = self.rand((rows + (rows > 1) as usize) * h, 1.0);
        self.put(from, &y);
        self.put(into, &want);
        self.run(la, rows);
        let g = self.wt(role, l);
        for (yr, wr) in y.chunks(h).zip(want.chunks_mut(h)) {
            wr.iter_mut().zip(self.rms(yr, &g)).for_each(|(o, n)| *o += n);
        }
        let got = self.get(into);
        self.check("norm_residual", Some(l), format!("{} {from:?} -> {into:?} rows={rows}", role.name()), &got[..want.len()], &want, TOL_F32);
    }

    /// Layer `l`'s projection from `input` into the residual stream, as the schedule launches it:
    /// `*_residual` adds into X, `*_proj` writes O (the sandwich path, a norm_residual after it).
    fn projection(&mut self, l: usize, input: Buf, role: Role) {
        let la = self.fused.iter().find(|k| k.args.first() == Some(&Arg::Buf(input)) && k.args.get(1) == Some(&Arg::Weight(role, Some(l as u32)))).cloned().expect("projection launch");
        let Some(&Arg::Buf(out)) = la.args.last() else { panic!("{}: no output buffer", la.kernel) };
        self.matvec_kernel(&la, input, role, out, out == Buf::X, l);
    }

    /// Every kernel of one layer: the decode step's, the decode forms of prefill's attention pieces, prefill's.
    fn layer(&mut self, l: usize) {
        let window = self.layers[l].window;
        self.norm_qkv(l, 2.0);
        if l == 0 {
            // mean(x^2) ~ 3e-7, the size of eps: an EPS the kernel and the reference disagree on shows.
            self.norm_qkv(l, 1e-3);
        }
        if whole_qk_norm(self.a) {
            let la = find(&self.fused, "qk_norm_whole", Some(l));
            self.qk_norm_whole(&la, 1, l);
            let la = find(&self.prefill, "qk_norm_whole", Some(l));
            self.qk_norm_whole(&la, ROWS, l);
        }
        for pos in POSITIONS {
            self.attn_decode(l, pos, window);
        }
        if l == 0 && window.is_none() {
            // A sliding window the arch does not use, starting mid-split with split 0 empty.
            self.attn_decode(l, 150, Some(40));
        }
        if self.experts > 0 {
            self.moe(l, false);
        } else {
            self.norm_gateup(l);
            self.projection(l, Buf::Act, Role::FfnDown);
        }

        let rope = find(&self.unfused, "qk_rope_kv", Some(l));
        let part = find(&self.unfused, "attn_partial", Some(l));
        let combine = find(&self.unfused, "attn_combine_rows", None);
        for pos in POSITIONS {
            self.qk_rope_kv(&rope, Buf::Qkv, 1, l, pos);
            self.attn_partial(&part, &combine, 1, l, pos, window);
        }
        if l == 0 && window.is_none() {
            self.attn_partial(&part, &combine, 1, l, 150, Some(40));
        }
        self.projection(l, Buf::Att, Role::AttnO);

        self.rows_norm(l, Role::AttnNorm);
        let gemms: Vec<Gemm> = self.gemms.iter().filter(|g| g.weight.1 == Some(l as u32)).cloned().collect();
        if self.experts > 0 {
            assert_eq!(gemms.len(), 4, "q, k, v, o (the experts run as kernels over the rows)");
            self.moe(l, true);
        } else {
            self.rows_norm(l, Role::FfnNorm);
            assert_eq!(gemms.len(), 7, "q, k, v, o, gate, up, down");
        }
        for g in &gemms {
            self.gemm(g);
        }
        let rope = find(&self.prefill, "qk_rope_kv", Some(l));
        let part = find(&self.prefill, "attn_partial", Some(l));
        let combine = find(&self.prefill, "attn_combine_rows", None);
        for pos in POSITIONS {
            self.qk_rope_kv(&rope, Buf::PQkv, ROWS, l, pos);
            self.attn_partial(&part, &combine, ROWS, l, pos, window);
        }
        let post: Vec<Launch> = self.fused.iter().chain(&self.prefill).filter(|k| k.kernel == "norm_residual" && layer_of(k) == Some(l)).cloned().collect();
        for la in &post {
            self.norm_residual(la, l);
        }
    }

}

/// Bring `a` up on random weights and check every kernel: layer 0, the last layer, and the first
/// NoPE and sliding-window layers where the arch has them; once with bf16 matrices and once with
/// layer 0 and the embedding in f32 (the rest bf16). Last, a check that every kernel instance the
/// module defines ran in one of the two.
fn run_arch(a: CudaArch, r: Ref) {
    let _gpu = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let seed = a.arch.bytes().fold(0x7468_696e_u64, |s, b| mix(s ^ b as u64));
    let mut checks = Vec::new();
    let mut ran = BTreeSet::new();
    for mix in [Mix::Bf16, Mix::F32Layer0, Mix::Fp8, Mix::Mxfp4, Mix::Q8_0, Mix::Q4_1] {
        let mixed = mix != Mix::Bf16;
        let w = RandomWeights::new(&a, seed, mix);
        let e = match CudaEngine::with_weights(&w, &a, &CudaOptions::new(CTX)) {
            Ok(e) => e,
            Err(CudaError::NoDriver) => {
                println!("{}: skipped: no CUDA driver", a.arch);
                return;
            }
            Err(err) => panic!("{}: bringing up the CUDA engine on random weights ({mix:?}): {err}", a.arch),
        };
        let mut t = T::new(&a, &r, &w, &e, seed ^ 1 ^ mixed as u64 ^ (mix as u64) << 1);
        t.constants();
        t.rope_tables();
        t.embed();
        t.norm_lm_head();
        t.argmax_step();
        t.attn_combine();
        t.rows_embed();
        if a.kernels.contains("rows_act_") {
            t.rows_act();
        }
        let facts = layer_facts(&a);
        let mut layers = vec![0, facts.len() - 1];
        layers.extend(facts.iter().position(|s| s.rope.is_none()));
        layers.extend(facts.iter().position(|s| s.window.is_some()));
        layers.sort_unstable();
        layers.dedup();
        for l in layers {
            t.layer(l);
        }
        let types = e.stats.weight_types.join("+");
        checks.extend(t.checks.into_iter().map(|mut c| {
            c.case = format!("[{types}] {}", c.case);
            c
        }));
        ran.extend(t.ran);
    }
    let defined = defined_kernels(a.kernels);
    let missing: Vec<&str> = defined.iter().map(|k| k.as_str()).filter(|k| !ran.contains(*k)).collect();
    let case = if missing.is_empty() { format!("all {} kernel instances ran", defined.len()) } else { format!("never ran: {}", missing.join(" ")) };
    let n = missing.len() as f32;
    checks.push(Check { kernel: "coverage".into(), layer: None, case, max_abs: n, max_rel: n, tol: 0.0, pass: missing.is_empty() });
    report(a.arch, &checks);
}

#[cfg(feature = "smollm2-135m")]
#[test]
fn smollm2_135m_kernels_match_cpu_reference() {
    use thin_generated::smollm2_135m as m;
    run_arch(m::cuda::arch().expect("a CUDA schedule"), llama_ref(m::consts::RMS_EPS, m::consts::HEAD_DIM));
}

#[cfg(feature = "llama3.2-1b")]
#[test]
fn llama3_2_1b_kernels_match_cpu_reference() {
    use thin_generated::llama3_2_1b as m;
    run_arch(m::cuda::arch().expect("a CUDA schedule"), llama_ref(m::consts::RMS_EPS, m::consts::HEAD_DIM));
}

#[cfg(feature = "smollm3-3b")]
#[test]
fn smollm3_3b_kernels_match_cpu_reference() {
    use thin_generated::smollm3_3b as m;
    run_arch(m::cuda::arch().expect("a CUDA schedule"), llama_ref(m::consts::RMS_EPS, m::consts::HEAD_DIM));
}

/// OLMoE-1B-7B: the dense archs' attention with whole-projection QK-norm, and the mixture of
/// experts (router, top-k on the device, the chosen experts' gate/up and down) in decode and
/// prefill forms, the expert tensors stacked `[experts, rows, cols]` as the converter stores them.
#[cfg(feature = "olmoe-1b-7b")]
#[test]
fn olmoe_1b_7b_kernels_match_cpu_reference() {
    use thin_generated::olmoe_1b_7b as m;
    run_arch(m::cuda::arch().expect("a CUDA schedule"), llama_ref(m::consts::RMS_EPS, m::consts::HEAD_DIM));
}

/// Gemma 3: embeddings scaled by sqrt(hidden) rounded to bf16 (the bf16 kernel's EMB_SCALE; HF's
/// scaled embedding casts the scale to the weights' dtype, and the CPU engine, f32 throughout,
/// keeps it exact), attention scale query_pre_attn_scalar^-1/2 = 1/sqrt(head_dim), GeGLU (tanh),
/// per-head QK-norm, sandwich norms, sliding-window layers with their own RoPE table.
#[cfg(feature = "gemma3-270m")]
#[test]
fn gemma3_270m_kernels_match_cpu_reference() {
    use thin_generated::gemma3_270m as m;
    let emb_scale = round_bf16((m::consts::HIDDEN as f32).sqrt());
    let emb_scale_f32 = (m::consts::HIDDEN as f32).sqrt();
    let r = Ref { eps: m::consts::RMS_EPS, emb_scale, emb_scale_f32, attn_scale: 1.0 / (m::consts::HEAD_DIM as f32).sqrt(), act: cpu::geglu };
    run_arch(m::cuda::arch().expect("a CUDA schedule"), r);
}

/// SmolLM2-135M's description with OLMoE's whole-projection QK-norm instead of none: a dense arch
/// no shipped model has, so its CUDA module is made here by thin-codegen from the edited text
/// (the kernel template, the schedule lowering) rather than compiled in. Its qk_norm_whole
/// kernel, decode and prefill forms, against the CPU op, and every other kernel as for SmolLM2.
#[cfg(feature = "smollm2-135m")]
#[test]
fn whole_qk_norm_kernels_match_cpu_reference() {
    use thin_generated::smollm2_135m as m;
    let file = "archs/smollm2-135m.toml";
    let text = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(file)).expect("the description");
    let text = text.replace("qk_norm = \"none\"", "qk_norm = \"whole\"")
        + "attn_q_norm = { hf = \"model.layers.{l}.self_attn.q_norm.weight\", gguf = \"blk.{l}.attn_q_norm.weight\" }\n\
           attn_k_norm = { hf = \"model.layers.{l}.self_attn.k_norm.weight\", gguf = \"blk.{l}.attn_k_norm.weight\" }\n";
    let (_, plan, _, sources) = thin_codegen::generate_one_with_kernels(file, &text).expect("generates");
    let d = thin_codegen::parse(file, &text).expect("parses");
    let schedule = thin_codegen::cuda_schedule(&d, &plan).expect("a CUDA schedule");
    let kernels: &'static str = Box::leak(sources.into_values().next().expect("a kernel source").into_boxed_str());
    let a = CudaArch { arch: "smollm2-135m+whole-qk-norm", schedule, kernels, ..m::cuda::arch().expect("a CUDA schedule") };
    assert!(whole_qk_norm(&a));
    run_arch(a, llama_ref(m::consts::RMS_EPS, m::consts::HEAD_DIM));
}

/// Weight streaming moves where a streamed layer's matrices are read from (a ring slot, refilled
/// from page-locked host memory every pass), never what is computed: logits with layers streamed
/// equal those with every weight resident bit for bit, from the same weights. Per arch and weight
/// source: an engine with every weight resident, one with every layer streamed (no resident
/// prefix: the first copies have nothing to overlap) and one with the second half streamed; each
/// prefills a 600-token prompt (two prefill passes of 512 and 88 rows: the ring refilled between
/// them), then takes 24 decode steps feeding its own argmax (the decode graph replayed, the ring
/// refilled every step), comparing every logit's bits; then, after a reset, 8 greedy steps on the
/// device, comparing the ids. Sources: random bf16 weights and random Q8_0 blocks (split at
/// upload: the pinned copy holds the device layout), and `THIN_STREAM_ARCHIVE=path.thin` if given
/// (an archive of the arch under test). Only runs on a device; passes with "skipped" without one.
fn stream_equals_all(a: &CudaArch, src: &dyn WeightSource, what: &str) {
    const CTX_STREAM: usize = 1024;
    let vocab = a.dims.vocab_size as usize;
    let layers = a.dims.num_layers as u32;
    let prompt: Vec<u32> = (0..600u64).map(|i| ((i * 7919 + 13) % vocab as u64) as u32).collect();
    let run = |streamed: Vec<u32>| -> Option<(Vec<Vec<f32>>, Vec<u32>, usize)> {
        let opts = CudaOptions { streamed_layers: streamed.clone(), ..CudaOptions::new(CTX_STREAM) };
        let mut e = match CudaEngine::with_weights(src, a, &opts) {
            Ok(e) => e,
            Err(CudaError::NoDriver) => return None,
            Err(err) => panic!("{} ({what}): bringing up the engine with layers {streamed:?} streamed: {err}", a.arch),
        };
        assert_eq!(e.stats.streamed_layers, streamed);
        assert_eq!(e.stats.ring_bytes > 0, !streamed.is_empty());
        let mut rows = vec![e.prefill(&prompt).expect("prefill").to_vec()];
        for _ in 0..24 {
            let next = thin_core::sampler::argmax(rows.last().expect("a row"));
            rows.push(e.decode_step(next).expect("decode step").to_vec());
        }
        e.reset();
        let mut ids = vec![thin_core::sampler::argmax(e.prefill(&prompt[..5]).expect("prefill"))];
        for _ in 0..8 {
            let t = *ids.last().expect("an id");
            ids.push(e.next_greedy(t).expect("greedy step"));
        }
        Some((rows, ids, e.stats.ring_bytes))
    };
    let Some((want_rows, want_ids, _)) = run(Vec::new()) else {
        println!("{} ({what}): skipped: no CUDA driver", a.arch);
        return;
    };
    for streamed in [(0..layers).collect::<Vec<u32>>(), (layers / 2..layers).collect()] {
        let (rows, ids, ring) = run(streamed.clone()).expect("the driver answered once");
        for (i, (got, want)) in rows.iter().zip(&want_rows).enumerate() {
            let diff = got.iter().zip(want).position(|(g, w)| g.to_bits() != w.to_bits());
            assert!(diff.is_none(), "{} ({what}), layers {}..{} streamed: row {i} (0: prefill) differs at logit {diff:?}", a.arch, streamed[0], layers);
        }
        assert_eq!(ids, want_ids, "{} ({what}): greedy ids", a.arch);
        println!("{} ({what}): layers {}..{} streamed through a ring of {ring} bytes: {} logit rows and {} greedy ids equal bit for bit", a.arch, streamed[0], layers, rows.len(), ids.len() - 1);
    }
}

fn stream_equals_all_for(a: CudaArch) {
    let _gpu = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let seed = a.arch.bytes().fold(0x7374_7265_616d_u64, |s, b| mix(s ^ b as u64));
    for m in [Mix::Bf16, Mix::Q8_0] {
        stream_equals_all(&a, &RandomWeights::new(&a, seed, m), &format!("random {m:?}"));
    }
    if let Some(path) = std::env::var_os("THIN_STREAM_ARCHIVE") {
        let archive = thin_core::format::Archive::open(std::path::Path::new(&path)).expect("THIN_STREAM_ARCHIVE opens");
        if archive.manifest().shape_fingerprint == a.fingerprint {
            stream_equals_all(&a, &archive, &format!("{}", std::path::Path::new(&path).display()));
        }
    }
}

#[cfg(feature = "smollm2-135m")]
#[test]
fn smollm2_135m_stream_equals_all() {
    stream_equals_all_for(thin_generated::smollm2_135m::cuda::arch().expect("a CUDA schedule"));
}

#[cfg(feature = "llama3.2-1b")]
#[test]
fn llama3_2_1b_stream_equals_all() {
    stream_equals_all_for(thin_generated::llama3_2_1b::cuda::arch().expect("a CUDA schedule"));
}

#[cfg(feature = "smollm3-3b")]
#[test]
fn smollm3_3b_stream_equals_all() {
    stream_equals_all_for(thin_generated::smollm3_3b::cuda::arch().expect("a CUDA schedule"));
}

#[cfg(feature = "gemma3-270m")]
#[test]
fn gemma3_270m_stream_equals_all() {
    stream_equals_all_for(thin_generated::gemma3_270m::cuda::arch().expect("a CUDA schedule"));
}

/// `--residency hybrid`: layers the CPU engine computes (their matrices never uploaded, their KV
/// cache the CPU engine's) and a streamed one beside them change where a layer is computed, not
/// what: from the same random bf16 weights (the CPU engine reads them widened to f32, exactly), an
/// engine with every odd layer on the host and the last even layer streamed prefills a 300-token
/// prompt (a prefill pass whose host layers run on the CPU), then takes 16 decode steps
/// teacher-forced on the all-resident engine's argmax; every logit row is within cosine 0.9999 of
/// the all-resident engine's. The host layers' matrices must be off the device. Only runs on a
/// device; passes with "skipped" without one.
fn hybrid_near_all(a: CudaArch, open_host: fn(thin_core::engine::MemWeights) -> Result<Box<dyn thin_core::engine::HostLayers + Send>, thin_core::engine::EngineError>) {
    const CTX_HYBRID: usize = 1024;
    let _gpu = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let seed = a.arch.bytes().fold(0x6879_6272_6964_u64, |s, b| mix(s ^ b as u64));
    let w = RandomWeights::new(&a, seed, Mix::Bf16);
    let layers = a.dims.num_layers as u32;
    let vocab = a.dims.vocab_size as usize;
    let prompt: Vec<u32> = (0..300u64).map(|i| ((i * 7919 + 13) % vocab as u64) as u32).collect();
    let mut all = match CudaEngine::with_weights(&w, &a, &CudaOptions::new(CTX_HYBRID)) {
        Ok(e) => e,
        Err(CudaError::NoDriver) => {
            println!("{}: skipped: no CUDA driver", a.arch);
            return;
        }
        Err(err) => panic!("{}: bringing up the all-resident engine: {err}", a.arch),
    };
    let mut want = vec![all.prefill(&prompt).expect("prefill").to_vec()];
    for _ in 0..16 {
        let next = thin_core::sampler::argmax(want.last().expect("a row"));
        want.push(all.decode_step(next).expect("decode step").to_vec());
    }
    let all_weight_bytes = all.stats.weight_bytes;
    drop(all);

    let mut mem = thin_core::engine::MemWeights::default();
    for &role in w.rows.keys() {
        if role.is_per_layer() {
            for l in 0..layers {
                mem.tensors.insert((role, Some(l)), w.f32(role, Some(l)));
            }
        } else {
            mem.tensors.insert((role, None), w.f32(role, None));
        }
    }
    let host_layers: Vec<u32> = (1..layers).step_by(2).collect();
    let streamed = vec![(layers - 1) & !1];
    let opts = CudaOptions { host_layers: host_layers.clone(), streamed_layers: streamed.clone(), ..CudaOptions::new(CTX_HYBRID) };
    let host = open_host(mem).expect("the CPU engine binds the same weights");
    let mut e = CudaEngine::with_host(&w, &a, &opts, Some(host)).unwrap_or_else(|err| panic!("{}: bringing up the hybrid engine: {err}", a.arch));
    assert_eq!(e.stats.host_layers, host_layers);
    let host_matrices: usize = a
        .schedule
        .weights()
        .into_iter()
        .filter(|(r, l)| !r.is_norm() && l.is_some_and(|l| host_layers.contains(&l)))
        .map(|(r, l)| w.bytes(r, l).expect("bytes").len().div_ceil(thin_core::cuda::plan::ALIGN) * thin_core::cuda::plan::ALIGN)
        .sum();
    let streamed_matrices = e.stats.pinned_host_bytes;
    assert_eq!(e.stats.weight_bytes, all_weight_bytes - host_matrices - streamed_matrices, "{}: the host layers' matrices stay off the device", a.arch);
    let mut got = vec![e.prefill(&prompt).expect("hybrid prefill").to_vec()];
    for i in 0..16 {
        let next = thin_core::sampler::argmax(&want[i]);
        got.push(e.decode_step(next).expect("hybrid decode step").to_vec());
    }
    let cos = |a: &[f32], b: &[f32]| {
        let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
        let n = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        dot / (n(a) * n(b))
    };
    let mut worst = 1.0f64;
    let mut top1 = 0;
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let c = cos(g, w);
        worst = worst.min(c);
        top1 += (thin_core::sampler::argmax(g) == thin_core::sampler::argmax(w)) as usize;
        assert!(c >= 0.9999, "{}: row {i} (0: prefill) cosine {c} against all resident", a.arch);
    }
    println!("{}: layers {host_layers:?} on the host, {streamed:?} streamed: {} rows, min cosine {worst:.7}, top-1 {top1}/{}", a.arch, got.len(), got.len());
}

#[cfg(feature = "smollm2-135m")]
#[test]
fn smollm2_135m_hybrid_near_all() {
    hybrid_near_all(thin_generated::smollm2_135m::cuda::arch().expect("a CUDA schedule"), |w| Ok(Box::new(thin_generated::smollm2_135m::Engine::new(w)?)));
}

#[cfg(feature = "gemma3-270m")]
#[test]
fn gemma3_270m_hybrid_near_all() {
    hybrid_near_all(thin_generated::gemma3_270m::cuda::arch().expect("a CUDA schedule"), |w| Ok(Box::new(thin_generated::gemma3_270m::Engine::new(w)?)));
}

#[cfg(feature = "llama3.2-1b")]
#[test]
fn llama3_2_1b_hybrid_near_all() {
    hybrid_near_all(thin_generated::llama3_2_1b::cuda::arch().expect("a CUDA schedule"), |w| Ok(Box::new(thin_generated::llama3_2_1b::Engine::new(w)?)));
}
