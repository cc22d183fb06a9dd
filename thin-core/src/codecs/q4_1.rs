//! GGUF Q4_1 blocks, kept exactly as ggml stores them (the real SmolLM2 GGUF is Q4_1).
//!
//! Layout: a row of `cols` (a multiple of 32) is `cols / 32` `block_q4_1` of 20 bytes: `d`, `m`
//! (f16, little-endian), then `qs[16]`; element `j < 16` is the low nibble of `qs[j]`, element
//! `j + 16` its high nibble, and an element is `q * d + m`. Rows follow each other; there is no
//! separate scale tensor. Dequantization is ggml's `dequantize_row_q4_1` operation for operation
//! (bit-identical); [`quantize_row`] is ggml's `quantize_row_q4_1_ref` (gguf-py's `Q4_1` quantizer
//! computes the same bytes).
//!
//! The dot factors the block: `d * sum(q_i x_i) + m * sum(x_i)`, one multiply by each scale per
//! lane and block, rather than decoding `q * d + m` per element; it is not bit-identical to a dot
//! of the dequantized values, only as accurate.

use super::q8_0::{block_bytes, check_blocks, check_nonfinite_rows};
use super::{check_len, elems, rd_f16, reduce, CodecError, Isa, Sizes, BLOCK, LANES};
use half::f16;

const NAME: &str = "Q4_1";

/// Bytes of one block.
pub const BLOCK_BYTES: usize = 20;

/// Bytes of a `[rows, cols]` Q4_1 matrix (`scales` is 0: the scales are inside the blocks).
pub fn sizes(rows: u64, cols: u64) -> Result<Sizes, CodecError> {
    block_bytes(NAME, BLOCK_BYTES, rows, cols)
}

/// ggml's `quantize_row_q4_1_ref`: per block `d = (max - min) / 15`, `m = min`,
/// `q = min(15, trunc((x - min) / d + 0.5))` (with `1 / d` multiplied), `d` and `m` stored as f16.
/// Non-finite input, or a `d` or `m` beyond f16's range (where ggml would store an infinity), is an
/// error.
pub fn quantize_row(x: &[f32], blocks: &mut [u8]) -> Result<(), CodecError> {
    check_blocks(NAME, BLOCK_BYTES, x.len(), blocks.len())?;
    for (b, (xb, y)) in x.chunks_exact(BLOCK).zip(blocks.chunks_exact_mut(BLOCK_BYTES)).enumerate() {
        let (mut min, mut max) = (f32::MAX, -f32::MAX);
        for (i, &v) in xb.iter().enumerate() {
            if !v.is_finite() {
                return Err(CodecError::NonFiniteInput {
                    dtype: NAME,
                    index: (b * BLOCK + i) as u64,
                    value: v,
                });
            }
            // ggml's comparisons, so a -0.0 after a 0.0 does not become the minimum.
            if v < min {
                min = v;
            }
            if v > max {
                max = v;
            }
        }
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let (dh, mh) = (f16::from_f32(d), f16::from_f32(min));
        if !dh.is_finite() || !mh.is_finite() {
            return Err(CodecError::NonFinite { dtype: NAME, block: b as u64 });
        }
        y[0..2].copy_from_slice(&dh.to_bits().to_le_bytes());
        y[2..4].copy_from_slice(&mh.to_bits().to_le_bytes());
        let q = |v: f32| (((v - min) * id + 0.5) as i8).min(15) as u8;
        for j in 0..BLOCK / 2 {
            y[4 + j] = q(xb[j]) | (q(xb[j + BLOCK / 2]) << 4);
        }
    }
    Ok(())
}

