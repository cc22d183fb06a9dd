//! GGUF Q8_0 blocks, kept exactly as ggml stores them.
//!
//! Layout: a row of `cols` (a multiple of 32) is `cols / 32` `block_q8_0` of 34 bytes: `d` (f16,
//! little-endian), then `qs[32]` (i8), element `j` = `qs[j] * d`. Rows follow each other; there is
//! no separate scale tensor. Dequantization is ggml's `dequantize_row_q8_0` operation for operation
//! (bit-identical); [`quantize_row`] is ggml's `quantize_row_q8_0_ref`.

use super::{check_len, elems, rd_f16, reduce, CodecError, Isa, Sizes, BLOCK, LANES};
use half::f16;

const NAME: &str = "Q8_0";

/// Bytes of one block.
pub const BLOCK_BYTES: usize = 34;

/// Bytes of a `[rows, cols]` Q8_0 matrix (`scales` is 0: the scales are inside the blocks).
pub fn sizes(rows: u64, cols: u64) -> Result<Sizes, CodecError> {
    block_bytes(NAME, BLOCK_BYTES, rows, cols)
}

/// The sizes of a GGUF block format with the scales inside its 32-element blocks.
pub(crate) fn block_bytes(dtype: &'static str, block_bytes: usize, rows: u64, cols: u64) -> Result<Sizes, CodecError> {
    if !cols.is_multiple_of(BLOCK as u64) {
        return Err(CodecError::PartialBlock {
            dtype,
            count: cols,
            block_elems: BLOCK as u64,
        });
    }
    let values = rows
        .checked_mul(cols / BLOCK as u64)
        .and_then(|b| b.checked_mul(block_bytes as u64))
        .ok_or(CodecError::Overflow { dtype, rows, cols })?;
    Ok(Sizes { values, scales: 0 })
}

/// Checks that `n` elements are whole blocks and that `bytes` holds exactly their blocks.
pub(crate) fn check_blocks(dtype: &'static str, block_bytes: usize, n: usize, bytes: usize) -> Result<(), CodecError> {
    if !n.is_multiple_of(BLOCK) {
        return Err(CodecError::PartialBlock {
            dtype,
            count: n as u64,
            block_elems: BLOCK as u64,
        });
    }
    check_len(dtype, "bytes", n / BLOCK * block_bytes, bytes)
}

/// ggml's `quantize_row_q8_0_ref`: per block `d = amax / 127`, `qs = round(x / d)` (half away from
/// zero, as `roundf`), `d` stored as f16. Non-finite input, or a `d` beyond f16's range (`amax`
/// above about 8.3e6, where ggml would store an infinity), is an error.
pub fn quantize_row(x: &[f32], blocks: &mut [u8]) -> Result<(), CodecError> {
    check_blocks(NAME, BLOCK_BYTES, x.len(), blocks.len())?;
    for (b, (xb, y)) in x.chunks_exact(BLOCK).zip(blocks.chunks_exact_mut(BLOCK_BYTES)).enumerate() {
        let mut amax = 0.0f32;
        for (i, &v) in xb.iter().enumerate() {
            if !v.is_finite() {
                return Err(CodecError::NonFiniteInput {
                    dtype: NAME,
                    index: (b * BLOCK + i) as u64,
                    value: v,
                });
            }
            amax = amax.max(v.abs());
        }
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let dh = f16::from_f32(d);
        if !dh.is_finite() {
            return Err(CodecError::NonFinite { dtype: NAME, block: b as u64 });
        }
        y[..2].copy_from_slice(&dh.to_bits().to_le_bytes());
        for (q, &v) in y[2..].iter_mut().zip(xb) {
            *q = (v * id).round() as i8 as u8;
        }
    }
    Ok(())
}

/// ggml's `dequantize_row_q8_0`: `out[j] = qs[j] * d` per block; `out.len()` elements (whole
/// blocks) from exactly their blocks. A non-finite `d` is [`CodecError::NonFinite`].
pub fn dequantize_row(blocks: &[u8], out: &mut [f32]) -> Result<(), CodecError> {
    check_blocks(NAME, BLOCK_BYTES, out.len(), blocks.len())?;
    for (i, (y, b)) in out.chunks_exact_mut(BLOCK).zip(blocks.chunks_exact(BLOCK_BYTES)).enumerate() {
        let d = rd_f16(b, 0);
        if !d.is_finite() {
            return Err(CodecError::NonFinite { dtype: NAME, block: i as u64 });
        }
        for (o, &q) in y.iter_mut().zip(&b[2..]) {
            *o = (q as i8) as f32 * d;
        }
    }
    Ok(())
}

/// Dequantizes a `[rows, cols]` matrix (`cols` a multiple of 32). Blocks are row-major and never
/// straddle rows, so this is [`dequantize_row`] over the whole buffer, after the shape check.
pub fn dequantize(blocks: &[u8], cols: usize, out: &mut [f32]) -> Result<(), CodecError> {
    check_blocks(NAME, BLOCK_BYTES, cols, cols / BLOCK * BLOCK_BYTES)?;
    dequantize_row(blocks, out)
}

/// `sum_b d_b * sum_{i in b} qs_i * x_i` in the codecs' lane order: lane `l` of a block is
/// `qs_l * x_l + qs_{l+16} * x_{l+16}`, times `d`, added to the row's lane `l`.
#[inline(always)]
fn dot(blocks: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    for (b, xb) in blocks.chunks_exact(BLOCK_BYTES).zip(x.chunks_exact(BLOCK)) {
        let d = rd_f16(b, 0);
        let qs = &b[2..];
        for l in 0..LANES {
            let t = (qs[l] as i8) as f32 * xb[l] + (qs[l + LANES] as i8) as f32 * xb[l + LANES];
            acc[l] += t * d;
        }
    }
    reduce(acc)
}

