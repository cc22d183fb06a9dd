//! FP8 e4m3 weights with one f32 scale per output row (OCP e4m3fn: bias 7, max 448, no
//! infinities, 0x7F/0xFF are NaN).
//!
//! Layout of a `[rows, cols]` matrix: `values` = `rows * cols` bytes, row-major, one e4m3 code per
//! element; `scales` = `rows` little-endian f32. Element `(r, c)` is
//! `decode_e4m3(values[r * cols + c]) * scales[r]`.
//!
//! Quantization (per row): `scale = amax(row) / 448` in f32; a row whose `amax / 448` is 0 (all
//! zeros, or so tiny that the division underflows) gets `scale = 1.0`, so a stored scale is always
//! finite and > 0 and such a row encodes to zeros. Each value is `x / scale` (an f32 division)
//! rounded to the nearest e4m3, ties to even, saturating to ±448; NaN is never written, a
//! non-finite input is [`CodecError::NonFiniteInput`]. This is `ml_dtypes.float8_e4m3fn` after a
//! clip to ±448 (ml_dtypes itself overflows to NaN instead of saturating).

use super::{check_len, elems, reduce, CodecError, Isa, Sizes};

const NAME: &str = "f8_e4m3";

/// Largest finite e4m3 value (code 0x7E).
pub const E4M3_MAX: f32 = 448.0;

/// The value of an e4m3 code: `(-1)^s * 2^(e-7) * (1 + m/8)`, subnormals `(-1)^s * m * 2^-9`,
/// 0x7F/0xFF NaN. Exact; written without tables or subnormal f32 intermediates so it vectorizes.
#[inline(always)]
pub fn decode_e4m3(code: u8) -> f32 {
    let c = code as u32;
    let mag = c & 0x7F;
    let sign = (c & 0x80) << 24;
    let bits = if mag == 0x7F {
        0x7FC0_0000
    } else if mag < 8 {
        (mag as f32 * (1.0 / 512.0)).to_bits()
    } else {
        // e4m3's exponent and mantissa dropped into an f32's, the bias moved from 7 to 127.
        (mag << 20) + (120 << 23)
    };
    f32::from_bits(bits | sign)
}

