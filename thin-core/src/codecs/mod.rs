//! Weight codecs of the `.thin` archive: FP8 e4m3 with per-row scales, MXFP4 with e8m0 block scales
//! and an optional BF16 row postscale, and GGUF's Q8_0 and Q4_1 blocks kept as stored.
//!
//! Every format module has the same shape:
//! - `sizes(rows, cols)`: the bytes of the values and of the separate scales of a `[rows, cols]`
//!   matrix (checked arithmetic), for the manifest's open-time checks;
//! - a quantizer (`quantize`, `quantize_row`) from f32;
//! - `dequantize_row` / `dequantize` into the caller's slice (no allocation);
//! - `dot_row` and `matvec_rows`, the CPU hot loop: weights are decoded in registers, `x` stays f32,
//!   the dequantized matrix never exists.
//!
//! Layouts are a contract with the GPU kernels, which read the same bytes; each module's doc spells
//! its layout out. Matrices are row-major `[rows, cols]` (rows = output features).
//!
//! Summation order of every dot (so the portable loops and the AVX2 and AVX-512 kernels, picked
//! at run time by [`Isa`], give the same bits): the block formats have 16 lanes, and lane `l` of a
//! 32-element block takes the two elements one byte `l` (or, for Q8_0, the two positions `l` and
//! `l + 16`) holds: Q8_0 `l` and `l + 16`, Q4_1 the low nibble `l` and the high nibble `l + 16`,
//! MXFP4 the low nibble `2l` and the high nibble `2l + 1`. A lane's two products are added, the
//! sum multiplied by the block scale (Q4_1: `t * d + (x_a + x_b) * m`) and added to the row's
//! lane. FP8 has no blocks: its values / 256 (the f16 its bits form, exact) times `x` go into lane
//! `i % 32` of each 32-element chunk. After the last block the lanes are reduced pairwise (halves
//! added: 16 + 16, 8 + 8, 4 + 4, ...), the FP8 tail (`cols % 32` elements, added in order) is
//! added and the FP8 sum multiplied by 256, then the row scale/postscale multiplies once. Products
//! are a multiply then an add (no fused multiply-add). Decoding is exact in every kernel. One
//! kernel leaves this order on purpose, at the dot-product level ([`Isa::Avx512Dot`]): Q8_0 decode
//! on AVX-512 VNNI (`q8_0::matvec_rows_int`) sums integer products, within 1e-4 relative of the
//! exact sum.
//!
//! Bad data is found without a cost in the hot loop: a NaN code or scale makes the row's dot NaN
//! (or infinite), and only then is the row scanned to name the culprit as a [`CodecError`]. A
//! non-finite result with clean weights comes from `x` and is returned as it is.

pub mod fp8;
pub mod isa;
pub mod mxfp4;
pub mod q4_1;
pub mod q8_0;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

pub use isa::Isa;

/// Errors of every codec (also what [`crate::codec::decode_to_f32`] returns).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CodecError {
    /// A buffer is not exactly as long as the shape asks.
    #[error("{dtype}: expected {expected} {what}, got {got}")]
    Length {
        dtype: &'static str,
        /// Which buffer: "bytes", "values", "scales", "postscales", "x", "outputs".
        what: &'static str,
        expected: u64,
        got: u64,
    },
    /// A block's f16 scale (`d` or `m`) is NaN or infinite.
    #[error("{dtype}: block {block} has a non-finite scale")]
    NonFinite { dtype: &'static str, block: u64 },
    /// The element count (or a row's length) is not a whole number of blocks.
    #[error("{dtype}: {count} elements is not a multiple of the block size {block_elems}")]
    PartialBlock {
        dtype: &'static str,
        count: u64,
        block_elems: u64,
    },
    /// `rows * cols` or a byte size does not fit in 64 bits.
    #[error("{dtype}: a [{rows}, {cols}] matrix overflows the byte count")]
    Overflow {
        dtype: &'static str,
        rows: u64,
        cols: u64,
    },
    /// A value to quantize is NaN or infinite.
    #[error("{dtype}: input element {index} is not finite ({value})")]
    NonFiniteInput {
        dtype: &'static str,
        index: u64,
        value: f32,
    },
    /// A per-row scale (FP8 scale, MXFP4 postscale) is not finite and > 0.
    #[error("{dtype}: row {row} has scale {scale}, which is not finite and > 0")]
    RowScale {
        dtype: &'static str,
        row: u64,
        scale: f32,
    },
    /// An e8m0 block scale is 0xFF, e8m0's NaN.
    #[error("{dtype}: block {block} has the e8m0 scale 0xFF (NaN)")]
    NanE8m0 { dtype: &'static str, block: u64 },
    /// An FP8 value byte is 0x7F or 0xFF, e4m3's NaN.
    #[error("{dtype}: element {index} is the e4m3 NaN code {code:#04x}")]
    NanE4m3 {
        dtype: &'static str,
        index: u64,
        code: u8,
    },
}

/// Bytes of a `[rows, cols]` matrix in one format: the values and the separate scale tensor
/// (0 for the GGUF blocks, whose scales are inside the blocks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sizes {
    pub values: u64,
    pub scales: u64,
}

/// `Err(Length)` unless `got == expected`.
#[inline]
pub(crate) fn check_len(dtype: &'static str, what: &'static str, expected: usize, got: usize) -> Result<(), CodecError> {
    if expected == got {
        Ok(())
    } else {
        Err(CodecError::Length {
            dtype,
            what,
            expected: expected as u64,
            got: got as u64,
        })
    }
}

/// `rows * cols` as usize, or `Overflow`.
#[inline]
pub(crate) fn elems(dtype: &'static str, rows: usize, cols: usize) -> Result<usize, CodecError> {
    rows.checked_mul(cols).ok_or(CodecError::Overflow {
        dtype,
        rows: rows as u64,
        cols: cols as u64,
    })
}

/// Elements per block of the block formats (MXFP4, Q8_0, Q4_1) and per lane chunk of FP8.
pub(crate) const BLOCK: usize = 32;

/// Lanes of the block formats' dot (half a block: each lane takes two elements of a block).
pub(crate) const LANES: usize = 16;

/// Adds the halves of `acc` until one value remains (16 + 16, 8 + 8, ...).
#[inline(always)]
pub(crate) fn reduce<const N: usize>(mut acc: [f32; N]) -> f32 {
    let mut n = N;
    while n > 1 {
        n /= 2;
        for i in 0..n {
            acc[i] += acc[i + n];
        }
    }
    acc[0]
}

/// Reads a little-endian f16 at `b[at..at + 2]` as f32.
#[inline(always)]
pub(crate) fn rd_f16(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduce_is_pairwise_halves() {
        // 1e8 + 1 is lost in f32 but (1 + 1) + ... is not: the order shows.
        let acc = [1e8f32, 1.0, -1e8, 1.0];
        // halves: [1e8 + -1e8, 1 + 1] = [0, 2] -> 2
        assert_eq!(reduce(acc), 2.0);
        assert_eq!(reduce([3.0f32]), 3.0);
    }
}