#[inline(always)]
fn rows_body(blocks: &[u8], x: &[f32], out: &mut [f32]) {
    let row_bytes = x.len() / BLOCK * BLOCK_BYTES;
    for (r, o) in out.iter_mut().enumerate() {
        *o = dot(&blocks[r * row_bytes..(r + 1) * row_bytes], x);
    }
}

fn rows_dispatch(isa: Isa, blocks: &[u8], x: &[f32], out: &mut [f32]) {
    match isa.clamp() {
        // SAFETY: `clamp` returns a level this CPU runs.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::rows(blocks, x, out) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::rows(blocks, x, out) },
        _ => rows_body(blocks, x, out),
    }
}

/// AVX2: lanes 0..8 and 8..16 in two registers; i8 widened to f32 eight at a time.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::x86::{f16_to_f32, sum16_256};
    use super::super::BLOCK;
    use super::BLOCK_BYTES;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,f16c")]
    pub fn rows(blocks: &[u8], x: &[f32], out: &mut [f32]) {
        let nb = x.len() / BLOCK;
        for (r, o) in out.iter_mut().enumerate() {
            let row = &blocks[r * nb * BLOCK_BYTES..(r + 1) * nb * BLOCK_BYTES];
            let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            for (b, blk) in row.chunks_exact(BLOCK_BYTES).enumerate() {
                // SAFETY: 2 + 24 + 8 <= 34 == blk.len(); 32b + 32 <= x.len(); unaligned loads.
                let (q, xs) = unsafe {
                    let q = |k: usize| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(blk.as_ptr().add(2 + 8 * k) as *const __m128i)));
                    let xs = |k: usize| _mm256_loadu_ps(x.as_ptr().add(BLOCK * b + 8 * k));
                    ([q(0), q(1), q(2), q(3)], [xs(0), xs(1), xs(2), xs(3)])
                };
                let d = _mm256_set1_ps(f16_to_f32(u16::from_le_bytes([blk[0], blk[1]])));
                let t0 = _mm256_add_ps(_mm256_mul_ps(q[0], xs[0]), _mm256_mul_ps(q[2], xs[2]));
                let t1 = _mm256_add_ps(_mm256_mul_ps(q[1], xs[1]), _mm256_mul_ps(q[3], xs[3]));
                a0 = _mm256_add_ps(a0, _mm256_mul_ps(t0, d));
                a1 = _mm256_add_ps(a1, _mm256_mul_ps(t1, d));
            }
            *o = sum16_256(a0, a1);
        }
    }
}

