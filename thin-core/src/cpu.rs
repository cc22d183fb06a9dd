//! CPU reference ops: plain f32 math, the oracle for every other backend.
//!
//! Weights are row-major `[out, in]` like HF `nn.Linear`; activations are f32.

use std::marker::PhantomData;
use std::ops::Range;

use crate::codecs::{self, Isa};
use crate::engine::WeightView;

pub mod pool;

pub use pool::{check_threads, set_threads, threads, ThreadsError};

/// Row `token` of an embedding table `[vocab, hidden]`, times `scale` (Gemma: `sqrt(hidden)`).
pub fn embedding(table: WeightView<'_>, token: usize, hidden: usize, scale: f32, out: &mut [f32]) {
    assert_eq!(out.len(), hidden);
    table.row_into(token, out);
    if scale != 1.0 {
        out.iter_mut().for_each(|o| *o *= scale);
    }
}

/// `out = x / rms(x) * w` with `rms = sqrt(mean(x^2) + eps)`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    rms_norm_view(x, WeightView::F32(w), eps, out)
}

/// 1 / rms(x), as [`rms_norm`] uses it.
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    1.0 / (ms + eps).sqrt()
}

/// [`rms_norm`] reading the weight where it is stored (f32 or bf16): no copy per call.
pub fn rms_norm_view(x: &[f32], w: WeightView<'_>, eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), w.len());
    assert_eq!(x.len(), out.len());
    let inv = inv_rms(x, eps);
    match w {
        WeightView::F32(w) => out.iter_mut().zip(x).zip(w).for_each(|((o, &v), &g)| *o = v * inv * g),
        WeightView::Bf16(w) => out.iter_mut().zip(x).zip(w).for_each(|((o, &v), &g)| *o = v * inv * g.widen()),
        other => panic!("a {} norm weight (bind admits only f32 and bf16 norms)", other.dtype().name()),
    }
}

/// In-place RMS norm over each `dim`-sized chunk (QK-norm per head).
pub fn rms_norm_chunks(x: &mut [f32], w: &[f32], eps: f32) {
    rms_norm_chunks_view(x, WeightView::F32(w), eps)
}

/// [`rms_norm_chunks`] reading the weight where it is stored.
pub fn rms_norm_chunks_view(x: &mut [f32], w: WeightView<'_>, eps: f32) {
    let dim = w.len();
    assert!(dim > 0 && x.len() % dim == 0);
    for chunk in x.chunks_mut(dim) {
        let inv = inv_rms(chunk, eps);
        match w {
            WeightView::F32(w) => chunk.iter_mut().zip(w).for_each(|(v, &g)| *v = *v * inv * g),
            WeightView::Bf16(w) => chunk.iter_mut().zip(w).for_each(|(v, &g)| *v = *v * inv * g.widen()),
            other => panic!("a {} norm weight (bind admits only f32 and bf16 norms)", other.dtype().name()),
        }
    }
}

/// A weight element the matvec kernels read: f32 or bf16, widened to f32 in registers.
trait Elem: Copy + Send + Sync {
    fn widen(self) -> f32;
}

impl Elem for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl Elem for half::bf16 {
    /// bf16 is the top half of an f32: a shift, which LLVM vectorizes (`bf16::to_f32` does not).
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

/// Accumulator lanes of every dot product. Fixed, so every SIMD path and the portable one sum in
/// the same order and give the same bits: element `i` of each 16-element block adds into lane `i`,
/// lanes are reduced pairwise (8 + 8, 4 + 4, ...), then the tail is added.
const LANES: usize = 16;

/// The lane sums over the whole 16-element blocks of `w . x` (portable).
#[inline(always)]
fn lanes_portable<E: Elem>(w: &[E], x: &[f32]) -> [f32; LANES] {
    let mut acc = [0.0f32; LANES];
    for (a, b) in w.chunks_exact(LANES).zip(x.chunks_exact(LANES)) {
        for i in 0..LANES {
            acc[i] += a[i].widen() * b[i];
        }
    }
    acc
}

/// Reduces the lanes and adds the elements past the last whole block.
#[inline(always)]
fn finish<E: Elem>(acc: [f32; LANES], w: &[E], x: &[f32]) -> f32 {
    finish_lanes(codecs::reduce(acc), w, x)
}

/// `lanes` (the reduced lanes) plus the elements past the last whole block, summed in order.
#[inline(always)]
fn finish_lanes<E: Elem>(lanes: f32, w: &[E], x: &[f32]) -> f32 {
    let body = x.len() / LANES * LANES;
    let mut tail = 0.0f32;
    for (a, b) in w[body..].iter().zip(&x[body..]) {
        tail += a.widen() * b;
    }
    lanes + tail
}

/// `out[r] = w[r, :] . x` for the rows of `w` (`out.len()` rows of `x.len()`), portable.
fn rows_portable<E: Elem>(w: &[E], x: &[f32], out: &mut [f32]) {
    for (o, row) in out.iter_mut().zip(w.chunks_exact(x.len())) {
        *o = finish(lanes_portable(row, x), row, x);
    }
}

/// AVX2 lane sums: two 8-wide accumulators are lanes 0..8 and 8..16; multiply then add (no FMA),
/// exactly as the portable loop rounds.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{finish, LANES};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2")]
    fn store(a0: __m256, a1: __m256) -> [f32; LANES] {
        let mut acc = [0.0f32; LANES];
        // SAFETY: `acc` holds 16 f32, the two unaligned stores write 8 each.
        unsafe {
            _mm256_storeu_ps(acc.as_mut_ptr(), a0);
            _mm256_storeu_ps(acc.as_mut_ptr().add(8), a1);
        }
        acc
    }

    #[target_feature(enable = "avx2")]
    pub fn rows_bf16(w: &[half::bf16], x: &[f32], out: &mut [f32]) {
        let n = x.len();
        let body = n / LANES * LANES;
        for (o, row) in out.iter_mut().zip(w.chunks_exact(n)) {
            let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut i = 0;
            while i < body {
                // SAFETY: i + 16 <= body <= row.len() == x.len(); unaligned loads.
                unsafe {
                    let raw = _mm256_loadu_si256(row.as_ptr().add(i) as *const __m256i);
                    let lo = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw)));
                    let hi = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm256_extracti128_si256::<1>(raw)));
                    let x0 = _mm256_loadu_ps(x.as_ptr().add(i));
                    let x1 = _mm256_loadu_ps(x.as_ptr().add(i + 8));
                    a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_castsi256_ps(lo), x0));
                    a1 = _mm256_add_ps(a1, _mm256_mul_ps(_mm256_castsi256_ps(hi), x1));
                }
                i += LANES;
            }
            *o = finish(store(a0, a1), row, x);
        }
    }

    #[target_feature(enable = "avx2")]
    pub fn rows_f32(w: &[f32], x: &[f32], out: &mut [f32]) {
        let n = x.len();
        let body = n / LANES * LANES;
        for (o, row) in out.iter_mut().zip(w.chunks_exact(n)) {
            let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut i = 0;
            while i < body {
                // SAFETY: i + 16 <= body <= row.len() == x.len(); unaligned loads.
                unsafe {
                    let w0 = _mm256_loadu_ps(row.as_ptr().add(i));
                    let w1 = _mm256_loadu_ps(row.as_ptr().add(i + 8));
                    let x0 = _mm256_loadu_ps(x.as_ptr().add(i));
                    let x1 = _mm256_loadu_ps(x.as_ptr().add(i + 8));
                    a0 = _mm256_add_ps(a0, _mm256_mul_ps(w0, x0));
                    a1 = _mm256_add_ps(a1, _mm256_mul_ps(w1, x1));
                }
                i += LANES;
            }
            *o = finish(store(a0, a1), row, x);
        }
    }
}

/// AVX-512: a 16-element block's bf16 widened into one register (lanes 0..16 at once), `R` rows
/// at a time sharing the loads of `x`; the AVX2 kernel's order.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{finish_lanes, LANES};
    use crate::codecs::x86::sum16_512;
    use std::arch::x86_64::*;

    /// Rows per pass. One: with more, the rows' interleaved reads defeat the hardware prefetcher
    /// on weights streamed from DRAM (four rows at a time, measured at 49152 x 576: 2-4x slower
    /// from DRAM, though 1.1-1.6x faster with the weights in L2).
    const R: usize = 1;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub fn rows_bf16(w: &[half::bf16], x: &[f32], out: &mut [f32]) {
        let n = x.len();
        let (rows, mut r) = (out.len(), 0);
        while r < rows {
            let k = if r + R <= rows { R } else { 1 };
            let wr = &w[r * n..(r + k) * n];
            if k == R {
                group::<R>(wr, x, &mut out[r..r + R]);
            } else {
                group::<1>(wr, x, &mut out[r..r + 1]);
            }
            r += k;
        }
    }

    /// `out[i]` for the `N` rows in `w`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    fn group<const N: usize>(w: &[half::bf16], x: &[f32], out: &mut [f32]) {
        let n = x.len();
        let body = n / LANES * LANES;
        assert!(w.len() == N * n && out.len() == N);
        let mut acc = [_mm512_setzero_ps(); N];
        let mut i = 0;
        while i < body {
            // SAFETY: i + 16 <= body <= x.len(); unaligned load.
            let xv = unsafe { _mm512_loadu_ps(x.as_ptr().add(i)) };
            for (r, a) in acc.iter_mut().enumerate() {
                // SAFETY: r * n + i + 16 <= w.len() (asserted shape); unaligned load.
                let raw = unsafe { _mm256_loadu_si256(w.as_ptr().add(r * n + i) as *const __m256i) };
                let wv = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(raw)));
                *a = _mm512_add_ps(*a, _mm512_mul_ps(wv, xv));
            }
            i += LANES;
        }
        for (r, (o, a)) in out.iter_mut().zip(acc).enumerate() {
            *o = finish_lanes(sum16_512(a), &w[r * n..(r + 1) * n], x);
        }
    }
}

