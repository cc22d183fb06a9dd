//! Small x86-64 pieces the codecs' (and the bf16) AVX2 and AVX-512 kernels share: lane sums in the
//! order of [`super::reduce`] and f16/e8m0 scales as broadcast registers.

use std::arch::x86_64::*;

/// `reduce::<16>` of the lanes of `a` (lanes 0..8) and `b` (lanes 8..16): 8 + 8, 4 + 4, 2 + 2, 1 + 1.
#[inline]
#[target_feature(enable = "avx2")]
pub fn sum16_256(a: __m256, b: __m256) -> f32 {
    sum8(_mm256_add_ps(a, b))
}

/// `reduce::<8>` of the lanes of `a`: 4 + 4, 2 + 2, 1 + 1.
#[inline]
#[target_feature(enable = "avx2")]
pub fn sum8(a: __m256) -> f32 {
    let v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
    let v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)))
}

/// `reduce::<16>` of the lanes of `a`.
#[inline]
#[target_feature(enable = "avx512f,avx2")]
pub fn sum16_512(a: __m512) -> f32 {
    sum8(_mm256_add_ps(_mm512_castps512_ps256(a), upper8(a)))
}

/// Lanes 8..16 of `a` (`vextractf64x4`, AVX-512F; `_mm512_extractf32x8_ps` would need DQ).
#[inline]
#[target_feature(enable = "avx512f")]
pub fn upper8(a: __m512) -> __m256 {
    _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)))
}

/// The f16 with bits `h` as f32 (F16C; exact).
#[inline]
#[target_feature(enable = "f16c")]
pub fn f16_to_f32(h: u16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// The two f16 at `p[0..4]` (little-endian), as f32 lanes 0 and 1.
///
/// # Safety
/// `p` must point to 4 readable bytes.
#[inline]
#[target_feature(enable = "f16c")]
pub unsafe fn f16_pair(p: *const u8) -> __m128 {
    // SAFETY: the caller guarantees 4 readable bytes; unaligned read.
    let bits = unsafe { (p as *const i32).read_unaligned() };
    _mm_cvtph_ps(_mm_cvtsi32_si128(bits))
}

/// Weight rows of one register tile of the prefill kernels.
pub const TILE_ROWS: usize = 4;
/// Prompt tokens of one register tile of the prefill kernels.
pub const TILE_TOKENS: usize = 4;

/// The prefill kernels' walk over `rows x tokens`: `(r, nr, t, nt)` for each tile of [`TILE_ROWS`]
/// rows from `r` and [`TILE_TOKENS`] tokens from `t`, or single rows and tokens at the edges.
pub fn tile_walk(rows: usize, tokens: usize) -> impl Iterator<Item = (usize, usize, usize, usize)> {
    starts(rows, TILE_ROWS).flat_map(move |(r, nr)| starts(tokens, TILE_TOKENS).map(move |(t, nt)| (r, nr, t, nt)))
}

/// `(start, len)` of the runs of `tile` (then of 1) that cover `0..n`.
fn starts(n: usize, tile: usize) -> impl Iterator<Item = (usize, usize)> + Clone {
    let len = move |i: usize| if i + tile <= n { tile } else { 1 };
    std::iter::successors(Some(0), move |&i| Some(i + len(i))).take_while(move |&i| i < n).map(move |i| (i, len(i)))
}

/// `$tile::<R, T>($args)` for the tile size `(nr, nt)` that [`tile_walk`] gave.
macro_rules! call_tile {
    ($tile:ident, $nr:expr, $nt:expr, ($($arg:expr),* $(,)?)) => {
        match ($nr, $nt) {
            ($crate::codecs::x86::TILE_ROWS, $crate::codecs::x86::TILE_TOKENS) => $tile::<{ $crate::codecs::x86::TILE_ROWS }, { $crate::codecs::x86::TILE_TOKENS }>($($arg),*),
            ($crate::codecs::x86::TILE_ROWS, _) => $tile::<{ $crate::codecs::x86::TILE_ROWS }, 1>($($arg),*),
            (_, $crate::codecs::x86::TILE_TOKENS) => $tile::<1, { $crate::codecs::x86::TILE_TOKENS }>($($arg),*),
            _ => $tile::<1, 1>($($arg),*),
        }
    };
}
pub(crate) use call_tile;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tile_walk_covers_every_row_and_token_once() {
        for (rows, tokens) in [(0, 5), (5, 0), (1, 1), (6, 6), (8, 4), (9, 13)] {
            let mut seen = vec![0u8; rows * tokens];
            for (r, nr, t, nt) in tile_walk(rows, tokens) {
                assert!((nr == TILE_ROWS || nr == 1) && (nt == TILE_TOKENS || nt == 1));
                for i in r..r + nr {
                    for j in t..t + nt {
                        seen[i * tokens + j] += 1;
                    }
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "{rows} x {tokens}");
        }
        // Whole tiles first, single rows and tokens only at the edges.
        let walk: Vec<_> = tile_walk(5, 5).collect();
        assert_eq!(walk[0], (0, 4, 0, 4));
        assert_eq!(walk[1], (0, 4, 4, 1));
        assert_eq!(walk[2], (4, 1, 0, 4));
    }
}