/// AVX-512: a block's 16 lanes in one register, `R` rows at a time sharing the loads of `x`.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::super::x86::{call_tile, f16_to_f32, sum16_512, tile_walk};
    use super::super::BLOCK;
    use super::BLOCK_BYTES;
    use std::arch::x86_64::*;

    /// Rows per pass. One: with more, the rows' interleaved reads defeat the hardware prefetcher
    /// on weights streamed from DRAM (four rows at a time, measured at 49152 x 576: 2-4x slower
    /// from DRAM, though 1.1-1.6x faster with the weights in L2).
    const R: usize = 1;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c")]
    pub fn rows(blocks: &[u8], x: &[f32], out: &mut [f32]) {
        let row_bytes = x.len() / BLOCK * BLOCK_BYTES;
        let (rows, mut r) = (out.len(), 0);
        while r < rows {
            let k = if r + R <= rows { R } else { 1 };
            let b = &blocks[r * row_bytes..(r + k) * row_bytes];
            if k == R {
                group::<R>(b, x, &mut out[r..r + R]);
            } else {
                group::<1>(b, x, &mut out[r..r + 1]);
            }
            r += k;
        }
    }

    /// `outs[t][r]` for every row in `blocks` and token in `x`, in tiles of 4 rows x 4 tokens.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c")]
    pub fn tiles(blocks: &[u8], x: &[f32], cols: usize, outs: &mut [&mut [f32]]) {
        let row_bytes = cols / BLOCK * BLOCK_BYTES;
        let (rows, tokens) = (outs.first().map_or(0, |o| o.len()), outs.len());
        for (r, nr, t, nt) in tile_walk(rows, tokens) {
            let (b, xt) = (&blocks[r * row_bytes..(r + nr) * row_bytes], &x[t * cols..(t + nt) * cols]);
            call_tile!(tile, nr, nt, (b, xt, cols, &mut outs[t..t + nt], r));
        }
    }

    /// `outs[t][r0 + n]` for the `R` rows in `blocks` and the `T` tokens in `x`: [`group`]'s
    /// operations per (row, token), with each block's values and scale decoded once per tile.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c")]
    fn tile<const R: usize, const T: usize>(blocks: &[u8], x: &[f32], cols: usize, outs: &mut [&mut [f32]], r0: usize) {
        let nb = cols / BLOCK;
        let row_bytes = nb * BLOCK_BYTES;
        assert!(blocks.len() == R * row_bytes && x.len() == T * cols && outs.len() == T);
        let mut acc = [[_mm512_setzero_ps(); R]; T];
        for b in 0..nb {
            let mut q = [[_mm512_setzero_ps(); 2]; R];
            let mut d = [_mm512_setzero_ps(); R];
            for (n, (q, d)) in q.iter_mut().zip(d.iter_mut()).enumerate() {
                let at = n * row_bytes + b * BLOCK_BYTES;
                // SAFETY: at + 34 <= blocks.len() (asserted shape); unaligned loads.
                *q = unsafe {
                    let p = blocks.as_ptr().add(at);
                    [
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(2) as *const __m128i))),
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(18) as *const __m128i))),
                    ]
                };
                *d = _mm512_set1_ps(f16_to_f32(u16::from_le_bytes([blocks[at], blocks[at + 1]])));
            }
            for (t, a) in acc.iter_mut().enumerate() {
                let at = t * cols + BLOCK * b;
                // SAFETY: at + 32 <= x.len() (asserted shape); unaligned loads.
                let (x0, x1) = unsafe { (_mm512_loadu_ps(x.as_ptr().add(at)), _mm512_loadu_ps(x.as_ptr().add(at + 16))) };
                for ((a, q), &d) in a.iter_mut().zip(&q).zip(&d) {
                    let s = _mm512_add_ps(_mm512_mul_ps(q[0], x0), _mm512_mul_ps(q[1], x1));
                    *a = _mm512_add_ps(*a, _mm512_mul_ps(s, d));
                }
            }
        }
        for (a, o) in acc.iter().zip(outs.iter_mut()) {
            for (n, &a) in a.iter().enumerate() {
                o[r0 + n] = sum16_512(a);
            }
        }
    }

    /// `out[i]` for the `N` rows in `blocks`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c")]
    fn group<const N: usize>(blocks: &[u8], x: &[f32], out: &mut [f32]) {
        let nb = x.len() / BLOCK;
        let row_bytes = nb * BLOCK_BYTES;
        assert!(blocks.len() == N * row_bytes && out.len() == N);
        let mut acc = [_mm512_setzero_ps(); N];
        for b in 0..nb {
            // SAFETY: 32b + 32 <= x.len(); unaligned loads.
            let (x0, x1) = unsafe { (_mm512_loadu_ps(x.as_ptr().add(BLOCK * b)), _mm512_loadu_ps(x.as_ptr().add(BLOCK * b + 16))) };
            for (n, a) in acc.iter_mut().enumerate() {
                let at = n * row_bytes + b * BLOCK_BYTES;
                // SAFETY: at + 34 <= blocks.len() (asserted shape); unaligned loads.
                let (q0, q1) = unsafe {
                    let p = blocks.as_ptr().add(at);
                    (
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(2) as *const __m128i))),
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(18) as *const __m128i))),
                    )
                };
                let d = _mm512_set1_ps(f16_to_f32(u16::from_le_bytes([blocks[at], blocks[at + 1]])));
                let t = _mm512_add_ps(_mm512_mul_ps(q0, x0), _mm512_mul_ps(q1, x1));
                *a = _mm512_add_ps(*a, _mm512_mul_ps(t, d));
            }
        }
        for (o, a) in out.iter_mut().zip(acc) {
            *o = sum16_512(a);
        }
    }
}

/// An input vector as integers for Q8_0 decode on AVX-512 VNNI ([`matvec_rows_int`]): each
/// 32-element block `b` of `x` is `X_i * 2^e_b` with `X_i` a signed 24-bit integer (`2^e_b` the power
/// of two that puts the block's largest `|x_i|` in `[2^22, 2^23)`, so `X_i` is `x_i` to within
/// 2^-23 of that largest value), stored as three bytes: `X_i = 65536 h_i + 256 m_i + l_i` with `l`,
/// `m` unsigned and `h` signed. Made once per matvec and shared by every task. `vpdpbusd` (unsigned
/// byte x signed byte, four products summed into an i32 lane) multiplies a block's 32 weights `qs`
/// by `l` and by `m` exactly; for `h` the operands swap (`qs + 128` unsigned, `h` signed), and the
/// lane starts from `-128 * sum(h)` over its four positions, so it too ends at `sum qs_i h_i`.
pub struct IntX {
    /// `3 * cols` bytes: `l` of every element, then `m`, then `h`.
    digits: Vec<u8>,
    /// `2^e_b` per block: 0 for an all-zero block, NaN for one holding a non-finite value.
    scales: Vec<f32>,
    /// Per block, 8 lanes: `-128 * (h_4l + h_4l+1 + h_4l+2 + h_4l+3)`.
    h_bias: Vec<i32>,
}

impl IntX {
    /// `x` (`x.len()` a multiple of 32) as integers per block.
    pub fn new(x: &[f32]) -> IntX {
        let cols = x.len() / BLOCK * BLOCK;
        let mut xi = IntX { digits: vec![0u8; 3 * cols], scales: vec![0.0; cols / BLOCK], h_bias: vec![0; cols / BLOCK * 8] };
        #[cfg(target_arch = "x86_64")]
        if Isa::best().int8_dot() {
            // SAFETY: `int8_dot` says this CPU runs AVX-512 VNNI (and so F, BW, VL).
            unsafe { vnni::int_x(&x[..cols], &mut xi) };
            return xi;
        }
        for (b, xb) in x[..cols].chunks_exact(BLOCK).enumerate() {
            xi.set_block(b, xb);
        }
        xi
    }

