//! MXFP4 weights (OCP Microscaling Formats v1.0): e2m1 values, one e8m0 scale per 32 consecutive
//! values of a row, and an optional BF16 postscale per output row.
//!
//! Layout of a `[rows, cols]` matrix (`cols` a multiple of 32), split so a GPU reads each part
//! coalesced:
//! - `values`: `rows * cols / 2` bytes, row-major; byte `i` of a row holds element `2i` in its low
//!   nibble and element `2i + 1` in its high nibble. (ggml's `block_mxfp4` differs: per block, one
//!   `e` byte then `qs[16]` with element `j` in the low nibble of `qs[j]` and element `j + 16` in
//!   its high nibble; the 4-bit codes themselves are the same. [`from_ggml_blocks`] repacks.)
//! - `scales`: `rows * cols / 32` e8m0 bytes, row-major, scale `b` of a row for its elements
//!   `32b .. 32b + 32`; e8m0 `e` is `2^(e - 127)`, 0xFF (NaN) is never written nor accepted.
//! - `postscale` (optional): `rows` bf16, multiplying each row's dot (and each dequantized element)
//!   after the block scales.
//!
//! Element `(r, c)` is `(decode_e2m1(code) * decode_e8m0(scale)) * postscale[r]`.
//!
//! Quantization follows the OCP spec: per block `shared_exp = floor(log2(amax)) - 2` (2 = emax of
//! e2m1), clamped to e8m0's `[-127, 127]`, an all-zero block gets e8m0 0 (as ggml); `floor(log2)`
//! is read from the f32's exponent bits, exactly (ggml's `floorf(log2f(amax))` can round up just
//! below a power of two). Values are `x / 2^shared_exp` rounded to the nearest e2m1, ties to even,
//! saturating to ±6 (the rule puts up to `8 - ε` in a block's top binade). ggml's
//! `quantize_row_mxfp4_ref` picks the nearest code with ties to the lower index instead, so the
//! two differ only on exact ties and on the sign of values that round to zero.
//!
//! Postscale ([`quantize_with_postscale`]): after MX quantization of the row to `q`, the `p` that
//! minimises `|w - p q|^2`, `p = <w, q> / <q, q>` (f64 sums in element order, rounded to f32, then
//! to bf16 ties to even); `p = 1` when `<q, q> = 0`, when `<w, q> <= 0` or when the bf16 is not
//! finite and positive. It recovers the row's mean shrinkage from the power-of-two scales; [`quantize`] writes no
//! postscale (callers that want one stored without fitting store `1.0`).

use super::{check_len, elems, reduce, CodecError, Isa, Sizes, BLOCK, LANES};
use half::bf16;

const NAME: &str = "mxfp4";

/// Largest e2m1 magnitude.
pub const E2M1_MAX: f32 = 6.0;

/// The e8m0 NaN, never written nor accepted.
pub const E8M0_NAN: u8 = 0xFF;

/// The value of an e2m1 code (low 4 bits of `code`): sign bit 3, then `{0, 0.5, 1, 1.5, 2, 3, 4,
/// 6}`. Exact, table-free and without subnormal intermediates, so it vectorizes.
#[inline(always)]
pub fn decode_e2m1(code: u8) -> f32 {
    let c = (code & 7) as u32;
    let sign = ((code & 8) as u32) << 28;
    let bits = if c < 2 {
        (c as f32 * 0.5).to_bits()
    } else {
        // e2m1's exponent and mantissa dropped into an f32's, the bias moved from 1 to 127.
        (c << 22) + (126 << 23)
    };
    f32::from_bits(bits | sign)
}

/// The e2m1 code nearest to `x`, ties to even, saturating to ±6 (infinity too). The sign is kept,
/// also for values that round to zero; a NaN gives a zero of its sign (the quantizers never pass
/// one).
#[inline]
pub fn encode_e2m1(x: f32) -> u8 {
    let sign = ((x.to_bits() >> 28) & 8) as u8;
    let a = x.abs();
    // Midpoints between neighbours; at a tie the code with the even mantissa (the even code) wins.
    let c = (a > 0.25) as u8
        + (a >= 0.75) as u8
        + (a > 1.25) as u8
        + (a >= 1.75) as u8
        + (a > 2.5) as u8
        + (a >= 3.5) as u8
        + (a > 5.0) as u8;
    sign | c
}

/// `2^(e - 127)` (exact, `e = 0` is the f32 subnormal `2^-127`); 0xFF gives NaN.
#[inline(always)]
pub fn decode_e8m0(e: u8) -> f32 {
    match e {
        E8M0_NAN => f32::NAN,
        0 => f32::from_bits(0x0040_0000),
        e => f32::from_bits((e as u32) << 23),
    }
}

/// The OCP shared scale of a block whose largest magnitude is `amax` (finite, >= 0):
/// `floor(log2(amax)) - 2` clamped to `[-127, 127]`, as e8m0; 0 for `amax == 0`.
pub fn shared_scale(amax: f32) -> u8 {
    let b = amax.to_bits() & 0x7FFF_FFFF;
    if b == 0 {
        return 0;
    }
    let floor_log2 = if b < 0x0080_0000 {
        // Subnormal: m * 2^-149.
        (31 - b.leading_zeros()) as i32 - 149
    } else {
        (b >> 23) as i32 - 127
    };
    ((floor_log2 - 2).clamp(-127, 127) + 127) as u8
}