/// ggml's `dequantize_row_q4_1`: `out[j] = q_j * d + m` per block; `out.len()` elements (whole
/// blocks) from exactly their blocks. A non-finite `d` or `m` is [`CodecError::NonFinite`].
pub fn dequantize_row(blocks: &[u8], out: &mut [f32]) -> Result<(), CodecError> {
    check_blocks(NAME, BLOCK_BYTES, out.len(), blocks.len())?;
    for (i, (y, b)) in out.chunks_exact_mut(BLOCK).zip(blocks.chunks_exact(BLOCK_BYTES)).enumerate() {
        let (d, m) = (rd_f16(b, 0), rd_f16(b, 2));
        if !d.is_finite() || !m.is_finite() {
            return Err(CodecError::NonFinite { dtype: NAME, block: i as u64 });
        }
        let qs = &b[4..];
        let (lo, hi) = y.split_at_mut(BLOCK / 2);
        for j in 0..BLOCK / 2 {
            lo[j] = (qs[j] & 0x0F) as f32 * d + m;
            hi[j] = (qs[j] >> 4) as f32 * d + m;
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

/// `sum_b (d_b * sum_{i in b} q_i x_i + m_b * sum_{i in b} x_i)` in the codecs' lane order: lane
/// `l` of a block is `t = q_l x_l + q_{l+16} x_{l+16}` (the low and the high nibble of `qs[l]`)
/// and `s = x_l + x_{l+16}`, and `t * d + s * m` is added to the row's lane `l`.
#[inline(always)]
fn dot(blocks: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    for (b, xb) in blocks.chunks_exact(BLOCK_BYTES).zip(x.chunks_exact(BLOCK)) {
        let (d, m) = (rd_f16(b, 0), rd_f16(b, 2));
        let qs = &b[4..];
        for l in 0..LANES {
            let (lo, hi) = (xb[l], xb[l + LANES]);
            let t = (qs[l] & 0x0F) as f32 * lo + (qs[l] >> 4) as f32 * hi;
            acc[l] += t * d + (lo + hi) * m;
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

/// AVX2: lanes 0..8 and 8..16 in two registers; nibbles widened to f32 eight at a time.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::x86::{f16_pair, sum16_256};
    use super::super::BLOCK;
    use super::BLOCK_BYTES;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,f16c")]
    pub fn rows(blocks: &[u8], x: &[f32], out: &mut [f32]) {
        let nb = x.len() / BLOCK;
        let m0f = _mm_set1_epi8(0x0F);
        let wide = |c: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c));
        for (r, o) in out.iter_mut().enumerate() {
            let row = &blocks[r * nb * BLOCK_BYTES..(r + 1) * nb * BLOCK_BYTES];
            let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            for (b, blk) in row.chunks_exact(BLOCK_BYTES).enumerate() {
                // SAFETY: 4 + 16 <= 20 == blk.len(); 32b + 32 <= x.len(); unaligned loads.
                let (q, dm, xs) = unsafe {
                    let xs = |k: usize| _mm256_loadu_ps(x.as_ptr().add(BLOCK * b + 8 * k));
                    (_mm_loadu_si128(blk.as_ptr().add(4) as *const __m128i), f16_pair(blk.as_ptr()), [xs(0), xs(1), xs(2), xs(3)])
                };
                let lo = _mm_and_si128(q, m0f);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(q), m0f);
                let (d, m) = (_mm256_broadcastss_ps(dm), _mm256_broadcastss_ps(_mm_movehdup_ps(dm)));
                let t0 = _mm256_add_ps(_mm256_mul_ps(wide(lo), xs[0]), _mm256_mul_ps(wide(hi), xs[2]));
                let t1 = _mm256_add_ps(_mm256_mul_ps(wide(_mm_srli_si128::<8>(lo)), xs[1]), _mm256_mul_ps(wide(_mm_srli_si128::<8>(hi)), xs[3]));
                let (s0, s1) = (_mm256_add_ps(xs[0], xs[2]), _mm256_add_ps(xs[1], xs[3]));
                a0 = _mm256_add_ps(a0, _mm256_add_ps(_mm256_mul_ps(t0, d), _mm256_mul_ps(s0, m)));
                a1 = _mm256_add_ps(a1, _mm256_add_ps(_mm256_mul_ps(t1, d), _mm256_mul_ps(s1, m)));
            }
            *o = sum16_256(a0, a1);
        }
    }
}

/// AVX-512: a block's 16 bytes widened to 16 lanes; a lane permute of the table 0..15 (which reads
/// only an index's low 4 bits) turns the low nibbles into f32, and after a shift the high ones.
/// `R` rows at a time share the loads of `x` and its block sums.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::super::x86::{call_tile, f16_pair, sum16_512, tile_walk};
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
    /// operations per (row, token), each block's nibbles and scales decoded once per tile.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,f16c")]
    fn tile<const R: usize, const T: usize>(blocks: &[u8], x: &[f32], cols: usize, outs: &mut [&mut [f32]], r0: usize) {
        let nb = cols / BLOCK;
        let row_bytes = nb * BLOCK_BYTES;
        assert!(blocks.len() == R * row_bytes && x.len() == T * cols && outs.len() == T);
        let nibble = _mm512_setr_ps(0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0);
        let mut acc = [[_mm512_setzero_ps(); R]; T];
        for b in 0..nb {
            let mut w = [[_mm512_setzero_ps(); 4]; R];
            for (n, w) in w.iter_mut().enumerate() {
                // SAFETY: n * row_bytes + b * 20 + 20 <= blocks.len() (asserted shape); unaligned loads.
                let (q, dm) = unsafe {
                    let p = blocks.as_ptr().add(n * row_bytes + b * BLOCK_BYTES);
                    (_mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(4) as *const __m128i)), f16_pair(p))
                };
                *w = [
                    _mm512_permutexvar_ps(q, nibble),
                    _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(q), nibble),
                    _mm512_broadcastss_ps(dm),
                    _mm512_broadcastss_ps(_mm_movehdup_ps(dm)),
                ];
            }
            for (t, a) in acc.iter_mut().enumerate() {
                // SAFETY: t * cols + 32b + 32 <= x.len() (asserted shape); unaligned loads.
                let (x0, x1) = unsafe { (_mm512_loadu_ps(x.as_ptr().add(t * cols + BLOCK * b)), _mm512_loadu_ps(x.as_ptr().add(t * cols + BLOCK * b + 16))) };
                let s = _mm512_add_ps(x0, x1);
                for (a, [lo, hi, d, m]) in a.iter_mut().zip(&w) {
                    let t = _mm512_add_ps(_mm512_mul_ps(*lo, x0), _mm512_mul_ps(*hi, x1));
                    *a = _mm512_add_ps(*a, _mm512_add_ps(_mm512_mul_ps(t, *d), _mm512_mul_ps(s, *m)));
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
        let nibble = _mm512_setr_ps(0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0);
        let mut acc = [_mm512_setzero_ps(); N];
        for b in 0..nb {
            // SAFETY: 32b + 32 <= x.len(); unaligned loads.
            let (x0, x1) = unsafe { (_mm512_loadu_ps(x.as_ptr().add(BLOCK * b)), _mm512_loadu_ps(x.as_ptr().add(BLOCK * b + 16))) };
            let s = _mm512_add_ps(x0, x1);
            for (n, a) in acc.iter_mut().enumerate() {
                // SAFETY: n * row_bytes + b * 20 + 20 <= blocks.len() (asserted shape); unaligned loads.
                let (q, dm) = unsafe {
                    let p = blocks.as_ptr().add(n * row_bytes + b * BLOCK_BYTES);
                    (_mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(4) as *const __m128i)), f16_pair(p))
                };
                let lo = _mm512_permutexvar_ps(q, nibble);
                let hi = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(q), nibble);
                let (d, m) = (_mm512_broadcastss_ps(dm), _mm512_broadcastss_ps(_mm_movehdup_ps(dm)));
                let t = _mm512_add_ps(_mm512_mul_ps(lo, x0), _mm512_mul_ps(hi, x1));
                *a = _mm512_add_ps(*a, _mm512_add_ps(_mm512_mul_ps(t, d), _mm512_mul_ps(s, m)));
            }
        }
        for (o, a) in out.iter_mut().zip(acc) {
            *o = sum16_512(a);
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
    check_nonfinite_rows(NAME, BLOCK_BYTES, &[0, 2], blocks, x.len(), out)
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
    check_len(NAME, "x", elems(NAME, outs.len(), cols)?, x.len())?;
    check_blocks(NAME, BLOCK_BYTES, cols, cols / BLOCK * BLOCK_BYTES)?;
    check_blocks(NAME, BLOCK_BYTES, elems(NAME, rows, cols)?, blocks.len())?;
    for o in outs.iter() {
        check_len(NAME, "outputs", rows, o.len())?;
    }
    match isa.clamp() {
        // SAFETY: `clamp` returns a level this CPU runs.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if cols > 0 => unsafe { avx512::tiles(blocks, x, cols, outs) },
        _ => {
            for (xt, o) in x.chunks_exact(cols.max(1)).zip(outs.iter_mut()) {
                rows_dispatch(isa, blocks, xt, o);
            }
        }
    }
    for o in outs.iter() {
        check_nonfinite_rows(NAME, BLOCK_BYTES, &[0, 2], blocks, cols, o)?;
    }
    Ok(())
}