    /// Block `b` from its 32 values `xb`: what `vnni::int_x` writes, bit for bit (ties round to
    /// even in both).
    fn set_block(&mut self, b: usize, xb: &[f32]) {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        // amax in [2^e, 2^(e+1)); e at least -127 (a block of subnormals is then held exactly, in
        // fewer bits), so that 2^(e - 22) is an f32.
        let e = (amax.to_bits() >> 23) as i32 - 127;
        let (scale, up) = if !xb.iter().all(|v| v.is_finite()) {
            (f32::NAN, 0.0)
        } else if amax == 0.0 {
            (0.0, 0.0)
        } else {
            (2f64.powi(e - 22) as f32, 2f64.powi(22 - e))
        };
        self.scales[b] = scale;
        self.h_bias[8 * b..8 * b + 8].fill(0);
        let cols = self.cols();
        for (i, &v) in xb.iter().enumerate() {
            let q = ((v as f64 * up).round_ties_even() as i64).clamp(-(1 << 23) + 1, (1 << 23) - 1) as i32;
            for (k, d) in self.digits.chunks_exact_mut(cols).enumerate() {
                d[b * BLOCK + i] = (q >> (8 * k)) as u8;
            }
            self.h_bias[8 * b + i / 4] += -128 * (q >> 16);
        }
    }

    fn cols(&self) -> usize {
        self.digits.len() / 3
    }
}

/// [`matvec_rows`] with `x` as [`IntX`] on AVX-512 VNNI: not the exact kernels' bits but within
/// 1e-4 relative of their sum (test `int_dot_is_within_1e_4_of_the_exact_kernels`): each block's
/// byte sums are exact in integers (the low two joined in an i32), become f32 lanes (the low sum
/// rounded at most once), and are multiplied by `d_b 2^e_b` into the row's two accumulators, the
/// top byte's scaled by 65536 once per row. Falls back to the exact kernels (with `x`) on a CPU
/// without VNNI or below [`Isa::Avx512Dot`].
pub fn matvec_rows_int(blocks: &[u8], xi: &IntX, x: &[f32], out: &mut [f32]) -> Result<(), CodecError> {
    let n = elems(NAME, out.len(), x.len())?;
    check_blocks(NAME, BLOCK_BYTES, x.len(), x.len() / BLOCK * BLOCK_BYTES)?;
    check_len(NAME, "integer x", x.len(), xi.cols())?;
    check_blocks(NAME, BLOCK_BYTES, n, blocks.len())?;
    match () {
        // SAFETY: `int8_dot` says this CPU runs AVX-512 VNNI (and so F, BW, VL).
        #[cfg(target_arch = "x86_64")]
        () if Isa::best().int8_dot() => unsafe { vnni::rows(blocks, xi, out) },
        () => rows_dispatch(Isa::best(), blocks, x, out),
    }
    check_nonfinite_rows(NAME, BLOCK_BYTES, &[0], blocks, x.len(), out)
}

/// AVX-512 VNNI (256-bit registers): a block's 32 weights against each byte of [`IntX`] in one
/// `vpdpbusd`, 8 i32 lanes of four products each.
#[cfg(target_arch = "x86_64")]
mod vnni {
    use super::super::x86::{f16_to_f32, sum8};
    use super::super::BLOCK;
    use super::{IntX, BLOCK_BYTES};
    use std::arch::x86_64::*;