/// Bytes of a `[rows, cols]` MXFP4 matrix: `rows * cols / 2` of values and `rows * cols / 32` of
/// scales (the optional postscale is `2 * rows` more). `cols` must be a multiple of 32.
pub fn sizes(rows: u64, cols: u64) -> Result<Sizes, CodecError> {
    if !cols.is_multiple_of(BLOCK as u64) {
        return Err(CodecError::PartialBlock {
            dtype: NAME,
            count: cols,
            block_elems: BLOCK as u64,
        });
    }
    let n = rows.checked_mul(cols).ok_or(CodecError::Overflow { dtype: NAME, rows, cols })?;
    Ok(Sizes {
        values: n / 2,
        scales: n / BLOCK as u64,
    })
}

fn check_cols(cols: usize) -> Result<(), CodecError> {
    if cols.is_multiple_of(BLOCK) {
        Ok(())
    } else {
        Err(CodecError::PartialBlock {
            dtype: NAME,
            count: cols as u64,
            block_elems: BLOCK as u64,
        })
    }
}

/// Checks the buffers of a `[rows, cols]` matrix.
fn check_shape(rows: usize, cols: usize, values: usize, scales: usize, postscale: Option<usize>) -> Result<(), CodecError> {
    check_cols(cols)?;
    let n = elems(NAME, rows, cols)?;
    check_len(NAME, "values", n / 2, values)?;
    check_len(NAME, "scales", n / BLOCK, scales)?;
    if let Some(p) = postscale {
        check_len(NAME, "postscales", rows, p)?;
    }
    Ok(())
}

/// `Err(NanE8m0)` for the first 0xFF scale; `first_block` is the index of `scales[0]`.
pub fn check_scales(scales: &[u8], first_block: usize) -> Result<(), CodecError> {
    match scales.iter().position(|&e| e == E8M0_NAN) {
        None => Ok(()),
        Some(b) => Err(CodecError::NanE8m0 {
            dtype: NAME,
            block: (first_block + b) as u64,
        }),
    }
}

/// `Err(RowScale)` for the first postscale that is not finite and > 0.
pub fn check_postscales(postscale: &[bf16]) -> Result<(), CodecError> {
    match postscale.iter().position(|p| !(p.is_finite() && p.to_f32() > 0.0)) {
        None => Ok(()),
        Some(row) => Err(CodecError::RowScale {
            dtype: NAME,
            row: row as u64,
            scale: postscale[row].to_f32(),
        }),
    }
}

/// Quantizes one row (`x.len()` a multiple of 32) into `values` (`x.len() / 2`) and `scales`
/// (`x.len() / 32`).
pub fn quantize_row(x: &[f32], values: &mut [u8], scales: &mut [u8]) -> Result<(), CodecError> {
    quantize_row_at(x, values, scales, 0)
}

fn quantize_row_at(x: &[f32], values: &mut [u8], scales: &mut [u8], first_index: usize) -> Result<(), CodecError> {
    check_shape(1, x.len(), values.len(), scales.len(), None)?;
    for (b, ((xb, vb), e)) in x.chunks_exact(BLOCK).zip(values.chunks_exact_mut(BLOCK / 2)).zip(scales.iter_mut()).enumerate() {
        let mut amax = 0.0f32;
        for (i, &v) in xb.iter().enumerate() {
            if !v.is_finite() {
                return Err(CodecError::NonFiniteInput {
                    dtype: NAME,
                    index: (first_index + b * BLOCK + i) as u64,
                    value: v,
                });
            }
            amax = amax.max(v.abs());
        }
        *e = shared_scale(amax);
        // 1 / 2^k is exact, and x * 2^-k rounds like x / 2^k.
        let inv = 1.0 / decode_e8m0(*e);
        for (q, pair) in vb.iter_mut().zip(xb.chunks_exact(2)) {
            *q = encode_e2m1(pair[0] * inv) | (encode_e2m1(pair[1] * inv) << 4);
        }
    }
    Ok(())
}

/// Quantizes a row-major `[rows, cols]` matrix without a postscale.
pub fn quantize(x: &[f32], cols: usize, values: &mut [u8], scales: &mut [u8]) -> Result<(), CodecError> {
    check_cols(cols)?;
    if cols == 0 {
        return Ok(());
    }
    let rows = x.len() / cols;
    check_len(NAME, "x", elems(NAME, rows, cols)?, x.len())?;
    check_shape(rows, cols, values.len(), scales.len(), None)?;
    for (r, ((xr, vr), sr)) in x
        .chunks_exact(cols)
        .zip(values.chunks_exact_mut(cols / 2))
        .zip(scales.chunks_exact_mut(cols / BLOCK))
        .enumerate()
    {
        quantize_row_at(xr, vr, sr, r * cols)?;
    }
    Ok(())
}