/// Prefill's bf16 GEMM on AVX-512: `outs[t][r] = w[r, :] . x[t, :]`, register-tiled 4 rows x 4
/// tokens (16 accumulators: each weight block is widened once for 4 tokens, each `x` block loaded
/// once for 4 rows). Each accumulator sums exactly as [`avx512::rows_bf16`] does, so every
/// output has its bits.
#[cfg(target_arch = "x86_64")]
mod gemm512 {
    use super::{finish_lanes, LANES};
    use crate::codecs::x86::sum16_512;
    use std::arch::x86_64::*;

    const ROWS: usize = 4;
    const TOKENS: usize = 4;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub fn gemm_bf16(w: &[half::bf16], x: &[f32], n: usize, outs: &mut [&mut [f32]]) {
        let (rows, tokens) = (w.len() / n, x.len() / n);
        assert!(w.len() == rows * n && x.len() == tokens * n && outs.len() == tokens);
        let mut r = 0;
        while r < rows {
            let nr = if r + ROWS <= rows { ROWS } else { 1 };
            let mut t = 0;
            while t < tokens {
                let nt = if t + TOKENS <= tokens { TOKENS } else { 1 };
                let (wr, xt) = (&w[r * n..(r + nr) * n], &x[t * n..(t + nt) * n]);
                let outs = &mut outs[t..t + nt];
                match (nr, nt) {
                    (ROWS, TOKENS) => tile::<ROWS, TOKENS>(wr, xt, n, outs, r),
                    (ROWS, _) => tile::<ROWS, 1>(wr, xt, n, outs, r),
                    (_, TOKENS) => tile::<1, TOKENS>(wr, xt, n, outs, r),
                    _ => tile::<1, 1>(wr, xt, n, outs, r),
                }
                t += nt;
            }
            r += nr;
        }
    }

    /// `outs[t][r0 + r]` for the `R` rows in `w` and the `T` tokens in `x`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    fn tile<const R: usize, const T: usize>(w: &[half::bf16], x: &[f32], n: usize, outs: &mut [&mut [f32]], r0: usize) {
        assert!(w.len() == R * n && x.len() == T * n && outs.len() == T);
        let body = n / LANES * LANES;
        let mut acc = [[_mm512_setzero_ps(); R]; T];
        let mut i = 0;
        while i < body {
            let mut wv = [_mm512_setzero_ps(); R];
            for (r, v) in wv.iter_mut().enumerate() {
                // SAFETY: r * n + i + 16 <= w.len() (asserted shape, i + 16 <= body <= n).
                let raw = unsafe { _mm256_loadu_si256(w.as_ptr().add(r * n + i) as *const __m256i) };
                *v = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(raw)));
            }
            for (t, a) in acc.iter_mut().enumerate() {
                // SAFETY: t * n + i + 16 <= x.len(), as above.
                let xv = unsafe { _mm512_loadu_ps(x.as_ptr().add(t * n + i)) };
                for (a, &v) in a.iter_mut().zip(&wv) {
                    *a = _mm512_add_ps(*a, _mm512_mul_ps(v, xv));
                }
            }
            i += LANES;
        }
        for (t, (a, o)) in acc.iter().zip(outs.iter_mut()).enumerate() {
            let xt = &x[t * n..(t + 1) * n];
            for (r, &a) in a.iter().enumerate() {
                o[r0 + r] = finish_lanes(sum16_512(a), &w[r * n..(r + 1) * n], xt);
            }
        }
    }
}

/// Prefill's bf16 GEMM on AVX-512 BF16 dot products (`vdpbf16ps`: 32 bf16 products an
/// instruction, summed in pairs into 16 f32 lanes). Each token's `x` is split once into two bf16
/// vectors, `hi = bf16(x)` and `lo = bf16(x - hi)`, so `hi + lo` is `x` to within 2^-17 relative,
/// and an output is `w . hi + w . lo`: the products are exact in f32, the sums are not in the
/// exact kernels' order. So not their bits: within 1e-4 of `sum |w x|` of them (test
/// `bf16_dot_prefill_is_within_1e_4_of_the_exact_kernels`), at about twice their speed (no
/// widening of the weights, 32 products an instruction instead of 16). Register-tiled 4 rows x 4
/// tokens like [`gemm512`].
#[cfg(target_arch = "x86_64")]
mod gemm_bf16dot {
    use std::arch::x86_64::*;

    const ROWS: usize = 4;
    const TOKENS: usize = 4;
    /// Inputs per dot-product instruction.
    const K: usize = 32;

    /// The token rows of `x` split into bf16 halves, each row zero-padded to whole `K` blocks.
    pub struct Split {
        hi: Vec<u16>,
        lo: Vec<u16>,
        n: usize,
        stride: usize,
        tokens: usize,
    }

    impl Split {
        pub fn new(x: &[f32], n: usize) -> Split {
            let (tokens, stride) = (x.len() / n, n.div_ceil(K) * K);
            let (mut hi, mut lo) = (vec![0u16; tokens * stride], vec![0u16; tokens * stride]);
            for (t, xr) in x.chunks_exact(n).enumerate() {
                for (i, &v) in xr.iter().enumerate() {
                    let h = half::bf16::from_f32(v);
                    hi[t * stride + i] = h.to_bits();
                    lo[t * stride + i] = half::bf16::from_f32(v - h.to_f32()).to_bits();
                }
            }
            Split { hi, lo, n, stride, tokens }
        }
    }

    /// `outs[t][r] = w[r, :] . x[t, :]` for the rows of `w` (`[rows, split.n]`) and every token.
    #[target_feature(enable = "avx512bf16,avx512f,avx512bw,avx512vl,avx2")]
    pub fn gemm(w: &[half::bf16], x: &Split, outs: &mut [&mut [f32]]) {
        let n = x.n;
        let rows = w.len() / n;
        assert!(w.len() == rows * n && outs.len() == x.tokens && outs.iter().all(|o| o.len() == rows));
        let mut r = 0;
        while r < rows {
            let nr = if r + ROWS <= rows { ROWS } else { 1 };
            let mut t = 0;
            while t < x.tokens {
                let nt = if t + TOKENS <= x.tokens { TOKENS } else { 1 };
                let wr = &w[r * n..(r + nr) * n];
                let outs = &mut outs[t..t + nt];
                match (nr, nt) {
                    (ROWS, TOKENS) => tile::<ROWS, TOKENS>(wr, x, t, outs, r),
                    (ROWS, _) => tile::<ROWS, 1>(wr, x, t, outs, r),
                    (_, TOKENS) => tile::<1, TOKENS>(wr, x, t, outs, r),
                    _ => tile::<1, 1>(wr, x, t, outs, r),
                }
                t += nt;
            }
            r += nr;
        }
    }

    /// `outs[t][r0 + r]` for the `R` rows in `w` and tokens `t0 .. t0 + T` of `x`.
    #[inline]
    #[target_feature(enable = "avx512bf16,avx512f,avx512bw,avx512vl,avx2")]
    fn tile<const R: usize, const T: usize>(w: &[half::bf16], x: &Split, t0: usize, outs: &mut [&mut [f32]], r0: usize) {
        let n = x.n;
        assert!(w.len() == R * n && t0 + T <= x.tokens && outs.len() == T);
        let mut acc = [[_mm512_setzero_ps(); R]; T];
        let mut i = 0;
        while i < n {
            // The last block of a row reads only its own n - i weights (the inputs are padded).
            let mask: __mmask32 = if n - i >= K { !0 } else { (1u32 << (n - i)) - 1 };
            let mut wv = [_mm512_setzero_si512(); R];
            for (r, v) in wv.iter_mut().enumerate() {
                // SAFETY: the masked lanes are r * n + i .. r * n + min(n, i + K) <= w.len().
                *v = unsafe { _mm512_maskz_loadu_epi16(mask, w.as_ptr().add(r * n + i) as *const i16) };
            }
            for (t, a) in acc.iter_mut().enumerate() {
                let at = (t0 + t) * x.stride + i;
                // SAFETY: at + K <= tokens * stride (rows padded to whole K blocks).
                let (hi, lo) = unsafe {
                    (_mm512_loadu_si512(x.hi.as_ptr().add(at) as *const __m512i), _mm512_loadu_si512(x.lo.as_ptr().add(at) as *const __m512i))
                };
                let (hi, lo): (__m512bh, __m512bh) = (unsafe { std::mem::transmute(hi) }, unsafe { std::mem::transmute(lo) });
                for (a, &v) in a.iter_mut().zip(&wv) {
                    let v: __m512bh = unsafe { std::mem::transmute(v) };
                    *a = _mm512_dpbf16_ps(_mm512_dpbf16_ps(*a, v, hi), v, lo);
                }
            }
            i += K;
        }
        for (a, o) in acc.iter().zip(outs.iter_mut()) {
            for (r, &a) in a.iter().enumerate() {
                o[r0 + r] = _mm512_reduce_add_ps(a);
            }
        }
    }
}