/// The e4m3 code nearest to `x`, ties to even, saturating: `|x| >= 448` (infinity too) gives ±448.
/// A NaN gives 0x7F/0xFF (as `ml_dtypes` casts it); the quantizers never pass one. The sign of a
/// zero (or of a value that rounds to zero) is kept.
#[inline]
pub fn encode_e4m3(x: f32) -> u8 {
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    let a = x.abs();
    if a.is_nan() {
        return sign | 0x7F;
    }
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    if a < 1.0 / 64.0 {
        // Subnormal range: code m is m * 2^-9 for m < 8, and m = 8 is 0x08 = 2^-6, the smallest
        // normal, so the rounded count of 2^-9 steps is the code. `a * 512` is exact.
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    // Normal: round the f32 mantissa to 3 bits, ties to even; a carry moves into the exponent.
    let b = a.to_bits();
    let r = (b + 0x7_FFFF + ((b >> 20) & 1)) >> 20;
    sign | (r - ((127 - 7) << 3)) as u8
}

/// Bytes of a `[rows, cols]` FP8 matrix: `rows * cols` values and `4 * rows` of scales.
pub fn sizes(rows: u64, cols: u64) -> Result<Sizes, CodecError> {
    let overflow = CodecError::Overflow { dtype: NAME, rows, cols };
    let values = rows.checked_mul(cols).ok_or(overflow.clone())?;
    let scales = rows.checked_mul(4).ok_or(overflow)?;
    Ok(Sizes { values, scales })
}

/// `Err(RowScale)` for the first scale that is not finite and > 0 (the open-time check).
pub fn check_scales(scales: &[f32]) -> Result<(), CodecError> {
    match scales.iter().position(|s| !(s.is_finite() && *s > 0.0)) {
        None => Ok(()),
        Some(row) => Err(CodecError::RowScale {
            dtype: NAME,
            row: row as u64,
            scale: scales[row],
        }),
    }
}

/// `Err(NanE4m3)` for the first NaN code (0x7F/0xFF) in `values`; `first_index` is the index of
/// `values[0]` in the whole tensor, for the message.
pub fn check_values(values: &[u8], first_index: usize) -> Result<(), CodecError> {
    match values.iter().position(|v| v & 0x7F == 0x7F) {
        None => Ok(()),
        Some(i) => Err(CodecError::NanE4m3 {
            dtype: NAME,
            index: (first_index + i) as u64,
            code: values[i],
        }),
    }
}

/// Quantizes one row: writes `values` (`x.len()` codes) and returns the row's scale.
pub fn quantize_row(x: &[f32], values: &mut [u8]) -> Result<f32, CodecError> {
    quantize_row_at(x, values, 0)
}

fn quantize_row_at(x: &[f32], values: &mut [u8], first_index: usize) -> Result<f32, CodecError> {
    check_len(NAME, "values", x.len(), values.len())?;
    let mut amax = 0.0f32;
    for (i, &v) in x.iter().enumerate() {
        if !v.is_finite() {
            return Err(CodecError::NonFiniteInput {
                dtype: NAME,
                index: (first_index + i) as u64,
                value: v,
            });
        }
        amax = amax.max(v.abs());
    }
    let scale = match amax / E4M3_MAX {
        0.0 => 1.0,
        s => s,
    };
    for (q, &v) in values.iter_mut().zip(x) {
        *q = encode_e4m3(v / scale);
    }
    Ok(scale)
}

/// Quantizes a row-major `[rows, cols]` matrix `x` (`rows = scales.len()`) into `values` and
/// `scales`.
pub fn quantize(x: &[f32], cols: usize, values: &mut [u8], scales: &mut [f32]) -> Result<(), CodecError> {
    let rows = scales.len();
    check_len(NAME, "x", elems(NAME, rows, cols)?, x.len())?;
    check_len(NAME, "values", x.len(), values.len())?;
    if cols == 0 {
        scales.fill(1.0);
        return Ok(());
    }
    for (r, ((xr, vr), s)) in x.chunks_exact(cols).zip(values.chunks_exact_mut(cols)).zip(scales.iter_mut()).enumerate() {
        *s = quantize_row_at(xr, vr, r * cols)?;
    }
    Ok(())
}

/// `out[i] = decode_e4m3(values[i]) * scale` for one row.
pub fn dequantize_row(values: &[u8], scale: f32, out: &mut [f32]) -> Result<(), CodecError> {
    check_len(NAME, "outputs", values.len(), out.len())?;
    check_scales(std::slice::from_ref(&scale))?;
    check_values(values, 0)?;
    for (o, &v) in out.iter_mut().zip(values) {
        *o = decode_e4m3(v) * scale;
    }
    Ok(())
}

/// Dequantizes a `[rows, cols]` matrix (`rows = scales.len()`) into `out` (`rows * cols`).
pub fn dequantize(values: &[u8], scales: &[f32], cols: usize, out: &mut [f32]) -> Result<(), CodecError> {
    let n = elems(NAME, scales.len(), cols)?;
    check_len(NAME, "values", n, values.len())?;
    check_len(NAME, "outputs", n, out.len())?;
    check_scales(scales)?;
    check_values(values, 0)?;
    if cols == 0 {
        return Ok(());
    }
    for ((o, v), &s) in out.chunks_exact_mut(cols).zip(values.chunks_exact(cols)).zip(scales) {
        for (o, &v) in o.iter_mut().zip(v) {
            *o = decode_e4m3(v) * s;
        }
    }
    Ok(())
}

/// A code's value / 256, exact: the f16 whose exponent and mantissa are e4m3's (what the SIMD
/// kernels decode with one shift and one mask, subnormals included), as f32.
#[inline(always)]
fn decode_div256(code: u8) -> f32 {
    decode_e4m3(code) * (1.0 / 256.0)
}

/// `sum_i decode(v[i]) * x[i]` in the module's lane order: products of the values / 256 go into
/// lane `i % 32` of each 32-element chunk, the lanes are reduced pairwise, the tail (`cols % 32`
/// elements, in order) added, and the sum multiplied by 256 (exact, as is every step but a
/// product or sum below f32's normal range).
#[inline(always)]
fn dot_unscaled(v: &[u8], x: &[f32]) -> f32 {
    let body = x.len() / CHUNK * CHUNK;
    let mut acc = [0.0f32; CHUNK];
    for (vc, xc) in v[..body].chunks_exact(CHUNK).zip(x[..body].chunks_exact(CHUNK)) {
        for i in 0..CHUNK {
            acc[i] += decode_div256(vc[i]) * xc[i];
        }
    }
    (reduce(acc) + tail(&v[body..], &x[body..])) * 256.0
}

/// The tail's `sum decode(v[i]) / 256 * x[i]`, in order (every kernel's).
#[inline(always)]
fn tail(v: &[u8], x: &[f32]) -> f32 {
    let mut t = 0.0f32;
    for (&w, &xi) in v.iter().zip(x) {
        t += decode_div256(w) * xi;
    }
    t
}

/// Lanes of the dot: element `i` of each 32-element chunk adds into lane `i`.
const CHUNK: usize = 32;

#[inline(always)]
fn rows_body(values: &[u8], scales: &[f32], x: &[f32], out: &mut [f32]) {
    let cols = x.len();
    for (r, (o, &s)) in out.iter_mut().zip(scales).enumerate() {
        *o = dot_unscaled(&values[r * cols..(r + 1) * cols], x) * s;
    }
}

fn rows_dispatch(isa: Isa, values: &[u8], scales: &[f32], x: &[f32], out: &mut [f32]) {
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

/// AVX2 + F16C: 16 codes become f16 bit patterns (e4m3's exponent and mantissa under f16's, so
/// the f16 is the value / 256, subnormals included) and F16C widens them. NaN codes are collected
/// in a mask and make the row NaN.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::x86::sum16_256;
    use super::{tail, CHUNK};
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,f16c")]
    pub fn rows(values: &[u8], scales: &[f32], x: &[f32], out: &mut [f32]) {
        let cols = x.len();
        let body = cols / CHUNK * CHUNK;
        let (m7f, sign) = (_mm256_set1_epi16(0x7F), _mm256_set1_epi16(0xBF80u16 as i16));
        for (r, (o, &s)) in out.iter_mut().zip(scales).enumerate() {
            let row = &values[r * cols..(r + 1) * cols];
            let mut a = [_mm256_setzero_ps(); 4];
            let mut nan = _mm256_setzero_si256();
            let mut i = 0;
            while i < body {
                for h in 0..2 {
                    let at = i + 16 * h;
                    // SAFETY: at + 16 <= body <= row.len() == x.len(); unaligned loads.
                    let (v, x0, x1) = unsafe {
                        (
                            _mm_loadu_si128(row.as_ptr().add(at) as *const __m128i),
                            _mm256_loadu_ps(x.as_ptr().add(at)),
                            _mm256_loadu_ps(x.as_ptr().add(at + 8)),
                        )
                    };
                    let w = _mm256_cvtepi8_epi16(v);
                    nan = _mm256_or_si256(nan, _mm256_cmpeq_epi16(_mm256_and_si256(w, m7f), m7f));
                    // The sign-extended code shifted under f16's fields: sign in bit 15, the
                    // exponent in bits 10..14 with its top bit (a copy of the sign) cleared.
                    let f16 = _mm256_and_si256(_mm256_slli_epi16::<7>(w), sign);
                    let lo = _mm256_cvtph_ps(_mm256_castsi256_si128(f16));
                    let hi = _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(f16));
                    a[2 * h] = _mm256_add_ps(a[2 * h], _mm256_mul_ps(lo, x0));
                    a[2 * h + 1] = _mm256_add_ps(a[2 * h + 1], _mm256_mul_ps(hi, x1));
                }
                i += CHUNK;
            }
            let sum = sum16_256(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3]));
            let dot = if _mm256_movemask_epi8(nan) != 0 { f32::NAN } else { (sum + tail(&row[body..], &x[body..])) * 256.0 };
            *o = dot * s;
        }
    }
}