/// Quantizes like [`quantize`] (`rows = postscale.len()`) and fits each row's postscale (see the
/// module doc).
pub fn quantize_with_postscale(
    x: &[f32],
    cols: usize,
    values: &mut [u8],
    scales: &mut [u8],
    postscale: &mut [bf16],
) -> Result<(), CodecError> {
    let rows = postscale.len();
    check_len(NAME, "x", elems(NAME, rows, cols)?, x.len())?;
    quantize(x, cols, values, scales)?;
    if cols == 0 {
        postscale.fill(bf16::ONE);
        return Ok(());
    }
    for (r, p) in postscale.iter_mut().enumerate() {
        let (vr, sr) = (&values[r * cols / 2..(r + 1) * cols / 2], &scales[r * cols / BLOCK..(r + 1) * cols / BLOCK]);
        let (mut wq, mut qq) = (0.0f64, 0.0f64);
        for (c, &w) in x[r * cols..(r + 1) * cols].iter().enumerate() {
            let q = element(vr, sr, c);
            wq += w as f64 * q as f64;
            qq += q as f64 * q as f64;
        }
        let fit = bf16::from_f32((wq / qq) as f32);
        *p = if qq > 0.0 && wq > 0.0 && fit.is_finite() && fit.to_f32() > 0.0 { fit } else { bf16::ONE };
    }
    Ok(())
}

/// Element `c` of a row without postscale: `decode_e2m1(code) * decode_e8m0(scale)`.
#[inline(always)]
fn element(values: &[u8], scales: &[u8], c: usize) -> f32 {
    let code = values[c / 2] >> (4 * (c % 2));
    decode_e2m1(code) * decode_e8m0(scales[c / BLOCK])
}

/// Dequantizes one row: `out.len()` (a multiple of 32) elements from `values` and `scales`,
/// multiplied by `postscale` when given.
pub fn dequantize_row(values: &[u8], scales: &[u8], postscale: Option<bf16>, out: &mut [f32]) -> Result<(), CodecError> {
    let ps = postscale.as_ref().map(std::slice::from_ref);
    dequantize(values, scales, ps, out.len(), out)
}

/// Dequantizes a `[rows, cols]` matrix (`rows = out.len() / cols`) into `out`; with `postscale`
/// (`rows` bf16) every element of row `r` is multiplied by `postscale[r]` last.
pub fn dequantize(values: &[u8], scales: &[u8], postscale: Option<&[bf16]>, cols: usize, out: &mut [f32]) -> Result<(), CodecError> {
    check_cols(cols)?;
    if cols == 0 {
        return check_len(NAME, "outputs", 0, out.len());
    }
    let rows = out.len() / cols;
    check_len(NAME, "outputs", elems(NAME, rows, cols)?, out.len())?;
    check_shape(rows, cols, values.len(), scales.len(), postscale.map(<[bf16]>::len))?;
    check_scales(scales, 0)?;
    if let Some(p) = postscale {
        check_postscales(p)?;
    }
    for (b, ((o, v), &e)) in out.chunks_exact_mut(BLOCK).zip(values.chunks_exact(BLOCK / 2)).zip(scales).enumerate() {
        let s = decode_e8m0(e);
        let p = postscale.map(|p| p[b * BLOCK / cols].to_f32());
        for (pair, &byte) in o.chunks_exact_mut(2).zip(v) {
            pair[0] = decode_e2m1(byte) * s;
            pair[1] = decode_e2m1(byte >> 4) * s;
            if let Some(p) = p {
                pair[0] *= p;
                pair[1] *= p;
            }
        }
    }
    Ok(())
}

/// `sum_b scale_b * sum_{i in b} e2m1_i * x_i` in the codecs' lane order, without the postscale:
/// lane `l` of a block is `e2m1(lo) * x_{2l} + e2m1(hi) * x_{2l+1}` for the two nibbles of the
/// block's byte `l`, times the block scale, added to the row's lane `l`.
#[inline(always)]
fn dot_unscaled(values: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    for ((v, &e), xb) in values.chunks_exact(BLOCK / 2).zip(scales).zip(x.chunks_exact(BLOCK)) {
        let s = decode_e8m0(e);
        for l in 0..LANES {
            let t = decode_e2m1(v[l]) * xb[2 * l] + decode_e2m1(v[l] >> 4) * xb[2 * l + 1];
            acc[l] += t * s;
        }
    }
    reduce(acc)
}

#[inline(always)]
fn rows_body(values: &[u8], scales: &[u8], x: &[f32], out: &mut [f32]) {
    let cols = x.len();
    for (r, o) in out.iter_mut().enumerate() {
        let v = &values[r * cols / 2..(r + 1) * cols / 2];
        let s = &scales[r * cols / BLOCK..(r + 1) * cols / BLOCK];
        *o = dot_unscaled(v, s, x);
    }
}

fn rows_dispatch(isa: Isa, values: &[u8], scales: &[u8], x: &[f32], out: &mut [f32]) {
    match isa.clamp() {
        // SAFETY: `clamp` returns a level this CPU runs.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::rows(values, scales, x, out) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::rows(values, scales, x, out) },
        _ => rows_body(values, scales, x, out),
    }
}