/// `outs[t][r - row0] = w[r, :] . x[t, :]` for rows `row0 .. row0 + outs[t].len()` of `w` and every
/// token row of `x` (`[outs.len(), n_in]`): the bits [`rows_of`] gives token by token, register-tiled
/// where a kernel exists (bf16 and every quantized type on AVX-512), else token by token.
fn rows_of_tokens(w: WeightView<'_>, x: &[f32], n_in: usize, row0: usize, outs: &mut [&mut [f32]]) {
    let rows = outs.first().map_or(0, |o| o.len());
    match (w.rows(row0, row0 + rows, n_in), Isa::best().clamp()) {
        // SAFETY: `clamp` says this CPU runs AVX-512 F/BW/VL.
        #[cfg(target_arch = "x86_64")]
        (WeightView::Bf16(wb), Isa::Avx512) => return unsafe { gemm512::gemm_bf16(wb, x, n_in, outs) },
        (WeightView::Q8_0 { blocks, .. }, _) => {
            return codecs::q8_0::matmul_rows(blocks, x, n_in, outs).expect("a view's rows were checked when it was made")
        }
        (WeightView::F8E4m3 { values, scales, .. }, _) => {
            return codecs::fp8::matmul_rows(values, scales, x, n_in, outs).expect("a view's rows were checked when it was made")
        }
        (WeightView::Mxfp4 { values, scales, postscale, .. }, _) => {
            return codecs::mxfp4::matmul_rows(values, scales, postscale, x, n_in, outs).expect("a view's rows were checked when it was made")
        }
        (WeightView::Q4_1 { blocks, .. }, _) => {
            return codecs::q4_1::matmul_rows(blocks, x, n_in, outs).expect("a view's rows were checked when it was made")
        }
        _ => {}
    }
    for (xr, o) in x.chunks_exact(n_in).zip(outs.iter_mut()) {
        rows_of(w, xr, row0, o);
    }
}

fn rows_bf16(isa: Isa, w: &[half::bf16], x: &[f32], out: &mut [f32]) {
    match isa.clamp() {
        // SAFETY: `clamp` returns a level this CPU runs.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::rows_bf16(w, x, out) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::rows_bf16(w, x, out) },
        _ => rows_portable(w, x, out),
    }
}

fn rows_f32(w: &[f32], x: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if Isa::best() >= Isa::Avx2 {
        // SAFETY: the CPU has AVX2 (`best` never exceeds what it has).
        return unsafe { avx2::rows_f32(w, x, out) };
    }
    rows_portable(w, x, out)
}

/// `out[r - row0] = w[r, :] . x` for rows `row0 .. row0 + out.len()` of `w` (`[_, x.len()]`).
fn rows_of(w: WeightView<'_>, x: &[f32], row0: usize, out: &mut [f32]) {
    let ok = match w.rows(row0, row0 + out.len(), x.len()) {
        WeightView::F32(w) => Ok(rows_f32(w, x, out)),
        WeightView::Bf16(w) => Ok(rows_bf16(Isa::best(), w, x, out)),
        WeightView::F8E4m3 { values, scales, .. } => codecs::fp8::matvec_rows(values, scales, x, out),
        WeightView::Mxfp4 { values, scales, postscale, .. } => codecs::mxfp4::matvec_rows(values, scales, postscale, x, out),
        WeightView::Q8_0 { blocks, .. } => codecs::q8_0::matvec_rows(blocks, x, out),
        WeightView::Q4_1 { blocks, .. } => codecs::q4_1::matvec_rows(blocks, x, out),
    };
    ok.expect("a view's rows were checked when it was made");
}

/// Weight elements one task reads at least: below this, handing work to another thread costs more
/// than it saves.
const MIN_TASK_ELEMS: usize = 32 * 1024;

/// Rows per task: about four tasks per thread (load balance on a shared machine), never tiny ones.
fn rows_per_task(n_out: usize, n_in: usize) -> usize {
    let balanced = n_out.div_ceil(threads() * 4);
    let min_rows = MIN_TASK_ELEMS.div_ceil(n_in.max(1));
    balanced.max(min_rows).max(1)
}

/// An output buffer the tasks of one pool region write, each in its own ranges.
struct SharedOut<'a> {
    ptr: *mut f32,
    len: usize,
    _out: PhantomData<&'a mut [f32]>,
}

// SAFETY: tasks only reach the buffer through `range`, whose callers keep their ranges disjoint.
unsafe impl Sync for SharedOut<'_> {}

impl<'a> SharedOut<'a> {
    fn new(out: &'a mut [f32]) -> SharedOut<'a> {
        SharedOut { ptr: out.as_mut_ptr(), len: out.len(), _out: PhantomData }
    }

    /// `out[r]`.
    ///
    /// # Safety
    /// No other slice of `r` obtained from this buffer is alive (each task has its own ranges).
    #[allow(clippy::mut_from_ref)]
    unsafe fn range(&self, r: Range<usize>) -> &mut [f32] {
        assert!(r.start <= r.end && r.end <= self.len, "range {r:?} of {}", self.len);
        // SAFETY: in bounds (asserted), unaliased (the caller's contract), alive for 'a.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.len()) }
    }
}

/// `out[o] = sum_i w[o, i] * x[i]`, chunks of output rows spread over the pool (one region).
pub fn matvec(w: WeightView<'_>, x: &[f32], out: &mut [f32]) {
    matvecs(x, &mut [(w, out)]);
}

/// [`matvec`] of each `(w, out)` over the same `x`, in one pool region whose tasks are the row
/// chunks of every matrix: the projections of one input (q, k, v; gate, up) wait for the pool
/// once, not once each. Q8_0 on AVX-512 VNNI takes `x` as integers, made once for all of them.
pub fn matvecs(x: &[f32], jobs: &mut [(WeightView<'_>, &mut [f32])]) {
    for (w, out) in jobs.iter() {
        assert_eq!(w.len(), out.len() * x.len(), "matvec weight is not [out, in]");
    }
    if x.is_empty() {
        jobs.iter_mut().for_each(|(_, out)| out.iter_mut().for_each(|o| *o = 0.0));
        return;
    }
    let int8 = jobs.iter().any(|(w, _)| matches!(w, WeightView::Q8_0 { .. })) && Isa::best().int8_dot();
    let xi = int8.then(|| codecs::q8_0::IntX::new(x));
    let rows = |w: WeightView<'_>, row0: usize, o: &mut [f32]| match (&xi, w.rows(row0, row0 + o.len(), x.len())) {
        (Some(xi), WeightView::Q8_0 { blocks, .. }) => {
            codecs::q8_0::matvec_rows_int(blocks, xi, x, o).expect("a view's rows were checked when it was made")
        }
        _ => rows_of(w, x, row0, o),
    };
    // Task t is chunk t - first[j] of job j, for the last j with first[j] <= t.
    let chunks: Vec<usize> = jobs.iter().map(|(_, out)| rows_per_task(out.len(), x.len())).collect();
    let mut first = Vec::with_capacity(jobs.len());
    let mut tasks = 0;
    for ((_, out), &chunk) in jobs.iter().zip(&chunks) {
        first.push(tasks);
        tasks += out.len().div_ceil(chunk);
    }
    if tasks <= 1 {
        return jobs.iter_mut().for_each(|(w, out)| rows(*w, 0, out));
    }
    let outs: Vec<(WeightView<'_>, usize, SharedOut<'_>)> = jobs.iter_mut().map(|(w, out)| (*w, out.len(), SharedOut::new(out))).collect();
    pool::for_each_task(tasks, |t| {
        let j = first.partition_point(|&f| f <= t) - 1;
        let (w, n_out, out) = &outs[j];
        let c = t - first[j];
        let range = c * chunks[j]..((c + 1) * chunks[j]).min(*n_out);
        // SAFETY: task t alone writes these rows of job j's output.
        rows(*w, range.start, unsafe { out.range(range) });
    });
}

/// `out[t, o] = sum_i w[o, i] * x[t, i]` for `t` rows of `x` (`[t, in]` row-major). Each output
/// equals what [`matvec`] gives for that row of `x`, bit for bit, except where a dot-product level
/// ([`Isa::Avx512Dot`]) changes the numbers within 1e-4 relative: bf16 weights here on AVX-512 BF16
/// ([`gemm_bf16dot`]), Q8_0 weights in [`matvec`] on AVX-512 VNNI. The pool splits the weight rows,
/// and each task runs all rows of `x` over its rows while they are in cache: weights are read once.
pub fn matmul(w: WeightView<'_>, x: &[f32], n_in: usize, out: &mut [f32]) {
    assert!(n_in > 0, "matmul with n_in = 0");
    assert_eq!(x.len() % n_in, 0);
    let t = x.len() / n_in;
    assert_eq!(w.len() % n_in, 0);
    let n_out = w.len() / n_in;
    assert_eq!(out.len(), t * n_out);
    if t <= 1 {
        return matvec(w, x, out);
    }
    let chunk = rows_per_task(n_out, n_in);
    let out = SharedOut::new(out);
    // With AVX-512 BF16, bf16 weights take the dot-product GEMM, the tokens split once for all tasks.
    #[cfg(target_arch = "x86_64")]
    let split = (matches!(w, WeightView::Bf16(_)) && Isa::best().bf16_dot()).then(|| gemm_bf16dot::Split::new(x, n_in));
    pool::for_each_task(n_out.div_ceil(chunk), |c| {
        let (r0, r1) = (c * chunk, ((c + 1) * chunk).min(n_out));
        // SAFETY: task c alone writes columns r0..r1 of every output row.
        let mut outs: Vec<&mut [f32]> = (0..t).map(|i| unsafe { out.range(i * n_out + r0..i * n_out + r1) }).collect();
        #[cfg(target_arch = "x86_64")]
        if let (Some(split), WeightView::Bf16(wb)) = (&split, w.rows(r0, r1, n_in)) {
            // SAFETY: `bf16_dot` says this CPU runs AVX-512 BF16.
            return unsafe { gemm_bf16dot::gemm(wb, split, &mut outs) };
        }
        rows_of_tokens(w, x, n_in, r0, &mut outs);
    });
}

/// The wrapping sum of `data` as u64 words, read in parallel on the pool (a streaming read: what
/// [`read_bandwidth_gb_s`] times).
pub fn sum_words(data: &[u64]) -> u64 {
    let tasks = (threads() * 4).min(data.len().max(1));
    let chunk = data.len().div_ceil(tasks).max(1);
    let sums: Vec<std::sync::atomic::AtomicU64> = (0..tasks).map(|_| Default::default()).collect();
    pool::for_each_task(tasks, |c| {
        let part = &data[(c * chunk).min(data.len())..((c + 1) * chunk).min(data.len())];
        // Wrapping integer adds are associative: LLVM vectorizes this into wide loads.
        let s = part.iter().fold(0u64, |a, &w| a.wrapping_add(w));
        sums[c].store(s, std::sync::atomic::Ordering::Relaxed);
    });
    sums.iter().fold(0u64, |a, s| a.wrapping_add(s.load(std::sync::atomic::Ordering::Relaxed)))
}

/// The rate this machine streams memory into the pool's threads: the best of `passes` parallel
/// reads of a `bytes` buffer (far larger than the caches), in GB/s (1e9 bytes), as STREAM reports
/// its best. The ceiling for a decode step, which reads every weight once.
pub fn read_bandwidth_gb_s(bytes: usize, passes: usize) -> f64 {
    // Written first, so the pages exist (a fresh allocation would read the shared zero page).
    let data: Vec<u64> = (0..bytes / 8).map(|i| i as u64).collect();
    let mut best = f64::INFINITY;
    for _ in 0..passes.max(1) {
        let t = std::time::Instant::now();
        std::hint::black_box(sum_words(std::hint::black_box(&data)));
        best = best.min(t.elapsed().as_secs_f64());
    }
    (data.len() * 8) as f64 / best / 1e9
}

/// HF default inverse frequencies `1 / theta^(2i/d)` for `i < d/2`.
pub fn rope_inv_freq(head_dim: usize, theta: f64) -> Vec<f64> {
    (0..head_dim / 2).map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64)).collect()
}