    /// [`IntX::new`] on AVX-512: the blocks whose largest `|x_i|` is at least 2^-105 (so that
    /// 2^(22 - e) is an f32 and `x_i * 2^(22 - e)` exact) sixteen lanes at a time; others, and
    /// blocks holding a non-finite value, through [`IntX::set_block`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub fn int_x(x: &[f32], xi: &mut IntX) {
        let cols = x.len();
        let lim = _mm512_set1_epi32((1 << 23) - 1);
        for (b, xb) in x.chunks_exact(BLOCK).enumerate() {
            // SAFETY: xb.len() == 32; unaligned loads.
            let (x0, x1) = unsafe { (_mm512_loadu_ps(xb.as_ptr()), _mm512_loadu_ps(xb.as_ptr().add(16))) };
            let abs = |v: __m512| _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fff_ffff));
            let top = _mm512_max_epu32(abs(x0), abs(x1));
            let amax = _mm512_reduce_max_epu32(top);
            let e = (amax >> 23) as i32 - 127;
            if amax >= 0x7f80_0000 || e < -105 || amax == 0 {
                xi.set_block(b, xb);
                continue;
            }
            xi.scales[b] = if e - 22 >= -126 { f32::from_bits(((e - 22 + 127) as u32) << 23) } else { 2f32.powi(e - 22) };
            let up = _mm512_set1_ps(f32::from_bits(((22 - e + 127) as u32) << 23));
            for (n, v) in [x0, x1].into_iter().enumerate() {
                let q = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v, up)), lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim));
                for k in 0..3 {
                    let d = _mm512_cvtepi32_epi8(_mm512_srav_epi32(q, _mm512_set1_epi32(8 * k as i32)));
                    // SAFETY: k * cols + 32 b + 16 n + 16 <= 3 cols; unaligned store.
                    unsafe { _mm_storeu_si128(xi.digits.as_mut_ptr().add(k * cols + BLOCK * b + 16 * n) as *mut __m128i, d) };
                }
                // -128 * (sum of h over each group of four lanes): h summed in pairs twice.
                let h = _mm512_srai_epi32::<16>(q);
                let pairs = _mm512_add_epi32(h, _mm512_srli_epi64::<32>(h));
                let quads = _mm512_add_epi32(pairs, _mm512_bsrli_epi128::<8>(pairs));
                let at = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0);
                let four = _mm512_castsi512_si256(_mm512_permutexvar_epi32(at, _mm512_mullo_epi32(quads, _mm512_set1_epi32(-128))));
                // SAFETY: 8 b + 4 n + 4 <= h_bias.len(); the low four lanes, unaligned store.
                unsafe { _mm_storeu_si128(xi.h_bias.as_mut_ptr().add(8 * b + 4 * n) as *mut __m128i, _mm256_castsi256_si128(four)) };
            }
        }
    }

    #[target_feature(enable = "avx512vnni,avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub fn rows(blocks: &[u8], xi: &IntX, out: &mut [f32]) {
        let cols = xi.cols();
        let nb = cols / BLOCK;
        let row_bytes = nb * BLOCK_BYTES;
        assert!(blocks.len() == out.len() * row_bytes);
        let (d0, d1, d2) = (xi.digits.as_ptr(), xi.digits[cols..].as_ptr(), xi.digits[2 * cols..].as_ptr());
        let (zero, flip) = (_mm256_setzero_si256(), _mm256_set1_epi8(-128));
        // Block b's sums as f32 lanes: `256 m + l` (exact in i32: at most 2^25 in magnitude) and
        // `h` (to be scaled by 65536 once, at the end), with `d_b 2^e_b`.
        let block = |blk: &[u8], b: usize| {
            // SAFETY: 2 + 32 == blk.len(); 32 b + 32 <= cols for each digit row; 8 b + 8 <=
            // h_bias.len(); unaligned loads.
            let (q, l, m, h, bias) = unsafe {
                (
                    _mm256_loadu_si256(blk.as_ptr().add(2) as *const __m256i),
                    _mm256_loadu_si256(d0.add(BLOCK * b) as *const __m256i),
                    _mm256_loadu_si256(d1.add(BLOCK * b) as *const __m256i),
                    _mm256_loadu_si256(d2.add(BLOCK * b) as *const __m256i),
                    _mm256_loadu_si256(xi.h_bias.as_ptr().add(8 * b) as *const __m256i),
                )
            };
            let low = _mm256_add_epi32(_mm256_dpbusd_epi32(zero, l, q), _mm256_slli_epi32::<8>(_mm256_dpbusd_epi32(zero, m, q)));
            let high = _mm256_dpbusd_epi32(bias, _mm256_xor_si256(q, flip), h);
            let d = f16_to_f32(u16::from_le_bytes([blk[0], blk[1]])) * xi.scales[b];
            (_mm256_cvtepi32_ps(low), _mm256_cvtepi32_ps(high), _mm256_set1_ps(d))
        };
        for (r, o) in out.iter_mut().enumerate() {
            let row = &blocks[r * row_bytes..(r + 1) * row_bytes];
            // Even and odd blocks in their own accumulators: one would wait on the previous add.
            let (mut lo_even, mut hi_even, mut lo_odd, mut hi_odd) = (_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps());
            let pairs = row.chunks_exact(2 * BLOCK_BYTES);
            let last = pairs.remainder();
            for (k, pair) in pairs.enumerate() {
                let (lo, hi, d) = block(&pair[..BLOCK_BYTES], 2 * k);
                lo_even = _mm256_fmadd_ps(lo, d, lo_even);
                hi_even = _mm256_fmadd_ps(hi, d, hi_even);
                let (lo, hi, d) = block(&pair[BLOCK_BYTES..], 2 * k + 1);
                lo_odd = _mm256_fmadd_ps(lo, d, lo_odd);
                hi_odd = _mm256_fmadd_ps(hi, d, hi_odd);
            }
            if !last.is_empty() {
                let (lo, hi, d) = block(last, nb - 1);
                lo_even = _mm256_fmadd_ps(lo, d, lo_even);
                hi_even = _mm256_fmadd_ps(hi, d, hi_even);
            }
            let (even, odd) = (_mm256_fmadd_ps(hi_even, _mm256_set1_ps(65536.0), lo_even), _mm256_fmadd_ps(hi_odd, _mm256_set1_ps(65536.0), lo_odd));
            *o = sum8(_mm256_add_ps(even, odd));
        }
    }
}

/// One row's dot with `x` (`x.len()` a multiple of 32; `blocks` that row's blocks).
pub fn dot_row(blocks: &[u8], x: &[f32]) -> Result<f32, CodecError> {
    let mut out = [0.0f32];
    matvec_rows(blocks, x, &mut out)?;
    Ok(out[0])
}

/// `out[r]` = row `r`'s dot with `x` for `out.len()` rows of `x.len()` columns (pass the blocks of
/// a row range to compute part of a matrix). A row whose result is not finite has its scales
/// checked.
pub fn matvec_rows(blocks: &[u8], x: &[f32], out: &mut [f32]) -> Result<(), CodecError> {
    matvec_rows_on(Isa::best(), blocks, x, out)
}

/// [`matvec_rows`] on the kernels of `isa` (or the best this CPU runs below it); every level gives
/// the same bits.
pub fn matvec_rows_on(isa: Isa, blocks: &[u8], x: &[f32], out: &mut [f32]) -> Result<(), CodecError> {
    let n = elems(NAME, out.len(), x.len())?;
    check_blocks(NAME, BLOCK_BYTES, x.len(), x.len() / BLOCK * BLOCK_BYTES)?;
    check_blocks(NAME, BLOCK_BYTES, n, blocks.len())?;
    rows_dispatch(isa, blocks, x, out);
    check_nonfinite_rows(NAME, BLOCK_BYTES, &[0], blocks, x.len(), out)
}