/// AVX2: as ggml's CPU kernel, a byte shuffle maps each nibble to twice its e2m1 value as an i8;
/// widened to f32 and halved (exact) it is the e2m1 value. Lanes 0..8 (bytes 0..8, elements
/// 0..16) and 8..16 are two registers; `x`'s even and odd elements are split with shuffles.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::x86::sum16_256;
    use super::super::BLOCK;
    use super::decode_e8m0;
    use std::arch::x86_64::*;

    /// Elements `2l` and `2l + 1` (l < 8) of the 16 floats at `p`, as (even, odd).
    ///
    /// # Safety
    /// `p` must point to 16 readable f32.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn even_odd(p: *const f32) -> (__m256, __m256) {
        // SAFETY: the caller guarantees 16 readable f32; unaligned loads.
        let (a, b) = unsafe { (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))) };
        // Per 128-bit half: [a0 a2 b0 b2 | a4 a6 b4 b6]; then the 64-bit pairs in order.
        let even = _mm256_shuffle_ps::<0b10_00_10_00>(a, b);
        let odd = _mm256_shuffle_ps::<0b11_01_11_01>(a, b);
        let fix = |v: __m256| _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(v)));
        (fix(even), fix(odd))
    }

    #[target_feature(enable = "avx2")]
    pub fn rows(values: &[u8], scales: &[u8], x: &[f32], out: &mut [f32]) {
        let cols = x.len();
        let nb = cols / BLOCK;
        let doubled = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
        let (m0f, half) = (_mm_set1_epi8(0x0F), _mm256_set1_ps(0.5));
        let wide = |c: __m128i| _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), half);
        for (r, o) in out.iter_mut().enumerate() {
            let v = &values[r * cols / 2..(r + 1) * cols / 2];
            let s = &scales[r * nb..(r + 1) * nb];
            let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            for (b, &e) in s.iter().enumerate() {
                // SAFETY: 16b + 16 <= v.len(); 32b + 32 <= x.len(); unaligned loads.
                let (q, (xe0, xo0), (xe1, xo1)) = unsafe {
                    let p = x.as_ptr().add(BLOCK * b);
                    (_mm_loadu_si128(v.as_ptr().add(16 * b) as *const __m128i), even_odd(p), even_odd(p.add(16)))
                };
                let lo = _mm_shuffle_epi8(doubled, _mm_and_si128(q, m0f));
                let hi = _mm_shuffle_epi8(doubled, _mm_and_si128(_mm_srli_epi16::<4>(q), m0f));
                let sc = _mm256_set1_ps(decode_e8m0(e));
                let t0 = _mm256_add_ps(_mm256_mul_ps(wide(lo), xe0), _mm256_mul_ps(wide(hi), xo0));
                let t1 = _mm256_add_ps(_mm256_mul_ps(wide(_mm_srli_si128::<8>(lo)), xe1), _mm256_mul_ps(wide(_mm_srli_si128::<8>(hi)), xo1));
                a0 = _mm256_add_ps(a0, _mm256_mul_ps(t0, sc));
                a1 = _mm256_add_ps(a1, _mm256_mul_ps(t1, sc));
            }
            *o = sum16_256(a0, a1);
        }
    }
}