/// Llama 3 frequency scaling, as HF `_compute_llama3_parameters`.
pub fn llama3_inv_freq(inv_freq: &[f64], factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_pos: f64) -> Vec<f64> {
    let low_freq_wavelen = original_max_pos / low_freq_factor;
    let high_freq_wavelen = original_max_pos / high_freq_factor;
    inv_freq
        .iter()
        .map(|&f| {
            let wavelen = 2.0 * std::f64::consts::PI / f;
            if wavelen > low_freq_wavelen {
                f / factor
            } else if wavelen < high_freq_wavelen {
                f
            } else {
                let smooth = (original_max_pos / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                (1.0 - smooth) * f / factor + smooth * f
            }
        })
        .collect()
}

/// cos/sin tables `[max_pos, head_dim/2]` for the given inverse frequencies.
pub fn rope_tables(inv_freq: &[f64], max_pos: usize) -> (Vec<f32>, Vec<f32>) {
    let half = inv_freq.len();
    let mut cos = vec![0.0; max_pos * half];
    let mut sin = vec![0.0; max_pos * half];
    for p in 0..max_pos {
        for (i, &f) in inv_freq.iter().enumerate() {
            let a = p as f64 * f;
            cos[p * half + i] = a.cos() as f32;
            sin[p * half + i] = a.sin() as f32;
        }
    }
    (cos, sin)
}

/// Rotate every head of `x` (`[heads, head_dim]`) at one position, HF `rotate_half` layout:
/// pairs are `(i, i + head_dim/2)`. `cos`/`sin` are that position's rows (`head_dim/2` each).
pub fn rope(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    assert_eq!(cos.len(), half);
    assert_eq!(sin.len(), half);
    for head in x.chunks_mut(head_dim) {
        for i in 0..half {
            let (a, b) = (head[i], head[i + half]);
            head[i] = a * cos[i] - b * sin[i];
            head[i + half] = b * cos[i] + a * sin[i];
        }
    }
}

/// Numerically stable softmax in place.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// `cap * tanh(x / cap)` in place.
pub fn softcap(x: &mut [f32], cap: f32) {
    for v in x.iter_mut() {
        *v = cap * (*v / cap).tanh();
    }
}

/// Shapes and options of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnParams {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// Attend only to the last `window` positions (inclusive of the current one).
    pub window: Option<usize>,
    pub softcap: Option<f32>,
}

impl AttnParams {
    /// The first position query position `pos` attends to (inside its window, if any).
    fn first_position(&self, pos: usize) -> usize {
        self.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }
}

/// The rest of one head's attention once its raw scores `q . k_t` for positions `start..` are in:
/// scale, softcap, softmax, then `o` = the values weighted by them ([`weighted_values`]). The one
/// sequence both [`attention`] and [`attention_prompt`] run, so their outputs share its bits.
fn attend(scores: &mut [f32], p: AttnParams, v: &[f32], stride: usize, start: usize, o: &mut [f32]) {
    scores.iter_mut().for_each(|s| *s *= p.scale);
    if let Some(cap) = p.softcap {
        softcap(scores, cap);
    }
    softmax(scores);
    weighted_values(scores, v, stride, start, o);
}

/// One query position `pos` against a KV cache laid out `[max_seq, kv_heads, head_dim]`
/// (positions `0..=pos` filled). GQA: query head `h` reads kv head `h / (heads / kv_heads)`.
pub fn attention(q: &[f32], k_cache: &[f32], v_cache: &[f32], pos: usize, p: AttnParams, out: &mut [f32]) {
    let hd = p.head_dim;
    let kv_dim = p.num_kv_heads * hd;
    assert_eq!(q.len(), p.num_heads * hd);
    assert_eq!(out.len(), p.num_heads * hd);
    assert!(k_cache.len() >= (pos + 1) * kv_dim);
    let group = p.num_heads / p.num_kv_heads;
    let start = p.first_position(pos);
    let head = |h: usize, o: &mut [f32]| {
        let kvh = h / group;
        let qh = &q[h * hd..(h + 1) * hd];
        let mut scores = Vec::with_capacity(pos + 1 - start);
        attention_scores(qh, &k_cache[kvh * hd..], kv_dim, start..pos + 1, &mut scores);
        attend(&mut scores, p, &v_cache[kvh * hd..], kv_dim, start, o);
    };
    // Heads are independent: parallel once there is enough work to pay for a pool region.
    if p.num_heads * (pos + 1 - start) * hd >= MIN_TASK_ELEMS {
        let out = SharedOut::new(out);
        // SAFETY: task h alone writes head h's outputs.
        pool::for_each_task(p.num_heads, |h| head(h, unsafe { out.range(h * hd..(h + 1) * hd) }));
    } else {
        out.chunks_mut(hd).enumerate().for_each(|(h, o)| head(h, o));
    }
}

/// Positions one transposed key tile holds: a tile is `[head_dim][KEY_TILE]`, so one vector of
/// [`KEY_TILE`] lanes is one dimension of sixteen keys.
const KEY_TILE: usize = 16;
/// Prompt rows one task of [`attention_prompt`] runs for one head.
const PROMPT_ROWS_PER_TASK: usize = 8;

/// [`attention`] for the `rows = q.len() / q_dim` consecutive prompt rows at positions
/// `pos0..pos0 + rows` (their keys and values already in the caches), in one pool region over
/// (head, block of rows) tasks, with the output of each row bit for bit what [`attention`] gives
/// for it. The keys of each kv head are first transposed into tiles of [`KEY_TILE`] positions, so
/// the scores of sixteen positions are one vector, each lane summing its dot product in order over
/// the head dimension from the same neutral element as [`attention_scores`] (separate multiply
/// and add, never fused): the same bits, many scores at once.
pub fn attention_prompt(q: &[f32], k_cache: &[f32], v_cache: &[f32], pos0: usize, p: AttnParams, out: &mut [f32]) {
    let hd = p.head_dim;
    let (q_dim, kv_dim) = (p.num_heads * hd, p.num_kv_heads * hd);
    assert!(q_dim > 0 && q.len() % q_dim == 0);
    assert_eq!(out.len(), q.len());
    let rows = q.len() / q_dim;
    let end = pos0 + rows;
    assert!(k_cache.len() >= end * kv_dim && v_cache.len() >= end * kv_dim);
    if rows == 0 {
        return;
    }
    // tiles[kvh][b][d][j] = k[position 16 b + j][kvh][d]; positions past `end` are never read.
    let n_tiles = end.div_ceil(KEY_TILE);
    let tile = hd * KEY_TILE;
    let mut tiles = vec![0.0f32; p.num_kv_heads * n_tiles * tile];
    for (kvh, head_tiles) in tiles.chunks_exact_mut(n_tiles * tile).enumerate() {
        for t in 0..end {
            let key = &k_cache[t * kv_dim + kvh * hd..][..hd];
            let dst = &mut head_tiles[(t / KEY_TILE) * tile + t % KEY_TILE..];
            for (d, &kd) in key.iter().enumerate() {
                dst[d * KEY_TILE] = kd;
            }
        }
    }
    let blocks = rows.div_ceil(PROMPT_ROWS_PER_TASK);
    let group = p.num_heads / p.num_kv_heads;
    let shared = SharedOut::new(out);
    let task = |i: usize| {
        // The last rows attend to the most positions: their tasks go first.
        let (h, block) = (i % p.num_heads, blocks - 1 - i / p.num_heads);
        let kvh = h / group;
        let head_tiles = &tiles[kvh * n_tiles * tile..(kvh + 1) * n_tiles * tile];
        let mut scores = Vec::with_capacity(end);
        for r in block * PROMPT_ROWS_PER_TASK..((block + 1) * PROMPT_ROWS_PER_TASK).min(rows) {
            let pos = pos0 + r;
            let start = p.first_position(pos);
            let qh = &q[r * q_dim + h * hd..][..hd];
            // SAFETY: (row r, head h) belongs to this task alone.
            let o = unsafe { shared.range(r * q_dim + h * hd..r * q_dim + (h + 1) * hd) };
            prompt_head_row(qh, head_tiles, &v_cache[kvh * hd..], kv_dim, start..pos + 1, p, &mut scores, o);
        }
    };
    pool::for_each_task(p.num_heads * blocks, task);
}