/// Prefill: `outs[t][r]` = row `r`'s dot with token `t` of `x` (`[outs.len(), cols]` row-major), for
/// the rows in `blocks` (`outs[t].len()` each): what [`matvec_rows`] gives token by token, bit for
/// bit, register-tiled on AVX-512 (4 rows x 4 tokens: each block decoded once for 4 tokens).
pub fn matmul_rows(blocks: &[u8], x: &[f32], cols: usize, outs: &mut [&mut [f32]]) -> Result<(), CodecError> {
    matmul_rows_on(Isa::best(), blocks, x, cols, outs)
}

/// [`matmul_rows`] on the kernels of `isa` (or the best this CPU runs below it).
pub fn matmul_rows_on(isa: Isa, blocks: &[u8], x: &[f32], cols: usize, outs: &mut [&mut [f32]]) -> Result<(), CodecError> {
    let rows = outs.first().map_or(0, |o| o.len());
    check_len(NAME, "x", outs.len() * cols, x.len())?;
    check_blocks(NAME, BLOCK_BYTES, cols, cols / BLOCK * BLOCK_BYTES)?;
    check_blocks(NAME, BLOCK_BYTES, elems(NAME, rows, cols)?, blocks.len())?;
    for o in outs.iter() {
        check_len(NAME, "outputs", rows, o.len())?;
    }
    match isa.clamp() {
        // SAFETY: `clamp` returns a level this CPU runs.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::tiles(blocks, x, cols, outs) },
        _ => {
            for (xt, o) in x.chunks_exact(cols.max(1)).zip(outs.iter_mut()) {
                rows_dispatch(isa, blocks, xt, o);
            }
        }
    }
    for o in outs.iter() {
        check_nonfinite_rows(NAME, BLOCK_BYTES, &[0], blocks, cols, o)?;
    }
    Ok(())
}

/// For each row whose result is not finite: `Err(NonFinite)` naming the first block of that row
/// whose f16 scales (at `scale_offsets` in the block) are not finite.
pub(crate) fn check_nonfinite_rows(
    dtype: &'static str,
    block_bytes: usize,
    scale_offsets: &[usize],
    blocks: &[u8],
    cols: usize,
    out: &[f32],
) -> Result<(), CodecError> {
    let per_row = cols / BLOCK;
    for (r, o) in out.iter().enumerate() {
        if o.is_finite() {
            continue;
        }
        let row = &blocks[r * per_row * block_bytes..(r + 1) * per_row * block_bytes];
        for (i, b) in row.chunks_exact(block_bytes).enumerate() {
            if scale_offsets.iter().any(|&at| !rd_f16(b, at).is_finite()) {
                return Err(CodecError::NonFinite {
                    dtype,
                    block: (r * per_row + i) as u64,
                });
            }
        }
    }
    Ok(())
}

/// Bytes of [`split_blocks`]'s output for `n` blocks.
pub fn split_len(n: usize) -> usize {
    (n * 32).next_multiple_of(64) + 2 * n
}