/// AVX-512: a block's 16 bytes widened to 16 lanes; a lane permute of a 16-entry f32 table (which
/// reads only an index's low 4 bits) decodes the low nibbles, and after a shift the high ones.
/// `R` rows at a time share `x`'s even/odd split.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::super::x86::{call_tile, sum16_512, tile_walk};
    use super::super::BLOCK;
    use super::decode_e8m0;
    use std::arch::x86_64::*;

    /// Rows per pass. One: with more, the rows' interleaved reads defeat the hardware prefetcher
    /// on weights streamed from DRAM (four rows at a time, measured at 49152 x 576: 2-4x slower
    /// from DRAM, though 1.1-1.6x faster with the weights in L2).
    const R: usize = 1;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub fn rows(values: &[u8], scales: &[u8], x: &[f32], out: &mut [f32]) {
        let nb = x.len() / BLOCK;
        let (rows, mut r) = (out.len(), 0);
        while r < rows {
            let k = if r + R <= rows { R } else { 1 };
            let (v, s) = (&values[r * nb * 16..(r + k) * nb * 16], &scales[r * nb..(r + k) * nb]);
            if k == R {
                group::<R>(v, s, x, &mut out[r..r + R]);
            } else {
                group::<1>(v, s, x, &mut out[r..r + 1]);
            }
            r += k;
        }
    }

    /// `outs[t][r]` for every row in `values`/`scales` and token in `x`, in tiles of 4 rows x 4
    /// tokens (no postscale).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub fn tiles(values: &[u8], scales: &[u8], x: &[f32], cols: usize, outs: &mut [&mut [f32]]) {
        let nb = cols / BLOCK;
        let (rows, tokens) = (outs.first().map_or(0, |o| o.len()), outs.len());
        for (r, nr, t, nt) in tile_walk(rows, tokens) {
            let (v, s, xt) = (&values[r * nb * 16..(r + nr) * nb * 16], &scales[r * nb..(r + nr) * nb], &x[t * cols..(t + nt) * cols]);
            call_tile!(tile, nr, nt, (v, s, xt, cols, &mut outs[t..t + nt], r));
        }
    }

    /// `outs[t][r0 + n]` for the `R` rows and the `T` tokens: [`group`]'s operations per (row,
    /// token), each block's codes and scale decoded once per tile, each token's even/odd split once.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    fn tile<const R: usize, const T: usize>(values: &[u8], scales: &[u8], x: &[f32], cols: usize, outs: &mut [&mut [f32]], r0: usize) {
        let nb = cols / BLOCK;
        assert!(values.len() == R * nb * 16 && scales.len() == R * nb && x.len() == T * cols && outs.len() == T);
        let table = _mm512_setr_ps(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0);
        let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
        let mut acc = [[_mm512_setzero_ps(); R]; T];
        for b in 0..nb {
            let mut w = [[_mm512_setzero_ps(); 3]; R];
            for (n, w) in w.iter_mut().enumerate() {
                // SAFETY: (n * nb + b) * 16 + 16 <= values.len() (asserted shape); unaligned load.
                let q = unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(values.as_ptr().add((n * nb + b) * 16) as *const __m128i)) };
                *w = [_mm512_permutexvar_ps(q, table), _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(q), table), _mm512_set1_ps(decode_e8m0(scales[n * nb + b]))];
            }
            for (t, a) in acc.iter_mut().enumerate() {
                // SAFETY: t * cols + 32b + 32 <= x.len() (asserted shape); unaligned loads.
                let (xa, xb) = unsafe { (_mm512_loadu_ps(x.as_ptr().add(t * cols + BLOCK * b)), _mm512_loadu_ps(x.as_ptr().add(t * cols + BLOCK * b + 16))) };
                let (xe, xo) = (_mm512_permutex2var_ps(xa, even, xb), _mm512_permutex2var_ps(xa, odd, xb));
                for (a, [lo, hi, sc]) in a.iter_mut().zip(&w) {
                    let t = _mm512_add_ps(_mm512_mul_ps(*lo, xe), _mm512_mul_ps(*hi, xo));
                    *a = _mm512_add_ps(*a, _mm512_mul_ps(t, *sc));
                }
            }
        }
        for (a, o) in acc.iter().zip(outs.iter_mut()) {
            for (n, &a) in a.iter().enumerate() {
                o[r0 + n] = sum16_512(a);
            }
        }
    }

    /// `out[i]` for the `N` rows in `values` and `scales`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    fn group<const N: usize>(values: &[u8], scales: &[u8], x: &[f32], out: &mut [f32]) {
        let nb = x.len() / BLOCK;
        assert!(values.len() == N * nb * 16 && scales.len() == N * nb && out.len() == N);
        let table = _mm512_setr_ps(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0);
        let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
        let mut acc = [_mm512_setzero_ps(); N];
        for b in 0..nb {
            // SAFETY: 32b + 32 <= x.len(); unaligned loads.
            let (xa, xb) = unsafe { (_mm512_loadu_ps(x.as_ptr().add(BLOCK * b)), _mm512_loadu_ps(x.as_ptr().add(BLOCK * b + 16))) };
            let (xe, xo) = (_mm512_permutex2var_ps(xa, even, xb), _mm512_permutex2var_ps(xa, odd, xb));
            for (n, a) in acc.iter_mut().enumerate() {
                // SAFETY: (n * nb + b) * 16 + 16 <= values.len() (asserted shape); unaligned load.
                let q = unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(values.as_ptr().add((n * nb + b) * 16) as *const __m128i)) };
                let lo = _mm512_permutexvar_ps(q, table);
                let hi = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(q), table);
                let sc = _mm512_set1_ps(decode_e8m0(scales[n * nb + b]));
                let t = _mm512_add_ps(_mm512_mul_ps(lo, xe), _mm512_mul_ps(hi, xo));
                *a = _mm512_add_ps(*a, _mm512_mul_ps(t, sc));
            }
        }
        for (o, a) in out.iter_mut().zip(acc) {
            *o = sum16_512(a);
        }
    }
}

/// One row's dot: `postscale * sum_b scale_b * sum_{i in b} e2m1_i * x_i` (`x.len()` a multiple of
/// 32).
pub fn dot_row(values: &[u8], scales: &[u8], postscale: Option<bf16>, x: &[f32]) -> Result<f32, CodecError> {
    let mut out = [0.0f32];
    let ps = postscale.as_ref().map(std::slice::from_ref);
    matvec_rows(values, scales, ps, x, &mut out)?;
    Ok(out[0])
}

/// `out[r]` = row `r`'s dot with `x` for `out.len()` rows of `cols = x.len()` (a multiple of 32),
/// times `postscale[r]` when given (pass the slices of a row range to compute part of a matrix).
/// Checks the postscales; a row whose result is not finite has its e8m0 scales checked.
pub fn matvec_rows(values: &[u8], scales: &[u8], postscale: Option<&[bf16]>, x: &[f32], out: &mut [f32]) -> Result<(), CodecError> {
    matvec_rows_on(Isa::best(), values, scales, postscale, x, out)
}

/// [`matvec_rows`] on the kernels of `isa` (or the best this CPU runs below it); every level gives
/// the same bits.
pub fn matvec_rows_on(
    isa: Isa,
    values: &[u8],
    scales: &[u8],
    postscale: Option<&[bf16]>,
    x: &[f32],
    out: &mut [f32],
) -> Result<(), CodecError> {
    let (rows, cols) = (out.len(), x.len());
    check_shape(rows, cols, values.len(), scales.len(), postscale.map(<[bf16]>::len))?;
    if let Some(p) = postscale {
        check_postscales(p)?;
    }
    rows_dispatch(isa, values, scales, x, out);
    if let Some(p) = postscale {
        for (o, p) in out.iter_mut().zip(p) {
            *o *= p.to_f32();
        }
    }
    let per_row = cols / BLOCK;
    for (r, o) in out.iter().enumerate() {
        if !o.is_finite() {
            check_scales(&scales[r * per_row..(r + 1) * per_row], r * per_row)?;
        }
    }
    Ok(())
}