/// One head of one prompt row: scores from the key tiles, then the rest as in [`attention`]
/// ([`attend`]).
#[allow(clippy::too_many_arguments)]
fn prompt_head_row(q: &[f32], tiles: &[f32], v: &[f32], stride: usize, positions: Range<usize>, p: AttnParams, scores: &mut Vec<f32>, o: &mut [f32]) {
    let tile = q.len() * KEY_TILE;
    // Whole tiles from the one holding the first position to the one holding the last.
    let (first, last) = (positions.start / KEY_TILE, (positions.end - 1) / KEY_TILE);
    scores.clear();
    scores.resize((last + 1 - first) * KEY_TILE, 0.0);
    tile_scores(q, &tiles[first * tile..(last + 1) * tile], scores);
    let skip = positions.start - first * KEY_TILE;
    attend(&mut scores[skip..skip + positions.len()], p, v, stride, positions.start, o);
}

/// `o = sum_t w[t] v_(start + t)` with `v_t = v[t * stride..][..o.len()]`, each output summed in
/// position order from +0.0, a multiply and an add per term.
fn weighted_values(w: &[f32], v: &[f32], stride: usize, start: usize, o: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if Isa::best() >= Isa::Avx512 {
        // SAFETY: the CPU runs AVX-512F.
        return unsafe { weighted_values_avx512(w, v, stride, start, o) };
    }
    weighted_values_portable(w, v, stride, start, o)
}

fn weighted_values_portable(w: &[f32], v: &[f32], stride: usize, start: usize, o: &mut [f32]) {
    let hd = o.len();
    o.iter_mut().for_each(|x| *x = 0.0);
    for (i, s) in w.iter().enumerate() {
        let vt = &v[(start + i) * stride..][..hd];
        for (oi, vi) in o.iter_mut().zip(vt) {
            *oi += s * vi;
        }
    }
}

/// [`weighted_values`], 64 outputs at a time held in four registers across all positions (masked
/// at the head's end), so each lane sums in the same order with the same operations.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn weighted_values_avx512(w: &[f32], v: &[f32], stride: usize, start: usize, o: &mut [f32]) {
    use std::arch::x86_64::*;
    let hd = o.len();
    assert!(w.is_empty() || v.len() >= (start + w.len() - 1) * stride + hd);
    let lanes = |c: usize| -> __mmask16 { if c >= hd { 0 } else if hd - c >= 16 { 0xffff } else { (1u16 << (hd - c)) - 1 } };
    for c in (0..hd).step_by(64) {
        let m = [lanes(c), lanes(c + 16), lanes(c + 32), lanes(c + 48)];
        let mut acc = [_mm512_setzero_ps(); 4];
        for (i, &wt) in w.iter().enumerate() {
            let s = _mm512_set1_ps(wt);
            let row = v.as_ptr().wrapping_add((start + i) * stride + c);
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: masked lanes are not read; the rest lie in v_t[c..hd], in bounds (asserted).
                *a = _mm512_add_ps(*a, _mm512_mul_ps(s, unsafe { _mm512_maskz_loadu_ps(m[j], row.wrapping_add(16 * j)) }));
            }
        }
        for (j, a) in acc.into_iter().enumerate() {
            // SAFETY: only lanes inside o[c..hd] are written.
            unsafe { _mm512_mask_storeu_ps(o.as_mut_ptr().wrapping_add(c + 16 * j), m[j], a) };
        }
    }
}

/// `out[16 b + j] = q . key j of tile b`, each summed in order over the head dimension from the
/// neutral element of `Iterator::sum`, a multiply and an add per term (the bits of
/// [`attention_scores`]).
fn tile_scores(q: &[f32], tiles: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if Isa::best() >= Isa::Avx512 {
        // SAFETY: the CPU runs AVX-512F.
        return unsafe { tile_scores_avx512(q, tiles, out) };
    }
    tile_scores_portable(q, tiles, out)
}

fn tile_scores_portable(q: &[f32], tiles: &[f32], out: &mut [f32]) {
    let zero: f32 = std::iter::empty::<f32>().sum();
    for (t, acc) in tiles.chunks_exact(q.len() * KEY_TILE).zip(out.chunks_exact_mut(KEY_TILE)) {
        acc.iter_mut().for_each(|a| *a = zero);
        for (&qd, kd) in q.iter().zip(t.chunks_exact(KEY_TILE)) {
            for (a, &k) in acc.iter_mut().zip(kd) {
                *a += qd * k;
            }
        }
    }
}

/// [`tile_scores`] with one 16-lane vector per tile, four tiles side by side (independent add
/// chains); `_mm512_mul_ps` then `_mm512_add_ps`, never fused, so each lane has the same bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tile_scores_avx512(q: &[f32], tiles: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    const _: () = assert!(KEY_TILE == 16);
    let hd = q.len();
    let tile = hd * KEY_TILE;
    let n = out.len() / KEY_TILE;
    assert!(tiles.len() >= n * tile);
    let zero = _mm512_set1_ps(std::iter::empty::<f32>().sum());
    let (t, o) = (tiles.as_ptr(), out.as_mut_ptr());
    let mut b = 0;
    // SAFETY: tile b + i spans t[(b + i) * tile..][..tile], in bounds for b + i < n (asserted), and
    // out[(b + i) * 16..][..16] likewise.
    unsafe {
        while b + 4 <= n {
            let (mut a0, mut a1, mut a2, mut a3) = (zero, zero, zero, zero);
            for (d, &qd) in q.iter().enumerate() {
                let qv = _mm512_set1_ps(qd);
                let k = t.add(b * tile + d * KEY_TILE);
                a0 = _mm512_add_ps(a0, _mm512_mul_ps(qv, _mm512_loadu_ps(k)));
                a1 = _mm512_add_ps(a1, _mm512_mul_ps(qv, _mm512_loadu_ps(k.add(tile))));
                a2 = _mm512_add_ps(a2, _mm512_mul_ps(qv, _mm512_loadu_ps(k.add(2 * tile))));
                a3 = _mm512_add_ps(a3, _mm512_mul_ps(qv, _mm512_loadu_ps(k.add(3 * tile))));
            }
            for (i, a) in [a0, a1, a2, a3].into_iter().enumerate() {
                _mm512_storeu_ps(o.add((b + i) * KEY_TILE), a);
            }
            b += 4;
        }
        while b < n {
            let mut a = zero;
            for (d, &qd) in q.iter().enumerate() {
                a = _mm512_add_ps(a, _mm512_mul_ps(_mm512_set1_ps(qd), _mm512_loadu_ps(t.add(b * tile + d * KEY_TILE))));
            }
            _mm512_storeu_ps(o.add(b * KEY_TILE), a);
            b += 1;
        }
    }
}

/// Positions whose scores [`attention_scores`] sums side by side: independent add chains, where
/// one dot product alone waits on each add.
const SCORE_POSITIONS: usize = 8;

/// `q . k_t` for each position `t` of `positions`, where `k_t = k[t * stride..][..q.len()]`, each
/// summed in order over the head dimension from the neutral element of `Iterator::sum` (the bits of
/// `q.iter().zip(k_t).map(|(a, b)| a * b).sum()`), [`SCORE_POSITIONS`] positions at a time.
fn attention_scores(q: &[f32], k: &[f32], stride: usize, positions: Range<usize>, out: &mut Vec<f32>) {
    let hd = q.len();
    let zero: f32 = std::iter::empty::<f32>().sum();
    let mut t = positions.start;
    while t + SCORE_POSITIONS <= positions.end {
        let rows: [&[f32]; SCORE_POSITIONS] = std::array::from_fn(|j| &k[(t + j) * stride..(t + j) * stride + hd]);
        let mut acc = [zero; SCORE_POSITIONS];
        for (d, &qd) in q.iter().enumerate() {
            for (a, r) in acc.iter_mut().zip(&rows) {
                *a += qd * r[d];
            }
        }
        out.extend_from_slice(&acc);
        t += SCORE_POSITIONS;
    }
    for t in t..positions.end {
        out.push(q.iter().zip(&k[t * stride..t * stride + hd]).map(|(a, b)| a * b).sum::<f32>());
    }
}

