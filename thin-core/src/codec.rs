//! Source decoding: GGUF block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) and F16/BF16/F32 to f32, and f32 to the storage types.
//!
//! Q8_0 and Q4_1, which an archive can also keep as stored, live in [`crate::codecs`] (with their
//! quantizers and matvecs); this decoder calls them. The archive's own formats (FP8, MXFP4) are
//! there too.
//!
//! The block layouts and the dequantization arithmetic follow ggml (`ggml-quants.c`,
//! `dequantize_row_*`) operation for operation, so results are bit-identical to ggml and to
//! gguf-py's `gguf.quants.dequantize` (no fused multiply-add: Rust does not contract).
//!
//! Decoding works block by block on the caller's output slice and never allocates; callers
//! parallelise over rows.

use crate::dtype::SourceDType;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use half::{bf16, f16};

pub use crate::codecs::CodecError;
use crate::codecs::{q4_1, q8_0, rd_f16};

#[inline(always)]
fn check_scale(v: f32, dtype: &'static str, block: usize) -> Result<f32, CodecError> {
    if v.is_finite() {
        Ok(v)
    } else {
        Err(CodecError::NonFinite {
            dtype,
            block: block as u64,
        })
    }
}

/// Decodes `n = out.len()` elements of `dtype` from `bytes` (exactly `dtype.bytes_for(n)` bytes)
/// into `out[..n]`.
///
/// Block formats: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K exactly as ggml; plus F32/F16/BF16.
/// Returns [`CodecError::NonFinite`] if a block's f16 scale (`d`/`dmin`) is NaN or infinite, and
/// [`CodecError::Length`]/[`CodecError::PartialBlock`] on a size mismatch. `out` is unspecified
/// after an error.
pub fn decode_to_f32(dtype: SourceDType, bytes: &[u8], out: &mut [f32]) -> Result<(), CodecError> {
    let name = dtype.name();
    let n = out.len() as u64;
    let (per, bpb) = dtype.block();
    if !n.is_multiple_of(per) {
        return Err(CodecError::PartialBlock {
            dtype: name,
            count: n,
            block_elems: per,
        });
    }
    let expected = (n / per).checked_mul(bpb).ok_or(CodecError::Length {
        dtype: name,
        what: "bytes",
        expected: u64::MAX,
        got: bytes.len() as u64,
    })?;
    if expected != bytes.len() as u64 {
        return Err(CodecError::Length {
            dtype: name,
            what: "bytes",
            expected,
            got: bytes.len() as u64,
        });
    }
    let per = per as usize;
    let bpb = bpb as usize;
    match dtype {
        SourceDType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        SourceDType::F16 => {
            // Bits through a stack buffer, then half's slice conversion (F16C when the CPU has it).
            let mut bits = [0u16; 512];
            for (o, c) in out.chunks_mut(512).zip(bytes.chunks(1024)) {
                let bits = &mut bits[..o.len()];
                for (d, s) in bits.iter_mut().zip(c.chunks_exact(2)) {
                    *d = u16::from_le_bytes([s[0], s[1]]);
                }
                let halves: &[f16] = bits.reinterpret_cast();
                halves.convert_to_f32_slice(o);
            }
        }
        SourceDType::Bf16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        SourceDType::Q8_0 => q8_0::dequantize_row(bytes, out)?,
        SourceDType::Q4_0 => {
            for (i, (y, b)) in out.chunks_exact_mut(per).zip(bytes.chunks_exact(bpb)).enumerate() {
                let d = check_scale(rd_f16(b, 0), name, i)?;
                let qs = &b[2..18];
                let (lo, hi) = y.split_at_mut(16);
                for j in 0..16 {
                    lo[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
                    hi[j] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        SourceDType::Q4_1 => q4_1::dequantize_row(bytes, out)?,
        SourceDType::Q5_0 => {
            for (i, (y, b)) in out.chunks_exact_mut(per).zip(bytes.chunks_exact(bpb)).enumerate() {
                let d = check_scale(rd_f16(b, 0), name, i)?;
                let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                let (lo, hi) = y.split_at_mut(16);
                for (j, &q) in b[6..22].iter().enumerate() {
                    let (x0, x1) = q5_pair(q, qh, j);
                    lo[j] = (x0 as i32 - 16) as f32 * d;
                    hi[j] = (x1 as i32 - 16) as f32 * d;
                }
            }
        }
        SourceDType::Q5_1 => {
            for (i, (y, b)) in out.chunks_exact_mut(per).zip(bytes.chunks_exact(bpb)).enumerate() {
                let d = check_scale(rd_f16(b, 0), name, i)?;
                let m = check_scale(rd_f16(b, 2), name, i)?;
                let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
                let (lo, hi) = y.split_at_mut(16);
                for (j, &q) in b[8..24].iter().enumerate() {
                    let (x0, x1) = q5_pair(q, qh, j);
                    lo[j] = x0 as f32 * d + m;
                    hi[j] = x1 as f32 * d + m;
                }
            }
        }
        SourceDType::Q4K => {
            for (i, (y, b)) in out.chunks_exact_mut(per).zip(bytes.chunks_exact(bpb)).enumerate() {
                let d = check_scale(rd_f16(b, 0), name, i)?;
                let dmin = check_scale(rd_f16(b, 2), name, i)?;
                let scales = &b[4..16];
                let qs = &b[16..144];
                for (g, (yg, q)) in y.chunks_exact_mut(64).zip(qs.chunks_exact(32)).enumerate() {
                    let (sc1, m1) = scale_min_k4(2 * g, scales);
                    let (sc2, m2) = scale_min_k4(2 * g + 1, scales);
                    let d1 = d * sc1 as f32;
                    let m1 = dmin * m1 as f32;
                    let d2 = d * sc2 as f32;
                    let m2 = dmin * m2 as f32;
                    let (lo, hi) = yg.split_at_mut(32);
                    for l in 0..32 {
                        lo[l] = d1 * (q[l] & 0x0F) as f32 - m1;
                        hi[l] = d2 * (q[l] >> 4) as f32 - m2;
                    }
                }
            }
        }
        SourceDType::Q5K => {
            for (i, (y, b)) in out.chunks_exact_mut(per).zip(bytes.chunks_exact(bpb)).enumerate() {
                let d = check_scale(rd_f16(b, 0), name, i)?;
                let dmin = check_scale(rd_f16(b, 2), name, i)?;
                let scales = &b[4..16];
                let qh = &b[16..48];
                let qs = &b[48..176];
                for (g, (yg, ql)) in y.chunks_exact_mut(64).zip(qs.chunks_exact(32)).enumerate() {
                    let (sc1, m1) = scale_min_k4(2 * g, scales);
                    let (sc2, m2) = scale_min_k4(2 * g + 1, scales);
                    let d1 = d * sc1 as f32;
                    let m1 = dmin * m1 as f32;
                    let d2 = d * sc2 as f32;
                    let m2 = dmin * m2 as f32;
                    let u1 = 1u8 << (2 * g);
                    let u2 = 2u8 << (2 * g);
                    let (lo, hi) = yg.split_at_mut(32);
                    for l in 0..32 {
                        let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
                        let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
                        lo[l] = d1 * ((ql[l] & 0x0F) + h1) as f32 - m1;
                        hi[l] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
                    }
                }
            }
        }
        SourceDType::Q6K => {
            for (i, (y, b)) in out.chunks_exact_mut(per).zip(bytes.chunks_exact(bpb)).enumerate() {
                let d = check_scale(rd_f16(b, 208), name, i)?;
                let ql_all = &b[0..128];
                let qh_all = &b[128..192];
                let sc_all = &b[192..208];
                for h in 0..2 {
                    let yh = &mut y[h * 128..h * 128 + 128];
                    let ql = &ql_all[h * 64..h * 64 + 64];
                    let qh = &qh_all[h * 32..h * 32 + 32];
                    let sc = &sc_all[h * 8..h * 8 + 8];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        yh[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                        yh[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                        yh[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                        yh[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                    }
                }
            }
        }
    }
    Ok(())
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of sub-block `j` (0..8) of a K-quant block.
#[inline(always)]
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The 5-bit values `j` and `j + 16` of a Q5_0/Q5_1 block: nibbles of `qs[j]`, fifth bits from
/// bits `j` and `j + 16` of `qh` (ggml's `xh_0`/`xh_1`).
#[inline(always)]
fn q5_pair(q: u8, qh: u32, j: usize) -> (u8, u8) {
    let h0 = (((qh >> j) << 4) & 0x10) as u8;
    let h1 = ((qh >> (j + 12)) & 0x10) as u8;
    ((q & 0x0F) | h0, (q >> 4) | h1)
}

/// Replaces the contents of `out` with `src` as little-endian BF16, rounded to nearest even
/// (`half::bf16::from_f32`; NaN stays NaN).
pub fn f32_to_bf16_bytes(src: &[f32], out: &mut Vec<u8>) {
    out.clear();
    out.reserve(src.len() * 2);
    for &v in src {
        out.extend_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes());
    }
}

/// Replaces the contents of `out` with `src` as little-endian F32.
pub fn f32_to_le_bytes(src: &[f32], out: &mut Vec<u8>) {
    out.clear();
    out.reserve(src.len() * 4);
    for &v in src {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_bits().to_le_bytes()
    }

    fn dec(dt: SourceDType, b: &[u8], n: usize) -> Vec<f32> {
        let mut out = vec![0f32; n];
        decode_to_f32(dt, b, &mut out).expect("decode");
        out
    }

    #[test]
    fn plain_types() {
        let mut b = Vec::new();
        for v in [1.5f32, -2.0, 0.0] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        assert_eq!(dec(SourceDType::F32, &b, 3), vec![1.5, -2.0, 0.0]);
        let b: Vec<u8> = [0.5f32, -3.25].iter().flat_map(|&v| h(v)).collect();
        assert_eq!(dec(SourceDType::F16, &b, 2), vec![0.5, -3.25]);
        let b: Vec<u8> = [1.0f32, -0.375]
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_bits().to_le_bytes())
            .collect();
        assert_eq!(dec(SourceDType::Bf16, &b, 2), vec![1.0, -0.375]);
    }

    #[test]
    fn f16_long_matches_scalar() {
        let vals: Vec<f32> = (0..1301).map(|i| (i as f32 - 650.0) * 0.37).collect();
        let b: Vec<u8> = vals.iter().flat_map(|&v| h(v)).collect();
        let out = dec(SourceDType::F16, &b, vals.len());
        for (i, &v) in vals.iter().enumerate() {
            assert_eq!(out[i], f16::from_f32(v).to_f32(), "i={i}");
        }
    }

    #[test]
    fn q8_0() {
        let mut b = h(0.5).to_vec();
        for i in 0..32 {
            b.push((i as i8 - 16) as u8);
        }
        let want: Vec<f32> = (0..32).map(|i| (i as f32 - 16.0) * 0.5).collect();
        assert_eq!(dec(SourceDType::Q8_0, &b, 32), want);
        b.push(0);
        let mut out = vec![0f32; 32];
        assert!(matches!(
            decode_to_f32(SourceDType::Q8_0, &b, &mut out),
            Err(CodecError::Length {
                expected: 34,
                got: 35,
                ..
            })
        ));
        let mut out = vec![0f32; 31];
        assert!(matches!(
            decode_to_f32(SourceDType::Q8_0, &b[..34], &mut out),
            Err(CodecError::PartialBlock { .. })
        ));
    }

    #[test]
    fn q8_0_nonfinite_scale() {
        let mut b = vec![0u8; 68];
        b[34..36].copy_from_slice(&h(f32::NAN));
        let mut out = vec![0f32; 64];
        assert!(matches!(
            decode_to_f32(SourceDType::Q8_0, &b, &mut out),
            Err(CodecError::NonFinite { block: 1, .. })
        ));
        b[34..36].copy_from_slice(&h(f32::INFINITY));
        assert!(decode_to_f32(SourceDType::Q8_0, &b, &mut out).is_err());
    }

    #[test]
    fn q4_0_and_q4_1() {
        let mut b = h(2.0).to_vec();
        for j in 0..16u8 {
            b.push(j | ((15 - j) << 4));
        }
        let out = dec(SourceDType::Q4_0, &b, 32);
        for j in 0..16 {
            assert_eq!(out[j], (j as f32 - 8.0) * 2.0);
            assert_eq!(out[j + 16], ((15 - j) as f32 - 8.0) * 2.0);
        }
        let mut b = h(0.25).to_vec();
        b.extend_from_slice(&h(-1.0));
        for j in 0..16u8 {
            b.push(j | ((15 - j) << 4));
        }
        let out = dec(SourceDType::Q4_1, &b, 32);
        for j in 0..16 {
            assert_eq!(out[j], j as f32 * 0.25 - 1.0);
            assert_eq!(out[j + 16], (15 - j) as f32 * 0.25 - 1.0);
        }
        b[2..4].copy_from_slice(&h(f32::NAN));
        let mut o = vec![0f32; 32];
        assert!(matches!(
            decode_to_f32(SourceDType::Q4_1, &b, &mut o),
            Err(CodecError::NonFinite { .. })
        ));
    }

    /// A Q5 block's `qh` and `qs` holding the 5-bit `vals` (element `j` low nibble of `qs[j]`,
    /// element `j + 16` high nibble; fifth bit of element `e` at bit `e` of `qh`).
    fn pack_q5(vals: &[u8; 32]) -> Vec<u8> {
        let qh: u32 = (0..32).filter(|&e| vals[e] & 16 != 0).map(|e| 1u32 << e).sum();
        let mut b = qh.to_le_bytes().to_vec();
        b.extend((0..16).map(|j| (vals[j] & 15) | ((vals[j + 16] & 15) << 4)));
        b
    }

    #[test]
    fn q5_0_and_q5_1() {
        let mut vals = [0u8; 32];
        for (e, v) in vals.iter_mut().enumerate() {
            *v = ((e * 7 + 3) % 32) as u8;
        }
        vals[0] = 31;
        vals[17] = 16;
        vals[31] = 0;
        let mut b = h(0.75).to_vec();
        b.extend_from_slice(&pack_q5(&vals));
        assert_eq!(b.len(), 22);
        let out = dec(SourceDType::Q5_0, &b, 32);
        for e in 0..32 {
            assert_eq!(out[e], (vals[e] as f32 - 16.0) * 0.75, "e={e}");
        }
        assert_eq!((out[0], out[17], out[31]), (11.25, 0.0, -12.0));
        let mut b = h(0.5).to_vec();
        b.extend_from_slice(&h(-3.0));
        b.extend_from_slice(&pack_q5(&vals));
        assert_eq!(b.len(), 24);
        let out = dec(SourceDType::Q5_1, &b, 32);
        for e in 0..32 {
            assert_eq!(out[e], vals[e] as f32 * 0.5 - 3.0, "e={e}");
        }
        assert_eq!((out[0], out[17], out[31]), (12.5, 5.0, -3.0));
        let mut o = vec![0f32; 32];
        assert!(matches!(
            decode_to_f32(SourceDType::Q5_1, &b[..23], &mut o),
            Err(CodecError::Length { dtype: "Q5_1", expected: 24, got: 23, .. })
        ));
        let mut o = vec![0f32; 16];
        assert!(matches!(
            decode_to_f32(SourceDType::Q5_0, &b[..22], &mut o),
            Err(CodecError::PartialBlock { dtype: "Q5_0", count: 16, block_elems: 32 })
        ));
        b[2..4].copy_from_slice(&h(f32::INFINITY));
        let mut o = vec![0f32; 32];
        assert!(matches!(
            decode_to_f32(SourceDType::Q5_1, &b, &mut o),
            Err(CodecError::NonFinite { dtype: "Q5_1", block: 0 })
        ));
    }

    /// Packs 8 (scale, min) 6-bit pairs the way ggml's K-quants do.
    fn pack_k4(sc: [u8; 8], mn: [u8; 8]) -> [u8; 12] {
        let mut q = [0u8; 12];
        for j in 0..4 {
            q[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
            q[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
            q[j + 8] = (sc[j + 4] & 0x0F) | ((mn[j + 4] & 0x0F) << 4);
        }
        q
    }

    #[test]
    fn k4_scale_packing() {
        let sc = [1, 2, 3, 63, 17, 33, 48, 62];
        let mn = [5, 0, 63, 7, 40, 19, 2, 61];
        let q = pack_k4(sc, mn);
        for j in 0..8 {
            assert_eq!(scale_min_k4(j, &q), (sc[j], mn[j]));
        }
    }

    #[test]
    fn q4_k() {
        let sc = [1, 2, 3, 4, 5, 6, 7, 63];
        let mn = [0, 1, 2, 3, 60, 5, 6, 7];
        let (d, dmin) = (0.5f32, 0.25f32);
        let mut b = h(d).to_vec();
        b.extend_from_slice(&h(dmin));
        b.extend_from_slice(&pack_k4(sc, mn));
        let mut vals = [0u8; 256];
        for (i, v) in vals.iter_mut().enumerate() {
            *v = ((i * 7 + 3) % 16) as u8;
        }
        // element 64*g + l (l<32) is the low nibble of qs[32g+l]; 64g+32+l the high nibble.
        for g in 0..4 {
            for l in 0..32 {
                b.push(vals[64 * g + l] | (vals[64 * g + 32 + l] << 4));
            }
        }
        assert_eq!(b.len(), 144);
        let out = dec(SourceDType::Q4K, &b, 256);
        for i in 0..256 {
            let s = i / 32;
            let want = d * sc[s] as f32 * 1.0 * vals[i] as f32 - dmin * mn[s] as f32;
            let want2 = (d * sc[s] as f32) * vals[i] as f32 - dmin * mn[s] as f32;
            assert_eq!(out[i], want2, "i={i}");
            assert!((out[i] - want).abs() < 1e-6);
        }
    }

    #[test]
    fn q5_k() {
        let sc = [9, 2, 3, 4, 5, 6, 7, 8];
        let mn = [1, 1, 2, 3, 4, 5, 6, 33];
        let (d, dmin) = (0.125f32, 0.5f32);
        let mut vals = [0u8; 256];
        for (i, v) in vals.iter_mut().enumerate() {
            *v = ((i * 11 + 5) % 32) as u8;
        }
        let mut b = h(d).to_vec();
        b.extend_from_slice(&h(dmin));
        b.extend_from_slice(&pack_k4(sc, mn));
        let mut qh = [0u8; 32];
        let mut ql = [0u8; 128];
        for g in 0..4 {
            for l in 0..32 {
                let lo = vals[64 * g + l];
                let hi = vals[64 * g + 32 + l];
                ql[32 * g + l] = (lo & 15) | ((hi & 15) << 4);
                if lo & 16 != 0 {
                    qh[l] |= 1 << (2 * g);
                }
                if hi & 16 != 0 {
                    qh[l] |= 2 << (2 * g);
                }
            }
        }
        b.extend_from_slice(&qh);
        b.extend_from_slice(&ql);
        assert_eq!(b.len(), 176);
        let out = dec(SourceDType::Q5K, &b, 256);
        for i in 0..256 {
            let s = i / 32;
            let want = (d * sc[s] as f32) * vals[i] as f32 - dmin * mn[s] as f32;
            assert_eq!(out[i], want, "i={i}");
        }
    }

    #[test]
    fn q6_k() {
        let d = 0.0625f32;
        let sc: [i8; 16] = [1, -2, 3, -4, 5, -6, 7, -8, 9, -10, 11, -12, 13, -14, 15, -128];
        let mut vals = [0u8; 256];
        for (i, v) in vals.iter_mut().enumerate() {
            *v = ((i * 13 + 1) % 64) as u8;
        }
        let mut ql = [0u8; 128];
        let mut qh = [0u8; 64];
        // Element 128h + 32k + l (k = 0..4, l < 32): k=0 low nibble ql[l], k=1 low ql[l+32],
        // k=2 high ql[l], k=3 high ql[l+32]; top bits at qh[l] >> 2k.
        for hh in 0..2 {
            for k in 0..4 {
                for l in 0..32 {
                    let v = vals[128 * hh + 32 * k + l];
                    let qi = 64 * hh + l + if k % 2 == 1 { 32 } else { 0 };
                    if k < 2 {
                        ql[qi] |= v & 15;
                    } else {
                        ql[qi] |= (v & 15) << 4;
                    }
                    qh[32 * hh + l] |= (v >> 4) << (2 * k);
                }
            }
        }
        let mut b = ql.to_vec();
        b.extend_from_slice(&qh);
        b.extend(sc.iter().map(|&s| s as u8));
        b.extend_from_slice(&h(d));
        assert_eq!(b.len(), 210);
        let out = dec(SourceDType::Q6K, &b, 256);
        for i in 0..256 {
            let s = i / 16;
            let want = d * sc[s] as f32 * (vals[i] as i32 - 32) as f32;
            assert_eq!(out[i], want, "i={i}");
        }
    }

    #[test]
    fn encoders() {
        let mut out = vec![9u8];
        f32_to_le_bytes(&[1.0, -2.5], &mut out);
        assert_eq!(out, [1.0f32.to_le_bytes(), (-2.5f32).to_le_bytes()].concat());
        // 1 + 2^-8 is exactly halfway between two bf16 values: ties to even (1.0).
        f32_to_bf16_bytes(&[1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, -2.0], &mut out);
        assert_eq!(out, vec![0x80, 0x3F, 0x82, 0x3F, 0x00, 0xC0]);
    }

    /// `cargo test -p thin-core --lib codec::tests::throughput -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn throughput() {
        let n = 1usize << 24;
        for dt in [
            SourceDType::F32,
            SourceDType::F16,
            SourceDType::Bf16,
            SourceDType::Q8_0,
            SourceDType::Q4_0,
            SourceDType::Q4_1,
            SourceDType::Q5_0,
            SourceDType::Q5_1,
            SourceDType::Q4K,
            SourceDType::Q5K,
            SourceDType::Q6K,
        ] {
            let (per, bpb) = dt.block();
            let nb = n / per as usize;
            let mut bytes: Vec<u8> = (0..nb * bpb as usize).map(|i| (i * 31 % 251) as u8).collect();
            if dt.is_block_quantized() {
                let offs: &[usize] = match dt {
                    SourceDType::Q6K => &[208],
                    SourceDType::Q8_0 | SourceDType::Q4_0 | SourceDType::Q5_0 => &[0],
                    _ => &[0, 2],
                };
                for b in 0..nb {
                    for &o in offs {
                        let at = b * bpb as usize + o;
                        bytes[at..at + 2].copy_from_slice(&h(0.01));
                    }
                }
            }
            let mut out = vec![0f32; n];
            decode_to_f32(dt, &bytes, &mut out).unwrap();
            let reps = 5;
            let t = std::time::Instant::now();
            for _ in 0..reps {
                decode_to_f32(dt, &bytes, &mut out).unwrap();
            }
            let s = t.elapsed().as_secs_f64() / reps as f64;
            eprintln!(
                "{:5}: {:6.2} GB/s f32 output, 1 thread",
                dt.name(),
                (n * 4) as f64 / s / 1e9
            );
            std::hint::black_box(&out);
        }
    }
}