/// Prefill: `outs[t][r]` = row `r`'s dot with token `t` of `x` (`[outs.len(), cols]` row-major),
/// times `postscale[r]` when given: what [`matvec_rows`] gives token by token, bit for bit,
/// register-tiled on AVX-512 (4 rows x 4 tokens: each block decoded once for 4 tokens).
pub fn matmul_rows(values: &[u8], scales: &[u8], postscale: Option<&[bf16]>, x: &[f32], cols: usize, outs: &mut [&mut [f32]]) -> Result<(), CodecError> {
    matmul_rows_on(Isa::best(), values, scales, postscale, x, cols, outs)
}

/// [`matmul_rows`] on the kernels of `isa` (or the best this CPU runs below it).
pub fn matmul_rows_on(
    isa: Isa,
    values: &[u8],
    scales: &[u8],
    postscale: Option<&[bf16]>,
    x: &[f32],
    cols: usize,
    outs: &mut [&mut [f32]],
) -> Result<(), CodecError> {
    let rows = outs.first().map_or(0, |o| o.len());
    check_shape(rows, cols, values.len(), scales.len(), postscale.map(<[bf16]>::len))?;
    check_len(NAME, "x", elems(NAME, outs.len(), cols)?, x.len())?;
    for o in outs.iter() {
        check_len(NAME, "outputs", rows, o.len())?;
    }
    if let Some(p) = postscale {
        check_postscales(p)?;
    }
    match isa.clamp() {
        // SAFETY: `clamp` returns a level this CPU runs.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if cols > 0 => unsafe { avx512::tiles(values, scales, x, cols, outs) },
        _ => {
            for (xt, o) in x.chunks_exact(cols.max(1)).zip(outs.iter_mut()) {
                rows_dispatch(isa, values, scales, xt, o);
            }
        }
    }
    let per_row = cols / BLOCK;
    for o in outs.iter_mut() {
        if let Some(p) = postscale {
            for (o, p) in o.iter_mut().zip(p) {
                *o *= p.to_f32();
            }
        }
        for (r, v) in o.iter().enumerate() {
            if !v.is_finite() {
                check_scales(&scales[r * per_row..(r + 1) * per_row], r * per_row)?;
            }
        }
    }
    Ok(())
}