/// GGUF Q8_0 blocks (`d` f16, then 32 int8: 34 bytes each) split for the GPU kernels, which load
/// 16 values at a time and need them 16-byte aligned: every block's 32 int8 values in order, then
/// (from the next multiple of 64 bytes) every block's f16 `d` in order. The same bytes, moved.
pub fn split_blocks(blocks: &[u8]) -> Result<Vec<u8>, CodecError> {
    if blocks.len() % BLOCK_BYTES != 0 {
        return Err(CodecError::PartialBlock { dtype: NAME, count: blocks.len() as u64, block_elems: BLOCK_BYTES as u64 });
    }
    let n = blocks.len() / BLOCK_BYTES;
    let scales_at = (n * 32).next_multiple_of(64);
    let mut out = vec![0u8; split_len(n)];
    for (k, b) in blocks.chunks_exact(BLOCK_BYTES).enumerate() {
        out[32 * k..32 * k + 32].copy_from_slice(&b[2..]);
        out[scales_at + 2 * k..scales_at + 2 * k + 2].copy_from_slice(&b[..2]);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_bits().to_le_bytes()
    }

    #[test]
    fn matmul_tiles_equal_token_by_token_matvec_bit_for_bit() {
        // 6 rows (a 4-row tile and 2 single rows) x 96 columns, 6 tokens (a 4-token tile and 2).
        let (rows, cols, tokens) = (6usize, 96usize, 6usize);
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 211) as f32 - 105.0) / 17.0).collect();
        let mut blocks = vec![0u8; rows * cols / BLOCK * BLOCK_BYTES];
        quantize_row(&w, &mut blocks).unwrap();
        let x: Vec<f32> = (0..tokens * cols).map(|i| ((i * 104729 % 97) as f32 - 48.0) / 9.0).collect();
        let mut want = vec![0.0; tokens * rows];
        for (xt, o) in x.chunks_exact(cols).zip(want.chunks_exact_mut(rows)) {
            matvec_rows_on(Isa::Portable, &blocks, xt, o).unwrap();
        }
        for isa in Isa::supported() {
            let mut got = vec![0.0; tokens * rows];
            let mut outs: Vec<&mut [f32]> = got.chunks_exact_mut(rows).collect();
            matmul_rows_on(isa, &blocks, &x, cols, &mut outs).unwrap();
            assert_eq!(got, want, "{isa:?}");
        }
        // A NaN scale is named, as matvec_rows names it.
        blocks[BLOCK_BYTES * 4..BLOCK_BYTES * 4 + 2].copy_from_slice(&h(f32::NAN));
        let mut got = vec![0.0; tokens * rows];
        let mut outs: Vec<&mut [f32]> = got.chunks_exact_mut(rows).collect();
        assert_eq!(matmul_rows(&blocks, &x, cols, &mut outs), Err(CodecError::NonFinite { dtype: NAME, block: 4 }));
    }

    #[test]
    fn hand_block() {
        let mut b = h(0.5).to_vec();
        for i in 0..32 {
            b.push((i as i8 - 16) as u8);
        }
        let mut out = [0f32; 32];
        dequantize_row(&b, &mut out).unwrap();
        for (i, &o) in out.iter().enumerate() {
            assert_eq!(o, (i as f32 - 16.0) * 0.5);
        }
        // dot with x = 1: 0.5 * sum(i - 16) = 0.5 * -16 = -8
        assert_eq!(dot_row(&b, &[1.0; 32]).unwrap(), -8.0);
        b[0..2].copy_from_slice(&h(f32::INFINITY));
        assert!(matches!(dot_row(&b, &[1.0; 32]), Err(CodecError::NonFinite { block: 0, .. })));
        assert!(matches!(dequantize_row(&b, &mut out), Err(CodecError::NonFinite { block: 0, .. })));
    }

    #[test]
    fn quantize_like_ggml_ref() {
        // amax 127 -> d = 1; 2.5 rounds away from zero to 3, -2.5 to -3 (roundf), 0.49 to 0.
        let mut x = [0.0f32; 32];
        x[..5].copy_from_slice(&[127.0, 2.5, -2.5, 0.49, -127.0]);
        let mut b = [0u8; 34];
        quantize_row(&x, &mut b).unwrap();
        assert_eq!(&b[..2], &h(1.0));
        assert_eq!(&b[2..7], &[127, 3, (-3i8) as u8, 0, (-127i8) as u8]);
        // An all-zero block: d = 0, qs = 0.
        quantize_row(&[0.0; 32], &mut b).unwrap();
        assert_eq!(b, [0u8; 34]);
        assert!(matches!(quantize_row(&[1e7; 32], &mut b), Err(CodecError::NonFinite { block: 0, .. })));
        assert!(matches!(quantize_row(&[0.0; 31], &mut b), Err(CodecError::PartialBlock { .. })));
    }

    #[test]
    fn sizes_and_lengths() {
        assert_eq!(sizes(3, 64).unwrap(), Sizes { values: 3 * 2 * 34, scales: 0 });
        assert!(matches!(sizes(3, 40), Err(CodecError::PartialBlock { .. })));
        assert!(matches!(sizes(u64::MAX / 2, 64), Err(CodecError::Overflow { .. })));
        let mut out = [0f32; 2];
        assert!(matches!(matvec_rows(&[0u8; 34], &[1.0; 32], &mut out), Err(CodecError::Length { what: "bytes", .. })));
        assert!(matches!(matvec_rows(&[0u8; 34], &[1.0; 31], &mut out[..1]), Err(CodecError::PartialBlock { .. })));
    }

    #[test]
    fn every_kernel_agrees() {
        // 7 rows: more than one pass of any rows-per-pass up to four.
        let (rows, cols) = (7, 96);
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 53 % 41) as f32 - 20.0) * 0.031 * (1 + i % 7) as f32).collect();
        let x: Vec<f32> = (0..cols).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.173).collect();
        let mut b = vec![0u8; rows * cols / BLOCK * BLOCK_BYTES];
        quantize_row(&w, &mut b).unwrap();
        let (mut fast, mut portable) = (vec![0f32; rows], vec![0f32; rows]);
        matvec_rows(&b, &x, &mut fast).unwrap();
        rows_body(&b, &x, &mut portable);
        assert_eq!(fast, portable, "the best kernel sums in the portable order");
        for isa in Isa::supported() {
            let mut o = vec![0f32; rows];
            matvec_rows_on(isa, &b, &x, &mut o).unwrap();
            assert_eq!(o, portable, "{isa:?} sums in the portable order");
        }
        let mut deq = vec![0f32; rows * cols];
        dequantize(&b, cols, &mut deq).unwrap();
        for r in 0..rows {
            let row = &deq[r * cols..(r + 1) * cols];
            let exact: f64 = row.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
            let mag: f64 = row.iter().zip(&x).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
            assert!((fast[r] as f64 - exact).abs() <= 1e-6 * mag, "row {r}");
        }
    }

    #[test]
    fn int_x_holds_x_to_2_pow_minus_23_of_each_block_max() {
        // Blocks: spread over ten binades, all zero, one tiny (subnormal range), a NaN.
        let mut x: Vec<f32> = (0..32).map(|i| ((i * 37 % 23) as f32 - 11.0) * 2f32.powi(i % 10 - 5)).collect();
        x.extend([0.0; 32]);
        x.extend((0..32).map(|i| (i as f32 - 16.0) * 1e-40));
        x.extend((0..32).map(|i| if i == 7 { f32::NAN } else { 1.0 }));
        let xi = IntX::new(&x);
        assert_eq!(xi.cols(), 128);
        assert_eq!(xi.scales[1], 0.0);
        assert!(xi.scales[3].is_nan());
        for (b, xb) in x.chunks_exact(BLOCK).enumerate().take(3) {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
            for (i, &v) in xb.iter().enumerate() {
                let j = b * BLOCK + i;
                let big = xi.digits[j] as i64 | (xi.digits[128 + j] as i64) << 8 | (xi.digits[256 + j] as i8 as i64) << 16;
                let back = big as f64 * xi.scales[b] as f64;
                assert!((back - v as f64).abs() <= amax * 2f64.powi(-23), "block {b} element {i}: {back} for {v}");
            }
        }
    }

    #[test]
    fn int_x_vector_and_scalar_write_the_same_bytes() {
        // Ties (x * 2^(22 - e) = k + 0.5), the top value rounding up to 2^23, one lane per binade,
        // tiny and subnormal blocks, an infinity, zeros.
        let mut x: Vec<f32> = vec![1.0, 1.0 + 2f32.powi(-23), -1.5 - 2f32.powi(-22), 2.0 - 2f32.powi(-23)];
        x.extend((4..32).map(|i| 2f32.powi(i - 20) * if i % 2 == 0 { 1.0 } else { -1.3 }));
        x.extend((0..32).map(|i| (i as f32 - 15.5) * 2f32.powi(-104)));
        x.extend((0..32).map(|i| (i as f32 - 15.5) * 2f32.powi(-110)));
        x.extend((0..32).map(|i| if i == 3 { f32::INFINITY } else { 0.5 }));
        x.extend([0.0; 32]);
        x.extend((0..64).map(|i| ((i * 7919 % 211) as f32 - 105.0) / 17.0));
        let mut scalar = IntX { digits: vec![0; 3 * x.len()], scales: vec![0.0; x.len() / BLOCK], h_bias: vec![0; x.len() / BLOCK * 8] };
        for (b, xb) in x.chunks_exact(BLOCK).enumerate() {
            scalar.set_block(b, xb);
        }
        let got = IntX::new(&x);
        assert_eq!(got.digits, scalar.digits);
        assert_eq!(got.h_bias, scalar.h_bias);
        assert_eq!(format!("{:?}", got.scales), format!("{:?}", scalar.scales));
    }

    #[test]
    fn int_dot_is_within_1e_4_of_the_exact_kernels() {
        // 9 rows x 576 columns (SmolLM2's), weights and x over several binades, one all-zero x block.
        let (rows, cols) = (9, 576);
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 211) as f32 - 105.0) / 17.0 * 2f32.powi((i % 5) as i32 - 2)).collect();
        let mut b = vec![0u8; rows * cols / BLOCK * BLOCK_BYTES];
        quantize_row(&w, &mut b).unwrap();
        let mut x: Vec<f32> = (0..cols).map(|i| ((i * 104729 % 97) as f32 - 48.0) / 9.0 * 2f32.powi((i % 7) as i32 - 3)).collect();
        x[64..96].iter_mut().for_each(|v| *v = 0.0);
        let (mut exact, mut int) = (vec![0f32; rows], vec![0f32; rows]);
        matvec_rows_on(Isa::Avx512, &b, &x, &mut exact).unwrap();
        matvec_rows_int(&b, &IntX::new(&x), &x, &mut int).unwrap();
        let mut deq = vec![0f32; rows * cols];
        dequantize(&b, cols, &mut deq).unwrap();
        for r in 0..rows {
            let mag: f64 = deq[r * cols..(r + 1) * cols].iter().zip(&x).map(|(&a, &v)| (a as f64 * v as f64).abs()).sum();
            let err = (int[r] as f64 - exact[r] as f64).abs() / mag;
            assert!(err <= 1e-4, "row {r}: {} against {} ({err:.2e} of sum |wx|)", int[r], exact[r]);
            if Isa::best().int8_dot() {
                // Far inside the bound: one rounding of x to 24 bits and of each block's sum.
                assert!(err <= 1e-6, "row {r}: {err:.2e}");
            }
        }
        // A NaN in x gives a NaN row, as the exact kernels do (x's fault: not an error).
        x[100] = f32::NAN;
        matvec_rows_int(&b, &IntX::new(&x), &x, &mut int).unwrap();
        assert!(int.iter().all(|v| v.is_nan()));
        // A NaN scale is named.
        let mut bad = b.clone();
        bad[BLOCK_BYTES * 20..BLOCK_BYTES * 20 + 2].copy_from_slice(&h(f32::NAN));
        x[100] = 1.0;
        assert_eq!(matvec_rows_int(&bad, &IntX::new(&x), &x, &mut int), Err(CodecError::NonFinite { dtype: NAME, block: 20 }));
        // Shapes: an IntX of another length, a partial block.
        assert!(matches!(matvec_rows_int(&b, &IntX::new(&x[..544]), &x, &mut int), Err(CodecError::Length { .. })));
        assert!(matches!(matvec_rows_int(&b[..34], &IntX::new(&x[..32]), &x[..40], &mut int[..1]), Err(CodecError::PartialBlock { .. })));
    }

    #[test]
    fn split_blocks_moves_values_then_scales() {
        // Three blocks: d = 1.0, 2.0, -0.5 (f16 0x3c00, 0x4000, 0xb800), values k*3 + i.
        let ds = [0x3c00u16, 0x4000, 0xb800];
        let mut blocks = Vec::new();
        for (k, d) in ds.iter().enumerate() {
            blocks.extend(d.to_le_bytes());
            blocks.extend((0..32).map(|i| (k as u8 * 3).wrapping_add(i)));
        }
        let out = split_blocks(&blocks).unwrap();
        assert_eq!(out.len(), 128 + 6, "96 values padded to 128, then 3 scales");
        for k in 0..3 {
            assert_eq!(&out[32 * k..32 * k + 32], &blocks[34 * k + 2..34 * k + 34]);
            assert_eq!(u16::from_le_bytes([out[128 + 2 * k], out[129 + 2 * k]]), ds[k]);
        }
        assert!(out[96..128].iter().all(|&b| b == 0));
        assert!(matches!(split_blocks(&blocks[..33]), Err(CodecError::PartialBlock { .. })));
    }
}