/// AVX-512: the AVX2 decode, 16 codes per f16 widening into one register; `R` rows at a time
/// share the loads of `x`. NaN codes are found on the raw bytes, 32 at a time.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::super::x86::{call_tile, sum16_512, tile_walk};
    use super::{tail, CHUNK};
    use std::arch::x86_64::*;

    /// Rows per pass. One: with more, the rows' interleaved reads defeat the hardware prefetcher
    /// on weights streamed from DRAM (four rows at a time, measured at 49152 x 576: 2-4x slower
    /// from DRAM, though 1.1-1.6x faster with the weights in L2).
    const R: usize = 1;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c")]
    pub fn rows(values: &[u8], scales: &[f32], x: &[f32], out: &mut [f32]) {
        let cols = x.len();
        let (rows, mut r) = (out.len(), 0);
        while r < rows {
            let k = if r + R <= rows { R } else { 1 };
            let (v, s) = (&values[r * cols..(r + k) * cols], &scales[r..r + k]);
            if k == R {
                group::<R>(v, s, x, &mut out[r..r + R]);
            } else {
                group::<1>(v, s, x, &mut out[r..r + 1]);
            }
            r += k;
        }
    }

    /// `outs[t][r]` for every row in `values` and token in `x`, in tiles of 4 rows x 4 tokens.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c")]
    pub fn tiles(values: &[u8], scales: &[f32], x: &[f32], cols: usize, outs: &mut [&mut [f32]]) {
        let (rows, tokens) = (outs.first().map_or(0, |o| o.len()), outs.len());
        for (r, nr, t, nt) in tile_walk(rows, tokens) {
            let (v, s, xt) = (&values[r * cols..(r + nr) * cols], &scales[r..r + nr], &x[t * cols..(t + nt) * cols]);
            call_tile!(tile, nr, nt, (v, s, xt, cols, &mut outs[t..t + nt], r));
        }
    }

    /// `outs[t][r0 + n]` for the `R` rows in `values` and the `T` tokens in `x`: [`group`]'s
    /// operations per (row, token), each chunk's codes decoded once per tile.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c")]
    fn tile<const R: usize, const T: usize>(values: &[u8], scales: &[f32], x: &[f32], cols: usize, outs: &mut [&mut [f32]], r0: usize) {
        let body = cols / CHUNK * CHUNK;
        assert!(values.len() == R * cols && scales.len() == R && x.len() == T * cols && outs.len() == T);
        let sign = _mm256_set1_epi16(0xBF80u16 as i16);
        let m7f = _mm256_set1_epi8(0x7F);
        let mut acc = [[[_mm512_setzero_ps(); 2]; R]; T];
        let mut nan = [0u32; R];
        let mut i = 0;
        while i < body {
            let mut w = [[_mm512_setzero_ps(); 2]; R];
            for (n, w) in w.iter_mut().enumerate() {
                // SAFETY: n * cols + i + 32 <= values.len() (asserted shape); unaligned loads.
                let p = unsafe { values.as_ptr().add(n * cols + i) };
                // SAFETY: as above.
                let raw = unsafe { _mm256_loadu_si256(p as *const __m256i) };
                nan[n] |= _mm256_cmpeq_epi8_mask(_mm256_and_si256(raw, m7f), m7f);
                for (h, w) in w.iter_mut().enumerate() {
                    // SAFETY: as above.
                    let c = _mm256_cvtepi8_epi16(unsafe { _mm_loadu_si128(p.add(16 * h) as *const __m128i) });
                    *w = _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16::<7>(c), sign));
                }
            }
            for (t, a) in acc.iter_mut().enumerate() {
                // SAFETY: t * cols + i + 32 <= x.len() (asserted shape); unaligned loads.
                let xs = unsafe { [_mm512_loadu_ps(x.as_ptr().add(t * cols + i)), _mm512_loadu_ps(x.as_ptr().add(t * cols + i + 16))] };
                for (a, w) in a.iter_mut().zip(&w) {
                    for h in 0..2 {
                        a[h] = _mm512_add_ps(a[h], _mm512_mul_ps(w[h], xs[h]));
                    }
                }
            }
            i += CHUNK;
        }
        for (t, (a, o)) in acc.iter().zip(outs.iter_mut()).enumerate() {
            let xt = &x[t * cols..(t + 1) * cols];
            for (n, a) in a.iter().enumerate() {
                let row = &values[n * cols..(n + 1) * cols];
                let sum = sum16_512(_mm512_add_ps(a[0], a[1]));
                let dot = if nan[n] != 0 { f32::NAN } else { (sum + tail(&row[body..], &xt[body..])) * 256.0 };
                o[r0 + n] = dot * scales[n];
            }
        }
    }

    /// `out[i]` for the `N` rows in `values`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c")]
    fn group<const N: usize>(values: &[u8], scales: &[f32], x: &[f32], out: &mut [f32]) {
        let cols = x.len();
        let body = cols / CHUNK * CHUNK;
        assert!(values.len() == N * cols && scales.len() == N && out.len() == N);
        let sign = _mm256_set1_epi16(0xBF80u16 as i16);
        let m7f = _mm256_set1_epi8(0x7F);
        let mut acc = [[_mm512_setzero_ps(); 2]; N];
        let mut nan = [0u32; N];
        let mut i = 0;
        while i < body {
            // SAFETY: i + 32 <= body <= x.len(); unaligned loads.
            let xs = unsafe { [_mm512_loadu_ps(x.as_ptr().add(i)), _mm512_loadu_ps(x.as_ptr().add(i + 16))] };
            for n in 0..N {
                // SAFETY: n * cols + i + 32 <= values.len() (asserted shape); unaligned loads.
                let p = unsafe { values.as_ptr().add(n * cols + i) };
                // SAFETY: as above.
                let raw = unsafe { _mm256_loadu_si256(p as *const __m256i) };
                nan[n] |= _mm256_cmpeq_epi8_mask(_mm256_and_si256(raw, m7f), m7f);
                for (h, xh) in xs.iter().enumerate() {
                    // SAFETY: as above.
                    let w = _mm256_cvtepi8_epi16(unsafe { _mm_loadu_si128(p.add(16 * h) as *const __m128i) });
                    let f16 = _mm256_and_si256(_mm256_slli_epi16::<7>(w), sign);
                    acc[n][h] = _mm512_add_ps(acc[n][h], _mm512_mul_ps(_mm512_cvtph_ps(f16), *xh));
                }
            }
            i += CHUNK;
        }
        for (n, o) in out.iter_mut().enumerate() {
            let row = &values[n * cols..(n + 1) * cols];
            let sum = sum16_512(_mm512_add_ps(acc[n][0], acc[n][1]));
            let dot = if nan[n] != 0 { f32::NAN } else { (sum + tail(&row[body..], &x[body..])) * 256.0 };
            *o = dot * scales[n];
        }
    }
}

