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