/// Copy this position's k and v (`[kv_heads * head_dim]`) into the caches.
pub fn kv_write(k: &[f32], v: &[f32], pos: usize, k_cache: &mut [f32], v_cache: &mut [f32]) {
    let d = k.len();
    k_cache[pos * d..(pos + 1) * d].copy_from_slice(k);
    v_cache[pos * d..(pos + 1) * d].copy_from_slice(v);
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU, tanh approximation (`gelu_pytorch_tanh`).
pub fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2/pi)
    0.5 * x * (1.0 + (C * (x + 0.044_715 * x * x * x)).tanh())
}

/// `gate = silu(gate) * up` in place.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}

/// `gate = gelu_tanh(gate) * up` in place.
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = gelu_tanh(*g) * u;
    }
}

/// Softmax over router logits, then the `k` largest as (expert, weight), optionally renormalised.
/// MoE routing with its buffers kept between tokens (no allocation per token).
#[derive(Debug, Clone, Default)]
pub struct Router {
    p: Vec<f32>,
    order: Vec<usize>,
    top: Vec<(usize, f32)>,
}

impl Router {
    pub fn new(experts: usize) -> Router {
        Router { p: Vec::with_capacity(experts), order: Vec::with_capacity(experts), top: Vec::with_capacity(experts) }
    }

    /// The `k` experts of highest softmax(router logits), best first, with their probabilities
    /// (renormalised to sum to 1 if `renorm`).
    pub fn top(&mut self, logits: &[f32], k: usize, renorm: bool) -> &[(usize, f32)] {
        self.p.clear();
        self.p.extend_from_slice(logits);
        softmax(&mut self.p);
        self.order.clear();
        self.order.extend(0..self.p.len());
        let p = &self.p;
        // Ties go to the lower expert index, as torch.topk does in practice (an unstable sort with
        // the index as tie-break: the same order as a stable one, without its buffer).
        self.order.sort_unstable_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        self.top.clear();
        self.top.extend(self.order.iter().take(k).map(|&i| (i, p[i])));
        if renorm {
            let s: f32 = self.top.iter().map(|t| t.1).sum();
            self.top.iter_mut().for_each(|t| t.1 /= s);
        }
        &self.top
    }
}