/// One row's dot: `scale * sum_i decode(values[i]) * x[i]`.
pub fn dot_row(values: &[u8], scale: f32, x: &[f32]) -> Result<f32, CodecError> {
    let mut out = [0.0f32];
    matvec_rows(values, std::slice::from_ref(&scale), x, &mut out)?;
    Ok(out[0])
}

/// `out[r] = scales[r] * sum_c decode(values[r * cols + c]) * x[c]` for `out.len()` rows of
/// `cols = x.len()` (pass the slices of a row range to compute part of a matrix). Checks every
/// scale and, when a row's result is not finite, that row's codes.
pub fn matvec_rows(values: &[u8], scales: &[f32], x: &[f32], out: &mut [f32]) -> Result<(), CodecError> {
    matvec_rows_on(Isa::best(), values, scales, x, out)
}

/// [`matvec_rows`] on the kernels of `isa` (or the best this CPU runs below it); every level gives
/// the same bits.
pub fn matvec_rows_on(isa: Isa, values: &[u8], scales: &[f32], x: &[f32], out: &mut [f32]) -> Result<(), CodecError> {
    let (rows, cols) = (out.len(), x.len());
    check_len(NAME, "scales", rows, scales.len())?;
    check_len(NAME, "values", elems(NAME, rows, cols)?, values.len())?;
    check_scales(scales)?;
    rows_dispatch(isa, values, scales, x, out);
    for (r, o) in out.iter().enumerate() {
        if !o.is_finite() {
            check_values(&values[r * cols..(r + 1) * cols], r * cols)?;
        }
    }
    Ok(())
}