/// Bytes of [`split_blocks`]'s output for `n` blocks.
pub fn split_len(n: usize) -> usize {
    (n * 16).next_multiple_of(64) + 4 * n
}

/// GGUF Q4_1 blocks (`d`, `m` f16, then 16 nibble bytes: 20 bytes each) split for the GPU
/// kernels, which load a block's 16 nibble bytes at once and need them 16-byte aligned: every
/// block's 16 bytes in order, then (from the next multiple of 64 bytes) every block's `d`, `m`
/// pair in order. The same bytes, moved.
pub fn split_blocks(blocks: &[u8]) -> Result<Vec<u8>, CodecError> {
    if blocks.len() % BLOCK_BYTES != 0 {
        return Err(CodecError::PartialBlock { dtype: NAME, count: blocks.len() as u64, block_elems: BLOCK_BYTES as u64 });
    }
    let n = blocks.len() / BLOCK_BYTES;
    let scales_at = (n * 16).next_multiple_of(64);
    let mut out = vec![0u8; split_len(n)];
    for (k, b) in blocks.chunks_exact(BLOCK_BYTES).enumerate() {
        out[16 * k..16 * k + 16].copy_from_slice(&b[4..]);
        out[scales_at + 4 * k..scales_at + 4 * k + 4].copy_from_slice(&b[..4]);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_bits().to_le_bytes()
    }

    /// d = 0.25, m = -1; element j (j < 16) has q = j, element j + 16 has q = 15 - j.
    fn hand_block() -> Vec<u8> {
        let mut b = h(0.25).to_vec();
        b.extend_from_slice(&h(-1.0));
        for j in 0..16u8 {
            b.push(j | ((15 - j) << 4));
        }
        b
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
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for isa in Isa::supported() {
            let mut got = vec![0.0; tokens * rows];
            let mut outs: Vec<&mut [f32]> = got.chunks_exact_mut(rows).collect();
            matmul_rows_on(isa, &blocks, &x, cols, &mut outs).unwrap();
            assert_eq!(bits(&got), bits(&want), "{isa:?}");
        }
        // A NaN scale is named, as matvec_rows names it.
        blocks[BLOCK_BYTES * 4 + 2..BLOCK_BYTES * 4 + 4].copy_from_slice(&f16::from_f32(f32::NAN).to_le_bytes());
        let mut got = vec![0.0; tokens * rows];
        let mut outs: Vec<&mut [f32]> = got.chunks_exact_mut(rows).collect();
        let e = matmul_rows(&blocks, &x, cols, &mut outs).unwrap_err();
        let mut one = vec![0.0; rows];
        assert_eq!(e, matvec_rows(&blocks, &x[..cols], &mut one).unwrap_err());
    }

    #[test]
    fn hand_block_decodes_in_ggml_nibble_order() {
        let b = hand_block();
        let mut out = [0f32; 32];
        dequantize_row(&b, &mut out).unwrap();
        for j in 0..16 {
            assert_eq!(out[j], j as f32 * 0.25 - 1.0);
            assert_eq!(out[j + 16], (15 - j) as f32 * 0.25 - 1.0);
        }
        // x = e_k picks element k out.
        for k in [0, 5, 15, 16, 21, 31] {
            let mut x = [0.0f32; 32];
            x[k] = 1.0;
            assert_eq!(dot_row(&b, &x).unwrap(), out[k], "k={k}");
        }
        // sum over all: 0.25 * (2 * 120) - 32 = 28
        assert_eq!(dot_row(&b, &[1.0; 32]).unwrap(), 28.0);
    }

    #[test]
    fn nonfinite_scales() {
        let mut b = hand_block();
        b.extend(hand_block());
        b[22..24].copy_from_slice(&h(f32::NAN));
        let mut out = [0f32; 64];
        assert!(matches!(dequantize_row(&b, &mut out), Err(CodecError::NonFinite { block: 1, .. })));
        let mut o = [0f32; 1];
        assert!(matches!(matvec_rows(&b, &[1.0; 64], &mut o), Err(CodecError::NonFinite { block: 1, .. })));
    }

    #[test]
    fn quantize_like_ggml_ref() {
        // min -1, max 14: d = 1, q = trunc(x + 1 + 0.5) capped at 15: 0.49 -> 1 (1.99), 0.5 -> 2.
        let mut x = [0.0f32; 32];
        x[0] = -1.0;
        x[1] = 14.0;
        x[2] = 0.49;
        x[3] = 0.5;
        x[16] = 3.0;
        let mut b = [0u8; 20];
        quantize_row(&x, &mut b).unwrap();
        assert_eq!(&b[0..2], &h(1.0));
        assert_eq!(&b[2..4], &h(-1.0));
        // element 0: q 0, element 16: q 4 -> qs[0] = 0x40
        assert_eq!(b[4], 0x40);
        assert_eq!(b[5] & 0x0F, 15);
        assert_eq!(b[6] & 0x0F, 1);
        assert_eq!(b[7] & 0x0F, 2);
        // zeros elsewhere: (0 + 1) * 1 + 0.5 -> 1
        assert_eq!(b[8], 0x11);
        // A constant block: d = 0, all q = 0, m = the constant.
        quantize_row(&[2.0; 32], &mut b).unwrap();
        assert_eq!(&b[0..4], &[h(0.0), h(2.0)].concat()[..]);
        assert_eq!(&b[4..], &[0u8; 16]);
        assert!(matches!(quantize_row(&[-7e4; 32], &mut b), Err(CodecError::NonFinite { .. })));
        let mut bad = [0.0f32; 32];
        bad[31] = f32::NEG_INFINITY;
        assert!(matches!(quantize_row(&bad, &mut b), Err(CodecError::NonFiniteInput { index: 31, .. })));
    }

    #[test]
    fn sizes_checked() {
        assert_eq!(sizes(2, 96).unwrap(), Sizes { values: 2 * 3 * 20, scales: 0 });
        assert!(matches!(sizes(2, 100), Err(CodecError::PartialBlock { .. })));
        assert!(matches!(sizes(u64::MAX, 32), Err(CodecError::Overflow { .. })));
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
    fn split_blocks_moves_nibbles_then_scale_pairs() {
        // Five blocks: d, m = (k, 100 + k) as raw f16 bits, nibble bytes 7k + i.
        let mut blocks = Vec::new();
        for k in 0..5u16 {
            blocks.extend(k.to_le_bytes());
            blocks.extend((100 + k).to_le_bytes());
            blocks.extend((0..16).map(|i| (k as u8 * 7).wrapping_add(i)));
        }
        let out = split_blocks(&blocks).unwrap();
        assert_eq!(out.len(), 128 + 20, "80 nibble bytes padded to 128, then 5 (d, m) pairs");
        for k in 0..5 {
            assert_eq!(&out[16 * k..16 * k + 16], &blocks[20 * k + 4..20 * k + 20]);
            assert_eq!(&out[128 + 4 * k..132 + 4 * k], &blocks[20 * k..20 * k + 4]);
        }
        assert!(out[80..128].iter().all(|&b| b == 0));
        assert!(matches!(split_blocks(&blocks[..19]), Err(CodecError::PartialBlock { .. })));
    }
}