/// Repacks ggml `block_mxfp4` blocks (`e`, then `qs[16]`: element `j` low nibble of `qs[j]`,
/// `j + 16` high nibble) into this module's split layout; `values.len() * 2 == 32 * blocks`.
pub fn from_ggml_blocks(blocks: &[u8], values: &mut [u8], scales: &mut [u8]) -> Result<(), CodecError> {
    const GGML_BLOCK_BYTES: usize = 1 + BLOCK / 2;
    if !blocks.len().is_multiple_of(GGML_BLOCK_BYTES) {
        return Err(CodecError::Length {
            dtype: NAME,
            what: "bytes",
            expected: (blocks.len() / GGML_BLOCK_BYTES * GGML_BLOCK_BYTES) as u64,
            got: blocks.len() as u64,
        });
    }
    let nb = blocks.len() / GGML_BLOCK_BYTES;
    check_len(NAME, "values", nb * BLOCK / 2, values.len())?;
    check_len(NAME, "scales", nb, scales.len())?;
    for (b, ((g, v), e)) in blocks.chunks_exact(GGML_BLOCK_BYTES).zip(values.chunks_exact_mut(BLOCK / 2)).zip(scales.iter_mut()).enumerate() {
        if g[0] == E8M0_NAN {
            return Err(CodecError::NanE8m0 { dtype: NAME, block: b as u64 });
        }
        *e = g[0];
        let qs = &g[1..];
        let code = |j: usize| if j < 16 { qs[j] & 0x0F } else { qs[j - 16] >> 4 };
        for (i, byte) in v.iter_mut().enumerate() {
            *byte = code(2 * i) | (code(2 * i + 1) << 4);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

    #[test]
    fn matmul_tiles_equal_token_by_token_matvec_bit_for_bit() {
        // 6 rows (a 4-row tile and 2 single rows) x 96 columns, 6 tokens (a 4-token tile and 2),
        // with and without a postscale.
        let (rows, cols, tokens) = (6usize, 96usize, 6usize);
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 211) as f32 - 105.0) / 17.0).collect();
        let (mut values, mut scales, mut post) = (vec![0u8; rows * cols / 2], vec![0u8; rows * cols / BLOCK], vec![bf16::ONE; rows]);
        quantize_with_postscale(&w, cols, &mut values, &mut scales, &mut post).unwrap();
        let x: Vec<f32> = (0..tokens * cols).map(|i| ((i * 104729 % 97) as f32 - 48.0) / 9.0).collect();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for ps in [None, Some(&post[..])] {
            let mut want = vec![0.0; tokens * rows];
            for (xt, o) in x.chunks_exact(cols).zip(want.chunks_exact_mut(rows)) {
                matvec_rows_on(Isa::Portable, &values, &scales, ps, xt, o).unwrap();
            }
            for isa in Isa::supported() {
                let mut got = vec![0.0; tokens * rows];
                let mut outs: Vec<&mut [f32]> = got.chunks_exact_mut(rows).collect();
                matmul_rows_on(isa, &values, &scales, ps, &x, cols, &mut outs).unwrap();
                assert_eq!(bits(&got), bits(&want), "{isa:?}, postscale {}", ps.is_some());
            }
        }
        // A NaN scale is named, as matvec_rows names it.
        scales[4 * cols / BLOCK + 1] = 0xFF;
        let mut got = vec![0.0; tokens * rows];
        let mut outs: Vec<&mut [f32]> = got.chunks_exact_mut(rows).collect();
        let e = matmul_rows(&values, &scales, None, &x, cols, &mut outs).unwrap_err();
        let mut one = vec![0.0; rows];
        assert_eq!(e, matvec_rows(&values, &scales, None, &x[..cols], &mut one).unwrap_err());
    }

    #[test]
    fn every_e2m1_code() {
        for c in 0..16u8 {
            let want = if c & 8 != 0 { -E2M1[(c & 7) as usize] } else { E2M1[c as usize] };
            let got = decode_e2m1(c);
            assert_eq!(got.to_bits(), want.to_bits(), "code {c}");
            assert_eq!(encode_e2m1(got), c, "code {c}");
            // The high nibble is ignored.
            assert_eq!(decode_e2m1(c | 0xA0).to_bits(), want.to_bits());
        }
    }

    #[test]
    fn e2m1_ties_to_even_and_saturates() {
        // Midpoints: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
        let cases = [(0.25f32, 0u8), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6)];
        for (x, c) in cases {
            assert_eq!(encode_e2m1(x), c, "{x}");
            assert_eq!(encode_e2m1(-x), c | 8, "{}", -x);
        }
        assert_eq!(encode_e2m1(0.2500001), 1);
        assert_eq!(encode_e2m1(4.9999), 6);
        assert_eq!(encode_e2m1(5.0001), 7);
        assert_eq!(encode_e2m1(7.99), 7);
        assert_eq!(encode_e2m1(1e30), 7);
        assert_eq!(encode_e2m1(f32::NEG_INFINITY), 15);
        assert_eq!(encode_e2m1(-0.0), 8);
        assert_eq!(encode_e2m1(-0.1), 8);
    }

    #[test]
    fn e8m0_extremes_and_shared_scale() {
        assert_eq!(decode_e8m0(127), 1.0);
        assert_eq!(decode_e8m0(0), 2f32.powi(-127));
        assert_eq!(decode_e8m0(1), 2f32.powi(-126));
        assert_eq!(decode_e8m0(254), 2f32.powi(127));
        assert!(decode_e8m0(255).is_nan());
        assert_eq!(shared_scale(0.0), 0);
        assert_eq!(shared_scale(6.0), 127); // floor(log2 6) = 2
        assert_eq!(shared_scale(4.0), 127);
        assert_eq!(shared_scale(3.999_999_8), 126);
        assert_eq!(shared_scale(8.0), 128);
        assert_eq!(shared_scale(f32::MAX), 252); // 127 - 2 + 127
        assert_eq!(shared_scale(f32::MIN_POSITIVE), 0); // -126 - 2 clamps to -127
        assert_eq!(shared_scale(2f32.powi(-123)), 2); // -125 + 127
        assert_eq!(shared_scale(f32::from_bits(1)), 0); // subnormal
        // Just below a power of two, where floorf(log2f(x)) in f32 rounds up.
        let below_64 = f32::from_bits(64f32.to_bits() - 1);
        assert_eq!(shared_scale(below_64), 127 + 5 - 2);
    }

    #[test]
    fn quantize_block_by_hand() {
        // amax 6 -> shared exp 0 (e8m0 127): the values are encoded as they are.
        let mut x = [0.0f32; 32];
        x[..8].copy_from_slice(&[6.0, -0.5, 0.75, 1.25, -3.5, 2.9, 0.1, -6.0]);
        let (mut v, mut s) = ([0u8; 16], [0u8; 1]);
        quantize_row(&x, &mut v, &mut s).unwrap();
        assert_eq!(s, [127]);
        // element 2i low nibble, 2i+1 high nibble
        assert_eq!(&v[..4], &[0x7 | (0x9 << 4), 0x2 | (0x2 << 4), 0xE | (0x5 << 4), 0xF << 4]);
        assert_eq!(&v[4..], &[0; 12]);
        // amax 40 -> floor(log2 40) = 5, shared exp 3 (scale 8): 40/8 = 5 ties to 4; 47 -> 5.875 -> 6; 52 -> 6.5 saturates.
        let mut x = [0.0f32; 32];
        x[0] = 40.0;
        x[1] = -47.0;
        x[2] = 52.0;
        quantize_row(&x, &mut v, &mut s).unwrap();
        assert_eq!(s, [130]);
        assert_eq!(v[0], 0x6 | (0xF << 4));
        assert_eq!(v[1] & 0xF, 0x7);
        let mut out = [0.0f32; 32];
        dequantize_row(&v, &s, None, &mut out).unwrap();
        assert_eq!(&out[..3], &[32.0, -48.0, 48.0]);
        dequantize_row(&v, &s, Some(bf16::from_f32(0.5)), &mut out).unwrap();
        assert_eq!(&out[..3], &[16.0, -24.0, 24.0]);
    }

    #[test]
    fn errors() {
        let (mut v, mut s) = ([0u8; 16], [0u8; 1]);
        let mut x = [1.0f32; 32];
        x[7] = f32::NAN;
        assert!(matches!(quantize_row(&x, &mut v, &mut s), Err(CodecError::NonFiniteInput { index: 7, .. })));
        assert!(matches!(quantize(&[0.0; 48], 48, &mut [0; 24], &mut [0; 1]), Err(CodecError::PartialBlock { count: 48, .. })));
        assert!(matches!(sizes(2, 33), Err(CodecError::PartialBlock { .. })));
        assert!(matches!(sizes(u64::MAX, 64), Err(CodecError::Overflow { .. })));
        assert_eq!(sizes(3, 64).unwrap(), Sizes { values: 96, scales: 6 });
        let mut out = [0.0f32; 64];
        let v2 = [0x22u8; 32];
        assert!(matches!(dequantize(&v2, &[127, 255], None, 64, &mut out), Err(CodecError::NanE8m0 { block: 1, .. })));
        assert!(matches!(dequantize(&v2, &[127], None, 64, &mut out), Err(CodecError::Length { what: "scales", .. })));
        let mut o = [0.0f32; 2];
        assert!(matches!(
            matvec_rows(&v2, &[127, 255], None, &[1.0; 32], &mut o),
            Err(CodecError::NanE8m0 { block: 1, .. })
        ));
        let bad = [bf16::ONE, bf16::from_f32(-1.0)];
        assert!(matches!(
            matvec_rows(&v2, &[127, 127], Some(&bad), &[1.0; 32], &mut o),
            Err(CodecError::RowScale { row: 1, .. })
        ));
        assert!(matches!(
            matvec_rows(&v2, &[127, 127], Some(&bad[..1]), &[1.0; 32], &mut o),
            Err(CodecError::Length { what: "postscales", .. })
        ));
    }

    #[test]
    fn postscale_fit_by_hand() {
        // A row of 2.5 everywhere: amax 2.5 -> shared exp -1 (scale 0.5), 2.5/0.5 = 5 ties to 4,
        // so q = 2.0 everywhere and the least-squares postscale is 2.5 / 2 = 1.25 (exact in bf16).
        let x = [2.5f32; 32];
        let (mut v, mut s, mut p) = ([0u8; 16], [0u8; 1], [bf16::ZERO; 1]);
        quantize_with_postscale(&x, 32, &mut v, &mut s, &mut p).unwrap();
        assert_eq!(s, [126]);
        assert_eq!(p[0], bf16::from_f32(1.25));
        assert_eq!(dot_row(&v, &s, Some(p[0]), &[1.0; 32]).unwrap(), 80.0);
        // An all-zero row keeps postscale 1.
        quantize_with_postscale(&[0.0; 32], 32, &mut v, &mut s, &mut p).unwrap();
        assert_eq!((s[0], p[0]), (0, bf16::ONE));
    }

    #[test]
    fn ggml_repack() {
        // ggml block: e = 127, element j = code (j % 16), element j + 16 = code 15 - (j % 16).
        let mut g = vec![127u8];
        for j in 0..16u8 {
            g.push(j | ((15 - j) << 4));
        }
        let (mut v, mut s) = ([0u8; 16], [0u8; 1]);
        from_ggml_blocks(&g, &mut v, &mut s).unwrap();
        let mut out = [0.0f32; 32];
        dequantize_row(&v, &s, None, &mut out).unwrap();
        for j in 0..16 {
            assert_eq!(out[j], decode_e2m1(j as u8));
            assert_eq!(out[j + 16], decode_e2m1(15 - j as u8));
        }
        g[0] = 0xFF;
        assert!(matches!(from_ggml_blocks(&g, &mut v, &mut s), Err(CodecError::NanE8m0 { block: 0, .. })));
    }

    #[test]
    fn dot_matches_f64_and_every_kernel_agrees() {
        // 7 rows: more than one pass of any rows-per-pass up to four.
        let (rows, cols) = (7, 96);
        let x: Vec<f32> = (0..cols).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.173).collect();
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 53 % 41) as f32 - 20.0) * 0.031 * (1 + i % 7) as f32).collect();
        let (mut v, mut s, mut p) = (vec![0u8; rows * cols / 2], vec![0u8; rows * cols / 32], vec![bf16::ZERO; rows]);
        quantize_with_postscale(&w, cols, &mut v, &mut s, &mut p).unwrap();
        let mut deq = vec![0f32; rows * cols];
        dequantize(&v, &s, Some(&p), cols, &mut deq).unwrap();
        let mut out = vec![0f32; rows];
        matvec_rows(&v, &s, Some(&p), &x, &mut out).unwrap();
        for r in 0..rows {
            let row = &deq[r * cols..(r + 1) * cols];
            let exact: f64 = row.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
            let mag: f64 = row.iter().zip(&x).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
            assert!((out[r] as f64 - exact).abs() <= 1e-6 * mag, "row {r}: {} vs {exact}", out[r]);
            let (vr, sr) = (&v[r * cols / 2..(r + 1) * cols / 2], &s[r * cols / 32..(r + 1) * cols / 32]);
            let portable = dot_unscaled(vr, sr, &x) * p[r].to_f32();
            assert_eq!(portable, out[r], "the best kernel sums in the portable order");
            assert_eq!(dot_row(vr, sr, Some(p[r]), &x).unwrap(), out[r]);
        }
        for isa in Isa::supported() {
            let mut o = vec![0f32; rows];
            matvec_rows_on(isa, &v, &s, Some(&p), &x, &mut o).unwrap();
            assert_eq!(o, out, "{isa:?} sums in the portable order");
        }
    }
}