/// Prefill: `outs[t][r]` = row `r`'s dot with token `t` of `x` (`[outs.len(), cols]` row-major), for
/// the rows of `values`/`scales` (`outs[t].len()` each): what [`matvec_rows`] gives token by token,
/// bit for bit, register-tiled on AVX-512 (4 rows x 4 tokens: each chunk's codes decoded once for
/// 4 tokens).
pub fn matmul_rows(values: &[u8], scales: &[f32], x: &[f32], cols: usize, outs: &mut [&mut [f32]]) -> Result<(), CodecError> {
    matmul_rows_on(Isa::best(), values, scales, x, cols, outs)
}

/// [`matmul_rows`] on the kernels of `isa` (or the best this CPU runs below it).
pub fn matmul_rows_on(isa: Isa, values: &[u8], scales: &[f32], x: &[f32], cols: usize, outs: &mut [&mut [f32]]) -> Result<(), CodecError> {
    let rows = outs.first().map_or(0, |o| o.len());
    check_len(NAME, "x", elems(NAME, outs.len(), cols)?, x.len())?;
    check_len(NAME, "scales", rows, scales.len())?;
    check_len(NAME, "values", elems(NAME, rows, cols)?, values.len())?;
    for o in outs.iter() {
        check_len(NAME, "outputs", rows, o.len())?;
    }
    check_scales(scales)?;
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
    for o in outs.iter() {
        for (r, v) in o.iter().enumerate() {
            if !v.is_finite() {
                check_values(&values[r * cols..(r + 1) * cols], r * cols)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// e4m3 from its definition, independent of `decode_e4m3`'s bit tricks.
    fn by_definition(code: u8) -> f32 {
        let s = if code & 0x80 != 0 { -1.0f64 } else { 1.0 };
        let e = ((code >> 3) & 0xF) as i32;
        let m = (code & 7) as f64;
        if e == 15 && m == 7.0 {
            return f32::NAN;
        }
        let v = if e == 0 { m / 8.0 * 2f64.powi(-6) } else { (1.0 + m / 8.0) * 2f64.powi(e - 7) };
        (s * v) as f32
    }

    #[test]
    fn matmul_tiles_equal_token_by_token_matvec_bit_for_bit() {
        // 6 rows (a 4-row tile and 2 single rows) x 100 columns (3 chunks and a tail of 4), 6
        // tokens (a 4-token tile and 2).
        let (rows, cols, tokens) = (6usize, 100usize, 6usize);
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 211) as f32 - 105.0) / 17.0).collect();
        let (mut values, mut scales) = (vec![0u8; rows * cols], vec![0.0f32; rows]);
        quantize(&w, cols, &mut values, &mut scales).unwrap();
        let x: Vec<f32> = (0..tokens * cols).map(|i| ((i * 104729 % 97) as f32 - 48.0) / 9.0).collect();
        let mut want = vec![0.0; tokens * rows];
        for (xt, o) in x.chunks_exact(cols).zip(want.chunks_exact_mut(rows)) {
            matvec_rows_on(Isa::Portable, &values, &scales, xt, o).unwrap();
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for isa in Isa::supported() {
            let mut got = vec![0.0; tokens * rows];
            let mut outs: Vec<&mut [f32]> = got.chunks_exact_mut(rows).collect();
            matmul_rows_on(isa, &values, &scales, &x, cols, &mut outs).unwrap();
            assert_eq!(bits(&got), bits(&want), "{isa:?}");
        }
        // A NaN code is named, as matvec_rows names it.
        values[4 * cols + 7] = 0x7F;
        let mut got = vec![0.0; tokens * rows];
        let mut outs: Vec<&mut [f32]> = got.chunks_exact_mut(rows).collect();
        let e = matmul_rows(&values, &scales, &x, cols, &mut outs).unwrap_err();
        let mut one = vec![0.0; rows];
        assert_eq!(e, matvec_rows(&values, &scales, &x[..cols], &mut one).unwrap_err());
    }

    #[test]
    fn decode_every_code() {
        for c in 0..=255u8 {
            let (got, want) = (decode_e4m3(c), by_definition(c));
            if want.is_nan() {
                assert!(got.is_nan(), "{c:#04x}");
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "{c:#04x}");
            }
        }
        assert_eq!(decode_e4m3(0x01), 2f32.powi(-9));
        assert_eq!(decode_e4m3(0x07), 7.0 * 2f32.powi(-9));
        assert_eq!(decode_e4m3(0x08), 2f32.powi(-6));
        assert_eq!(decode_e4m3(0x7E), 448.0);
        assert_eq!(decode_e4m3(0xFE), -448.0);
        assert_eq!(decode_e4m3(0x38), 1.0);
        assert_eq!(decode_e4m3(0x80).to_bits(), (-0.0f32).to_bits());
        assert!(decode_e4m3(0x7F).is_nan() && decode_e4m3(0xFF).is_nan());
    }

    #[test]
    fn encode_round_trips_every_finite_code() {
        for c in 0..=255u8 {
            if c & 0x7F != 0x7F {
                assert_eq!(encode_e4m3(decode_e4m3(c)), c, "{c:#04x}");
            }
        }
    }

    #[test]
    fn encode_ties_saturation_and_zeros() {
        // 1.0 = 0x38, 1.125 = 0x39, 1.25 = 0x3A: 1.0625 ties to even (1.0), 1.1875 to 1.25.
        assert_eq!(encode_e4m3(1.0625), 0x38);
        assert_eq!(encode_e4m3(1.1875), 0x3A);
        assert_eq!(encode_e4m3(1.0625 + 1e-6), 0x39);
        // Subnormal ties: 0.5 * 2^-9 -> 0, 1.5 * 2^-9 -> 2 (0x02), 2.5 * 2^-9 -> 2.
        assert_eq!(encode_e4m3(0.5 * 2f32.powi(-9)), 0x00);
        assert_eq!(encode_e4m3(1.5 * 2f32.powi(-9)), 0x02);
        assert_eq!(encode_e4m3(2.5 * 2f32.powi(-9)), 0x02);
        // 7.5 * 2^-9 is halfway between 0x07 and 0x08 (2^-6): 0x08 is even.
        assert_eq!(encode_e4m3(7.5 * 2f32.powi(-9)), 0x08);
        // Largest binade: 416 = 0x7D, 448 = 0x7E; 432 ties to 448 (even mantissa 6).
        assert_eq!(encode_e4m3(432.0), 0x7E);
        assert_eq!(encode_e4m3(431.9), 0x7D);
        // Saturation, never NaN.
        assert_eq!(encode_e4m3(448.0), 0x7E);
        assert_eq!(encode_e4m3(464.0), 0x7E);
        assert_eq!(encode_e4m3(1e30), 0x7E);
        assert_eq!(encode_e4m3(f32::INFINITY), 0x7E);
        assert_eq!(encode_e4m3(f32::NEG_INFINITY), 0xFE);
        assert_eq!(encode_e4m3(-500.0), 0xFE);
        // Zeros keep their sign, tiny values round to a signed zero.
        assert_eq!(encode_e4m3(0.0), 0x00);
        assert_eq!(encode_e4m3(-0.0), 0x80);
        assert_eq!(encode_e4m3(-1e-9), 0x80);
        assert_eq!(encode_e4m3(f32::NAN), 0x7F);
    }

    #[test]
    fn quantize_rows_scales_and_errors() {
        let x = [448.0f32, -224.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0, -6.0, 0.0, 0.0];
        let mut v = [0u8; 12];
        let mut s = [0f32; 3];
        quantize(&x, 4, &mut v, &mut s).unwrap();
        // Row 0: amax 448, scale 1; row 1: all zeros, scale 1 (documented); row 2: scale 6/448.
        assert_eq!(s, [1.0, 1.0, 6.0 / 448.0]);
        assert_eq!(&v[..4], &[0x7E, 0xF6, 0x38, 0x00]);
        assert_eq!(&v[4..8], &[0; 4]);
        assert_eq!(v[9], 0xFE);
        assert_eq!(v[8], encode_e4m3(3.0 / (6.0 / 448.0)));
        let mut out = [0f32; 12];
        dequantize(&v, &s, 4, &mut out).unwrap();
        assert_eq!(&out[..4], &[448.0, -224.0, 1.0, 0.0]);
        assert_eq!(out[9], -6.0);

        assert!(matches!(
            quantize(&[1.0, f32::NAN], 2, &mut [0u8; 2], &mut [0f32; 1]),
            Err(CodecError::NonFiniteInput { index: 1, .. })
        ));
        assert!(matches!(
            quantize(&[1.0, 2.0, f32::INFINITY, 0.0], 2, &mut [0u8; 4], &mut [0f32; 2]),
            Err(CodecError::NonFiniteInput { index: 2, .. })
        ));
        assert!(matches!(quantize(&[1.0; 3], 2, &mut [0u8; 3], &mut [0f32; 2]), Err(CodecError::Length { what: "x", .. })));
    }

    #[test]
    fn bad_scales_and_nan_codes_are_errors() {
        let mut out = [0f32; 2];
        for s in [0.0f32, -1.0, f32::NAN, f32::INFINITY] {
            assert!(matches!(dequantize_row(&[0x38, 0x38], s, &mut out), Err(CodecError::RowScale { row: 0, .. })));
            assert!(matches!(dot_row(&[0x38, 0x38], s, &[1.0, 1.0]), Err(CodecError::RowScale { .. })));
        }
        assert!(matches!(
            dequantize_row(&[0x38, 0xFF], 1.0, &mut out),
            Err(CodecError::NanE4m3 { index: 1, code: 0xFF, .. })
        ));
        let mut o = [0f32; 2];
        assert!(matches!(
            matvec_rows(&[0x38, 0x38, 0x7F, 0x38], &[1.0, 1.0], &[1.0, 1.0], &mut o),
            Err(CodecError::NanE4m3 { index: 2, code: 0x7F, .. })
        ));
        // A NaN in x is not the weights' fault: the NaN comes back.
        matvec_rows(&[0x38, 0x38], &[1.0], &[f32::NAN, 1.0], &mut o[..1]).unwrap();
        assert!(o[0].is_nan());
    }

    #[test]
    fn dot_matches_f64_and_every_kernel_agrees() {
        // 77 columns: two 32-chunks and a 13-element tail; 7 rows: more than one pass of any
        // rows-per-pass up to four.
        let cols = 77;
        let rows = 7;
        let x: Vec<f32> = (0..cols).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.173).collect();
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 53 % 41) as f32 - 20.0) * 0.031).collect();
        let mut v = vec![0u8; rows * cols];
        let mut s = vec![0f32; rows];
        quantize(&w, cols, &mut v, &mut s).unwrap();
        let mut deq = vec![0f32; rows * cols];
        dequantize(&v, &s, cols, &mut deq).unwrap();
        let mut out = vec![0f32; rows];
        matvec_rows(&v, &s, &x, &mut out).unwrap();
        let mut portable = vec![0f32; rows];
        for r in 0..rows {
            let row = &deq[r * cols..(r + 1) * cols];
            let exact: f64 = row.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
            let mag: f64 = row.iter().zip(&x).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
            assert!((out[r] as f64 - exact).abs() <= 1e-6 * mag, "row {r}: {} vs {exact}", out[r]);
            portable[r] = dot_unscaled(&v[r * cols..(r + 1) * cols], &x) * s[r];
            assert_eq!(dot_row(&v[r * cols..(r + 1) * cols], s[r], &x).unwrap(), out[r]);
        }
        assert_eq!(portable, out, "the best kernel sums in the portable order");
        for isa in Isa::supported() {
            let mut o = vec![0f32; rows];
            matvec_rows_on(isa, &v, &s, &x, &mut o).unwrap();
            assert_eq!(o, out, "{isa:?} sums in the portable order");
        }
    }

    #[test]
    fn sizes_checked() {
        assert_eq!(sizes(3, 5).unwrap(), Sizes { values: 15, scales: 12 });
        assert!(matches!(sizes(u64::MAX, 2), Err(CodecError::Overflow { .. })));
        assert!(matches!(sizes(u64::MAX / 2, 1), Err(CodecError::Overflow { .. })));
    }
}