/// `x += y`.
pub fn residual_add(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    fn close(a: &[f32], b: &[f32], tol: f32) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= tol, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn embedding_f32_and_bf16() {
        let t = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut o = [0.0; 2];
        embedding(WeightView::F32(&t), 1, 2, 1.0, &mut o);
        close(&o, &[3.0, 4.0], 0.0);
        let tb: Vec<bf16> = t.iter().map(|&v| bf16::from_f32(v)).collect();
        embedding(WeightView::Bf16(&tb), 2, 2, 2.0, &mut o);
        close(&o, &[10.0, 12.0], 0.0);
    }

    #[test]
    fn rms_norm_hand_values() {
        // mean(x^2) = (9 + 16) / 2 = 12.5
        let mut o = [0.0; 2];
        rms_norm(&[3.0, 4.0], &[1.0, 2.0], 0.0, &mut o);
        let r = 12.5f32.sqrt();
        close(&o, &[3.0 / r, 8.0 / r], 1e-6);
        let mut x = [3.0, 4.0, 3.0, 4.0];
        rms_norm_chunks(&mut x, &[1.0, 1.0], 0.0);
        close(&x, &[3.0 / r, 4.0 / r, 3.0 / r, 4.0 / r], 1e-6);
    }

    #[test]
    fn matvec_and_matmul_f32_bf16() {
        let w = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]; // [2, 3]
        let mut o = [0.0; 2];
        matvec(WeightView::F32(&w), &[1.0, 0.0, -1.0], &mut o);
        close(&o, &[-2.0, -2.0], 0.0);
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        matvec(WeightView::Bf16(&wb), &[1.0, 1.0, 1.0], &mut o);
        close(&o, &[6.0, 15.0], 0.0);
        let mut m = [0.0; 4];
        matmul(WeightView::F32(&w), &[1.0, 0.0, -1.0, 1.0, 1.0, 1.0], 3, &mut m);
        close(&m, &[-2.0, -2.0, 6.0, 15.0], 0.0);
    }

    #[test]
    fn matvecs_in_one_region_equal_one_matvec_each() {
        // Three jobs over one x: bf16 (many tasks), Q8_0 (the integer path where the CPU has it),
        // f32 of one row (one task), and an empty one.
        let n_in = 576usize;
        let x: Vec<f32> = (0..n_in).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.173).collect();
        let w: Vec<f32> = (0..700 * n_in).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 256.0).collect();
        let wb: Vec<bf16> = w[..600 * n_in].iter().map(|&v| bf16::from_f32(v)).collect();
        let mut q8 = vec![0u8; 100 * n_in / 32 * codecs::q8_0::BLOCK_BYTES];
        codecs::q8_0::quantize_row(&w[600 * n_in..], &mut q8).unwrap();
        let views = [
            WeightView::Bf16(&wb),
            WeightView::Q8_0 { blocks: &q8, cols: n_in },
            WeightView::F32(&w[..n_in]),
            WeightView::F32(&[]),
        ];
        let lens = [600, 100, 1, 0];
        let mut want: Vec<Vec<f32>> = lens.iter().map(|&n| vec![0.0; n]).collect();
        for (w, o) in views.iter().zip(want.iter_mut()) {
            matvec(*w, &x, o);
        }
        let mut got: Vec<Vec<f32>> = lens.iter().map(|&n| vec![f32::NAN; n]).collect();
        let mut jobs: Vec<(WeightView<'_>, &mut [f32])> = views.iter().copied().zip(got.iter_mut().map(|g| &mut g[..])).collect();
        matvecs(&x, &mut jobs);
        assert_eq!(got, want);
    }

    #[test]
    fn matvec_chunked_equals_per_row_dot_with_tails() {
        // 300 rows x 37 inputs: a 16-lane body and a 5-element tail per row.
        let (n_out, n_in) = (300usize, 37usize);
        let w: Vec<f32> = (0..n_out * n_in).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 256.0).collect();
        let x: Vec<f32> = (0..n_in).map(|i| (i as f32 - 18.0) / 8.0).collect();
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let mut o = vec![0.0; n_out];
        let mut ob = vec![0.0; n_out];
        matvec(WeightView::F32(&w), &x, &mut o);
        matvec(WeightView::Bf16(&wb), &x, &mut ob);
        for r in 0..n_out {
            let want: f64 = (0..n_in).map(|i| w[r * n_in + i] as f64 * x[i] as f64).sum();
            let want_b: f64 = (0..n_in).map(|i| wb[r * n_in + i].to_f32() as f64 * x[i] as f64).sum();
            assert!((o[r] as f64 - want).abs() < 1e-3, "row {r}: {} vs {want}", o[r]);
            assert!((ob[r] as f64 - want_b).abs() < 1e-3, "bf16 row {r}: {} vs {want_b}", ob[r]);
        }
        // matmul rows are matvec results bit for bit.
        let x2: Vec<f32> = x.iter().chain(x.iter().rev()).copied().collect();
        let mut m = vec![0.0; 2 * n_out];
        matmul(WeightView::Bf16(&wb), &x2, n_in, &mut m);
        assert_eq!(&m[..n_out], &ob[..]);
        let mut o2 = vec![0.0; n_out];
        matvec(WeightView::Bf16(&wb), &x2[n_in..], &mut o2);
        assert_eq!(&m[n_out..], &o2[..]);
    }

    #[test]
    fn pool_regions_equal_one_serial_pass_bit_for_bit() {
        // 640 x 512: 64 rows at least per task, so several tasks whatever the thread count; a
        // 3-row matmul, and attention over enough positions to take the pool.
        let (n_out, n_in) = (640usize, 512usize);
        let wb: Vec<bf16> = (0..n_out * n_in).map(|i| bf16::from_f32(((i * 7919 % 1999) as f32 - 999.0) / 500.0)).collect();
        let x: Vec<f32> = (0..3 * n_in).map(|i| ((i * 104729 % 401) as f32 - 200.0) / 100.0).collect();
        assert!(rows_per_task(n_out, n_in) < n_out);
        let mut serial = vec![0.0; 3 * n_out];
        for (xr, or) in x.chunks_exact(n_in).zip(serial.chunks_exact_mut(n_out)) {
            rows_of(WeightView::Bf16(&wb), xr, 0, or);
        }
        let mut o = vec![0.0; n_out];
        matvec(WeightView::Bf16(&wb), &x[..n_in], &mut o);
        assert_eq!(o, serial[..n_out]);
        // The pooled matmul too, unless bf16 takes the dot-product GEMM (its own test bounds it).
        if !Isa::best().bf16_dot() {
            let mut m = vec![0.0; 3 * n_out];
            matmul(WeightView::Bf16(&wb), &x, n_in, &mut m);
            assert_eq!(m, serial);
        }

        let p = AttnParams { num_heads: 4, num_kv_heads: 2, head_dim: 64, scale: 0.125, window: None, softcap: None };
        let pos = 200; // 4 heads * 201 positions * 64 >= MIN_TASK_ELEMS
        let kv: Vec<f32> = (0..(pos + 1) * 2 * 64).map(|i| ((i * 31 % 97) as f32 - 48.0) / 50.0).collect();
        let q: Vec<f32> = (0..4 * 64).map(|i| ((i * 17 % 23) as f32 - 11.0) / 10.0).collect();
        let mut pooled = vec![0.0; 4 * 64];
        attention(&q, &kv, &kv, pos, p, &mut pooled);
        // One head at a time: each a single-head call over that head's query and kv head.
        for h in 0..4 {
            let kvh = h / 2;
            let k1: Vec<f32> = (0..=pos).flat_map(|t| kv[t * 128 + kvh * 64..t * 128 + kvh * 64 + 64].to_vec()).collect();
            let one = AttnParams { num_heads: 1, num_kv_heads: 1, ..p };
            let mut o1 = vec![0.0; 64];
            attention(&q[h * 64..(h + 1) * 64], &k1, &k1, pos, one, &mut o1);
            assert_eq!(o1, pooled[h * 64..(h + 1) * 64], "head {h}");
        }
    }

    #[test]
    fn parallel_word_sum_equals_the_serial_one() {
        let n = 100_003u64;
        let data: Vec<u64> = (0..n).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).collect();
        assert_eq!(sum_words(&data), data.iter().fold(0u64, |a, &w| a.wrapping_add(w)));
        assert_eq!(sum_words(&[]), 0);
        assert_eq!(sum_words(&(0..10).collect::<Vec<u64>>()), 45);
        assert!(read_bandwidth_gb_s(1 << 20, 2) > 0.0);
    }

    #[test]
    fn prefill_tiles_equal_token_by_token_rows_bit_for_bit() {
        // 11 rows (two 4-row tiles and 3 single rows) x 83 inputs (5 blocks and a 3-element tail),
        // 9 tokens (two 4-token tiles and one single token).
        let (n_out, n_in, t) = (11usize, 16 * 5 + 3, 9usize);
        let wb: Vec<bf16> = (0..n_out * n_in).map(|i| bf16::from_f32(((i * 2654435761usize % 2001) as f32 - 1000.0) / 97.0)).collect();
        let x: Vec<f32> = (0..t * n_in).map(|i| ((i * 40503 % 301) as f32 - 150.0) / 13.0).collect();
        let mut want = vec![0.0; t * n_out];
        for (xr, o) in x.chunks_exact(n_in).zip(want.chunks_exact_mut(n_out)) {
            rows_portable(&wb, xr, o);
        }
        let mut got = vec![0.0; t * n_out];
        let mut outs: Vec<&mut [f32]> = got.chunks_exact_mut(n_out).collect();
        rows_of_tokens(WeightView::Bf16(&wb), &x, n_in, 0, &mut outs);
        assert_eq!(got, want);
        // From row 3 on (a view's later rows), through matmul's split too.
        let mut part = vec![0.0; t * (n_out - 3)];
        let mut outs: Vec<&mut [f32]> = part.chunks_exact_mut(n_out - 3).collect();
        rows_of_tokens(WeightView::Bf16(&wb), &x, n_in, 3, &mut outs);
        for (p, w) in part.chunks_exact(n_out - 3).zip(want.chunks_exact(n_out)) {
            assert_eq!(p, &w[3..]);
        }
        // matmul too, unless it takes the dot-product GEMM (next test).
        if !Isa::best().bf16_dot() {
            let mut m = vec![0.0; t * n_out];
            matmul(WeightView::Bf16(&wb), &x, n_in, &mut m);
            assert_eq!(m, want);
        }
    }

    #[test]
    fn bf16_dot_prefill_is_within_1e_4_of_the_exact_kernels() {
        if !Isa::Avx512Dot.bf16_dot() {
            eprintln!("this CPU has no AVX-512 BF16: the dot-product GEMM is not built for it");
            return;
        }
        // Rows of 83 (two 32-blocks and a 19-element masked tail) and 576 (SmolLM2's), 11 rows
        // (two 4-row tiles and 3 single rows) x 9 tokens (two 4-token tiles and one single),
        // values spread over ten binades so the split's low half matters.
        for n_in in [83usize, 576] {
            let (n_out, t) = (11usize, 9usize);
            let wb: Vec<bf16> = (0..n_out * n_in).map(|i| bf16::from_f32(((i * 2654435761usize % 2001) as f32 - 1000.0) / 97.0 * (1 << (i % 10)) as f32 / 64.0)).collect();
            let x: Vec<f32> = (0..t * n_in).map(|i| ((i * 40503 % 30011) as f32 - 15005.0) / 1301.0 * (1 << (i % 7)) as f32 / 8.0).collect();
            let mut got = vec![0.0; t * n_out];
            // SAFETY: checked above that this CPU runs AVX-512 BF16.
            unsafe {
                let mut outs: Vec<&mut [f32]> = got.chunks_exact_mut(n_out).collect();
                gemm_bf16dot::gemm(&wb, &gemm_bf16dot::Split::new(&x, n_in), &mut outs);
            }
            let mut worst = 0.0f64;
            for (tt, (xr, g)) in x.chunks_exact(n_in).zip(got.chunks_exact(n_out)).enumerate() {
                let mut exact = vec![0.0; n_out];
                rows_portable(&wb, xr, &mut exact);
                for (r, (&g, &e)) in g.iter().zip(&exact).enumerate() {
                    let mag: f64 = wb[r * n_in..(r + 1) * n_in].iter().zip(xr).map(|(w, x)| (w.to_f64() * *x as f64).abs()).sum();
                    let err = (g as f64 - e as f64).abs() / mag;
                    assert!(err <= 1e-4, "n_in {n_in} token {tt} row {r}: {g} vs {e} (err {err:e} of sum |w x|)");
                    worst = worst.max(err);
                }
            }
            // Much closer than the bound: the split keeps about 16 significant bits of x.
            assert!(worst < 1e-5, "n_in {n_in}: worst {worst:e}");
            eprintln!("n_in {n_in}: worst error {worst:.2e} of sum |w x|");
        }
        // Through matmul (which splits once for every task) as well.
        let (n_out, n_in, t) = (37usize, 576usize, 6usize);
        let wb: Vec<bf16> = (0..n_out * n_in).map(|i| bf16::from_f32(((i * 7919 % 1009) as f32 - 504.0) / 91.0)).collect();
        let x: Vec<f32> = (0..t * n_in).map(|i| ((i * 37 % 29) as f32 - 14.0) / 7.0).collect();
        let mut m = vec![0.0; t * n_out];
        matmul(WeightView::Bf16(&wb), &x, n_in, &mut m);
        for (xr, g) in x.chunks_exact(n_in).zip(m.chunks_exact(n_out)) {
            let mut exact = vec![0.0; n_out];
            rows_portable(&wb, xr, &mut exact);
            for (r, (&g, &e)) in g.iter().zip(&exact).enumerate() {
                let mag: f64 = wb[r * n_in..(r + 1) * n_in].iter().zip(xr).map(|(w, x)| (w.to_f64() * *x as f64).abs()).sum();
                assert!((g as f64 - e as f64).abs() <= 1e-4 * mag, "matmul row {r}: {g} vs {e}");
            }
        }
    }

    #[test]
    fn attention_scores_equal_one_dot_at_a_time_bit_for_bit() {
        // 19 positions (two groups of 8 and 3 alone), head_dim 24, kv rows of 40 (a head's slice).
        let (hd, stride, n) = (24usize, 40usize, 19usize);
        let q: Vec<f32> = (0..hd).map(|i| ((i * 37 % 29) as f32 - 14.0) / 7.0).collect();
        let mut k: Vec<f32> = (0..n * stride).map(|i| ((i * 7919 % 1009) as f32 - 504.0) / 91.0).collect();
        k[3 * stride..3 * stride + hd].iter_mut().for_each(|v| *v = 0.0); // an all-zero key
        for start in [0usize, 5] {
            let mut got = Vec::new();
            attention_scores(&q, &k, stride, start..n, &mut got);
            let want: Vec<f32> = (start..n).map(|t| q.iter().zip(&k[t * stride..t * stride + hd]).map(|(a, b)| a * b).sum::<f32>()).collect();
            assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        }
    }

    #[test]
    fn simd_rows_equal_portable_rows_bit_for_bit() {
        let (n_out, n_in) = (7usize, 16 * 5 + 3);
        let w: Vec<f32> = (0..n_out * n_in).map(|i| ((i * 2654435761usize % 2001) as f32 - 1000.0) / 97.0).collect();
        let x: Vec<f32> = (0..n_in).map(|i| ((i * 40503 % 301) as f32 - 150.0) / 13.0).collect();
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let (mut a, mut b) = (vec![0.0; n_out], vec![0.0; n_out]);
        rows_portable(&w, &x, &mut a);
        rows_f32(&w, &x, &mut b);
        assert_eq!(a, b);
        rows_portable(&wb, &x, &mut a);
        for isa in Isa::supported() {
            rows_bf16(isa, &wb, &x, &mut b);
            assert_eq!(a, b, "{isa:?}");
        }
    }

    #[test]
    fn bf16_widen_is_exact() {
        for v in [0.0f32, -0.0, 1.0, -2.5, 3.0e38, 1.0e-38, f32::INFINITY] {
            let b = bf16::from_f32(v);
            assert_eq!(b.widen().to_bits(), b.to_f32().to_bits(), "{v}");
        }
    }

    #[test]
    fn norm_views_equal_the_f32_norm() {
        let x = [3.0, -4.0, 0.5, 2.0];
        let g = [1.0, 2.0, 0.5, -1.0];
        let gb: Vec<bf16> = g.iter().map(|&v| bf16::from_f32(v)).collect();
        let (mut a, mut b) = ([0.0; 4], [0.0; 4]);
        rms_norm(&x, &g, 1e-5, &mut a);
        rms_norm_view(&x, WeightView::Bf16(&gb), 1e-5, &mut b);
        assert_eq!(a, b);
        let mut c = x;
        rms_norm_chunks_view(&mut c, WeightView::Bf16(&gb[..2]), 1e-5);
        let mut d = x;
        rms_norm_chunks(&mut d, &g[..2], 1e-5);
        assert_eq!(c, d);
    }

    #[test]
    fn rope_rotate_half() {
        // head_dim 4: pairs (0,2), (1,3). 90 degrees on pair 0, none on pair 1.
        let mut x = [1.0, 2.0, 3.0, 4.0];
        rope(&mut x, 4, &[0.0, 1.0], &[1.0, 0.0]);
        close(&x, &[-3.0, 2.0, 1.0, 4.0], 1e-6);
        let f = rope_inv_freq(4, 10000.0);
        assert_eq!(f, vec![1.0, 0.01]);
        let (c, s) = rope_tables(&f, 2);
        close(&c, &[1.0, 1.0, 1f64.cos() as f32, 0.01f64.cos() as f32], 1e-7);
        close(&s[..2], &[0.0, 0.0], 0.0);
    }

    #[test]
    fn llama3_scaling_bands() {
        // orig 8192, low 1, high 4: wavelen > 8192 divided by factor, < 2048 kept, between smoothed.
        let two_pi = 2.0 * std::f64::consts::PI;
        let f = [two_pi / 100.0, two_pi / 10000.0, two_pi / 4096.0];
        let s = llama3_inv_freq(&f, 32.0, 1.0, 4.0, 8192.0);
        assert!((s[0] - f[0]).abs() < 1e-15);
        assert!((s[1] - f[1] / 32.0).abs() < 1e-15);
        // smooth = (8192/4096 - 1) / 3 = 1/3
        let want = (2.0 / 3.0) * f[2] / 32.0 + (1.0 / 3.0) * f[2];
        assert!((s[2] - want).abs() < 1e-15);
    }

    #[test]
    fn softmax_softcap_activations() {
        let mut x = [0.0, (3.0f32).ln()];
        softmax(&mut x);
        close(&x, &[0.25, 0.75], 1e-6);
        let mut y = [0.0, 1000.0];
        softcap(&mut y, 30.0);
        close(&y, &[0.0, 30.0], 1e-4);
        assert!((silu(0.0)).abs() < 1e-7);
        assert!((silu(1.0) - 0.731_058_6).abs() < 1e-6);
        assert!((gelu_tanh(1.0) - 0.841_192).abs() < 1e-5);
        let mut g = [1.0, 0.0];
        swiglu(&mut g, &[2.0, 5.0]);
        close(&g, &[2.0 * 0.731_058_6, 0.0], 1e-6);
        let mut g = [1.0];
        geglu(&mut g, &[2.0]);
        close(&g, &[2.0 * 0.841_192], 1e-5);
        let mut r = [1.0, 2.0];
        residual_add(&mut r, &[0.5, -2.0]);
        close(&r, &[1.5, 0.0], 0.0);
    }

    #[test]
    fn prompt_attention_equals_row_by_row_bit_for_bit() {
        // Shapes: SmolLM2-like GQA (9 heads on 3), a window that cuts inside tiles, a softcap,
        // prompts that start after cached positions and row counts off the tile and task sizes.
        let cases = [
            (9usize, 3usize, 64usize, 0usize, 37usize, None, None),
            (4, 1, 24, 21, 13, Some(5usize), None),
            (2, 2, 8, 3, 70, Some(40), Some(50.0f32)),
            (4, 2, 16, 0, 1, None, None),
        ];
        for (heads, kv_heads, hd, pos0, rows, window, softcap) in cases {
            let p = AttnParams { num_heads: heads, num_kv_heads: kv_heads, head_dim: hd, scale: 1.0 / (hd as f32).sqrt(), window, softcap };
            let (q_dim, kv_dim, end) = (heads * hd, kv_heads * hd, pos0 + rows);
            let noise = |n: usize, seed: usize| -> Vec<f32> { (0..n).map(|i| (((i * 7919 + seed * 104_729) % 2003) as f32 - 1001.0) / 300.0).collect() };
            let q = noise(rows * q_dim, 1);
            // Caches longer than the filled part, as the engine's are.
            let (k, v) = (noise((end + 5) * kv_dim, 2), noise((end + 5) * kv_dim, 3));
            let mut got = vec![f32::NAN; rows * q_dim];
            attention_prompt(&q, &k, &v, pos0, p, &mut got);
            for r in 0..rows {
                let mut want = vec![0.0; q_dim];
                attention(&q[r * q_dim..(r + 1) * q_dim], &k, &v, pos0 + r, p, &mut want);
                let g = &got[r * q_dim..(r + 1) * q_dim];
                assert_eq!(g.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), "row {r} of {heads}/{kv_heads} heads, hd {hd}, pos0 {pos0}");
            }
        }
    }

    #[test]
    fn tile_scores_portable_and_avx512_equal_one_dot_at_a_time() {
        // Five tiles (four side by side, one alone), head_dim 24.
        let hd = 24;
        let n = 5 * KEY_TILE;
        let q: Vec<f32> = (0..hd).map(|i| ((i * 37 % 29) as f32 - 14.0) / 7.0).collect();
        let keys: Vec<f32> = (0..n * hd).map(|i| ((i * 7919 % 1009) as f32 - 504.0) / 91.0).collect();
        let mut tiles = vec![0.0; n * hd];
        for t in 0..n {
            for d in 0..hd {
                tiles[(t / KEY_TILE) * hd * KEY_TILE + d * KEY_TILE + t % KEY_TILE] = keys[t * hd + d];
            }
        }
        let want: Vec<u32> = (0..n).map(|t| q.iter().zip(&keys[t * hd..(t + 1) * hd]).map(|(a, b)| a * b).sum::<f32>().to_bits()).collect();
        let mut got = vec![0.0; n];
        tile_scores_portable(&q, &tiles, &mut got);
        assert_eq!(got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want);
        #[cfg(target_arch = "x86_64")]
        if Isa::best() >= Isa::Avx512 {
            let mut got = vec![0.0; n];
            // SAFETY: the CPU runs AVX-512F.
            unsafe { tile_scores_avx512(&q, &tiles, &mut got) };
            assert_eq!(got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want);
        }
    }

    #[test]
    fn weighted_values_equal_the_scalar_sum_bit_for_bit() {
        // Head sizes below, at and past one vector and the four-register block, rows of stride 100.
        for (hd, start, n) in [(8usize, 0usize, 5usize), (24, 3, 17), (64, 1, 40), (80, 0, 9), (100, 2, 1)] {
            let stride = 100;
            let w: Vec<f32> = (0..n).map(|i| ((i * 37 % 29) as f32 + 1.0) / 30.0).collect();
            let v: Vec<f32> = (0..(start + n) * stride).map(|i| ((i * 7919 % 1009) as f32 - 504.0) / 91.0).collect();
            let mut want = vec![0.0f32; hd];
            for (i, &s) in w.iter().enumerate() {
                for (o, &x) in want.iter_mut().zip(&v[(start + i) * stride..]) {
                    *o += s * x;
                }
            }
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            let mut got = vec![f32::NAN; hd];
            weighted_values(&w, &v, stride, start, &mut got);
            assert_eq!(bits(&got), bits(&want), "hd {hd}");
            weighted_values_portable(&w, &v, stride, start, &mut got);
            assert_eq!(bits(&got), bits(&want), "portable, hd {hd}");
        }
    }

    #[test]
    fn attention_gqa_window() {
        // 2 query heads share 1 kv head, head_dim 1; keys 0 and 1, values 10 and 20.
        let k = [0.0, 1.0];
        let v = [10.0, 20.0];
        let p = AttnParams { num_heads: 2, num_kv_heads: 1, head_dim: 1, scale: 1.0, window: None, softcap: None };
        let mut o = [0.0; 2];
        attention(&[0.0, (3.0f32).ln()], &k, &v, 1, p, &mut o);
        // head 0: equal weights -> 15; head 1: weights 1/4, 3/4 -> 17.5
        close(&o, &[15.0, 17.5], 1e-5);
        let pw = AttnParams { window: Some(1), ..p };
        attention(&[0.0, 1.0], &k, &v, 1, pw, &mut o);
        close(&o, &[20.0, 20.0], 1e-6);
        let mut kc = [0.0; 4];
        let mut vc = [0.0; 4];
        kv_write(&[1.0, 2.0], &[3.0, 4.0], 1, &mut kc, &mut vc);
        close(&kc, &[0.0, 0.0, 1.0, 2.0], 0.0);
        close(&vc, &[0.0, 0.0, 3.0, 4.0], 0.0);
    }

    #[test]
    fn router_topk() {
        let l = [0.0, (3.0f32).ln(), 0.0, 0.0]; // probs 1/6, 1/2, 1/6, 1/6
        let mut r = Router::new(l.len());
        let t = r.top(&l, 2, false).to_vec();
        assert_eq!(t[0].0, 1);
        assert!((t[0].1 - 0.5).abs() < 1e-6);
        assert!((t[1].1 - 1.0 / 6.0).abs() < 1e-6);
        let t = r.top(&l, 2, true).to_vec();
        assert!((t[0].1 - 0.75).abs() < 1e-6);
        assert!((t[1].1 - 0.25).abs() < 1e-6);
    }
}
