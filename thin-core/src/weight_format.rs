//! A tensor's weight format: its storage type, how many values share a scale (the block size), and
//! the scale sections stored with its values.
//!
//! A tensor's bytes in the archive are its values, then each scale section, each section starting
//! at a multiple of [`SECTION_ALIGN`] bytes from the tensor's start (so a GPU can load a section
//! with 16-byte vector loads and a CPU can view f32 scales in place). Which sections a storage type
//! has is fixed here, in [`WeightLayout::of`], and the manifest entry must equal that layout
//! exactly:
//!
//! | storage type | values | block size | scale sections |
//! |---|---|---|---|
//! | `f32`, `f16`, `bf16` | one element each | 1 | none |
//! | `q8_0`, `q4_1` | GGUF blocks of 32, scales inline (34 / 20 bytes a block) | 32 | none |
//! | `f8_e4m3` | one byte each | the row length | `row` f32, one per row |
//! | `mxfp4` | e2m1 codes, two per byte, element `2i` in the low nibble | 32 | `block` e8m0, one per 32 values of a row; optionally `row` bf16, a postscale per row |
//!
//! Rows are the tensor's last dimension; every dimension before it counts rows (an expert stack
//! `[experts, out, in]` has `experts * out` rows of `in` values).

use serde::{Deserialize, Serialize};

use crate::dtype::DType;

/// Byte alignment of every scale section inside its tensor.
pub const SECTION_ALIGN: u64 = 64;

/// What one scale multiplies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScaleKind {
    /// One scale per `block_size` consecutive values of a row, row-major: `rows * cols / block_size`.
    Block,
    /// One scale per row, applied to the row's dot product: `rows`.
    Row,
}

/// Element type of a scale section.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScaleType {
    F32,
    Bf16,
    /// OCP MX shared exponent: the value `2^(e - 127)`; `0xff` (NaN) is never valid.
    E8m0,
}

impl ScaleType {
    pub fn bytes(self) -> u64 {
        match self {
            ScaleType::F32 => 4,
            ScaleType::Bf16 => 2,
            ScaleType::E8m0 => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ScaleType::F32 => "f32",
            ScaleType::Bf16 => "bf16",
            ScaleType::E8m0 => "e8m0",
        }
    }
}

/// One scale section of a tensor: `count` scales of `dtype` at byte `offset` of the tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ScaleSection {
    pub kind: ScaleKind,
    pub dtype: ScaleType,
    /// Byte offset from the start of the tensor's bytes.
    pub offset: u64,
    /// Number of scales.
    pub count: u64,
}

impl ScaleSection {
    pub fn byte_len(&self) -> u64 {
        self.count * self.dtype.bytes()
    }
}

/// Why a shape cannot have a storage type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("{dtype} needs at least one dimension")]
    Scalar { dtype: &'static str },
    #[error("{dtype}: a row of {cols} values is not a whole number of blocks of {block}")]
    PartialBlock { dtype: &'static str, cols: u64, block: u64 },
    #[error("{dtype}: the byte size of shape {shape:?} overflows")]
    Overflow { dtype: &'static str, shape: Vec<u64> },
    #[error("{dtype} has no row postscale (only mxfp4 has one)")]
    NoPostscale { dtype: &'static str },
}

/// Where everything of one tensor lies in its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightLayout {
    pub dtype: DType,
    /// Values sharing one scale along a row (1 for plain types).
    pub block_size: u64,
    pub rows: u64,
    pub cols: u64,
    /// Bytes of the values, from offset 0.
    pub value_bytes: u64,
    pub scales: Vec<ScaleSection>,
    /// All of the tensor's bytes: values, padding, sections.
    pub byte_len: u64,
}

impl WeightLayout {
    /// The layout of a `shape` tensor stored as `dtype`; `postscale` adds an MXFP4 row postscale.
    pub fn of(dtype: DType, shape: &[u64], postscale: bool) -> Result<WeightLayout, LayoutError> {
        let name = dtype.name();
        let overflow = || LayoutError::Overflow { dtype: name, shape: shape.to_vec() };
        let (&cols, outer) = match shape.split_last() {
            Some(s) => s,
            None if matches!(dtype, DType::F32 | DType::F16 | DType::Bf16) => (&1, &[][..]),
            None => return Err(LayoutError::Scalar { dtype: name }),
        };
        let rows = outer.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).ok_or_else(overflow)?;
        let n = rows.checked_mul(cols).ok_or_else(overflow)?;
        if postscale && dtype != DType::Mxfp4 {
            return Err(LayoutError::NoPostscale { dtype: name });
        }
        let block_size = match dtype {
            DType::F32 | DType::F16 | DType::Bf16 => 1,
            DType::Q8_0 | DType::Q4_1 | DType::Mxfp4 => 32,
            DType::F8E4m3 => cols.max(1),
        };
        if cols % block_size != 0 {
            return Err(LayoutError::PartialBlock { dtype: name, cols, block: block_size });
        }
        let value_bytes = dtype.bytes_for(n).ok_or_else(overflow)?;
        let mut wanted = Vec::new();
        match dtype {
            DType::F8E4m3 => wanted.push((ScaleKind::Row, ScaleType::F32, rows)),
            DType::Mxfp4 => {
                wanted.push((ScaleKind::Block, ScaleType::E8m0, n / 32));
                if postscale {
                    wanted.push((ScaleKind::Row, ScaleType::Bf16, rows));
                }
            }
            DType::F32 | DType::F16 | DType::Bf16 | DType::Q8_0 | DType::Q4_1 => {}
        }
        let mut end = value_bytes;
        let mut scales = Vec::with_capacity(wanted.len());
        for (kind, st, count) in wanted {
            let offset = end.checked_next_multiple_of(SECTION_ALIGN).ok_or_else(overflow)?;
            let s = ScaleSection { kind, dtype: st, offset, count };
            end = offset.checked_add(count.checked_mul(st.bytes()).ok_or_else(overflow)?).ok_or_else(overflow)?;
            scales.push(s);
        }
        Ok(WeightLayout { dtype, block_size, rows, cols, value_bytes, scales, byte_len: end })
    }

    /// The section of `kind`, if the layout has one.
    pub fn section(&self, kind: ScaleKind) -> Option<&ScaleSection> {
        self.scales.iter().find(|s| s.kind == kind)
    }

    /// The tensor's bytes from its values and each section's bytes, in [`Self::scales`] order,
    /// zero-padded between them. Panics if a part's length is not the layout's (a caller bug).
    pub fn assemble(&self, values: &[u8], sections: &[&[u8]]) -> Vec<u8> {
        assert_eq!(values.len() as u64, self.value_bytes, "{}: value bytes", self.dtype.name());
        assert_eq!(sections.len(), self.scales.len(), "{}: scale sections", self.dtype.name());
        let mut out = vec![0u8; self.byte_len as usize];
        out[..values.len()].copy_from_slice(values);
        for (s, b) in self.scales.iter().zip(sections) {
            assert_eq!(b.len() as u64, s.byte_len(), "{}: {:?} section bytes", self.dtype.name(), s.kind);
            out[s.offset as usize..(s.offset + s.byte_len()) as usize].copy_from_slice(b);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_types_have_no_sections() {
        let l = WeightLayout::of(DType::Bf16, &[3, 5], false).unwrap();
        assert_eq!((l.block_size, l.rows, l.cols, l.value_bytes, l.byte_len), (1, 3, 5, 30, 30));
        assert!(l.scales.is_empty());
        let l = WeightLayout::of(DType::F32, &[], false).unwrap();
        assert_eq!(l.byte_len, 4);
        let l = WeightLayout::of(DType::Q4_1, &[2, 64], false).unwrap();
        assert_eq!((l.block_size, l.value_bytes, l.byte_len), (32, 80, 80));
    }

    #[test]
    fn fp8_has_a_row_scale_section_aligned_after_the_values() {
        let l = WeightLayout::of(DType::F8E4m3, &[3, 10], false).unwrap();
        assert_eq!((l.block_size, l.value_bytes), (10, 30));
        assert_eq!(l.scales, vec![ScaleSection { kind: ScaleKind::Row, dtype: ScaleType::F32, offset: 64, count: 3 }]);
        assert_eq!(l.byte_len, 64 + 12);
        let b = l.assemble(&[7; 30], &[&[1; 12]]);
        assert_eq!((&b[..30], &b[30..64], &b[64..]), (&[7u8; 30][..], &[0u8; 34][..], &[1u8; 12][..]));
    }

    #[test]
    fn mxfp4_has_block_exponents_and_an_optional_postscale() {
        let l = WeightLayout::of(DType::Mxfp4, &[2, 4, 64], true).unwrap();
        assert_eq!((l.rows, l.cols, l.block_size, l.value_bytes), (8, 64, 32, 256));
        assert_eq!(
            l.scales,
            vec![
                ScaleSection { kind: ScaleKind::Block, dtype: ScaleType::E8m0, offset: 256, count: 16 },
                ScaleSection { kind: ScaleKind::Row, dtype: ScaleType::Bf16, offset: 320, count: 8 },
            ]
        );
        assert_eq!(l.byte_len, 336);
        assert_eq!(WeightLayout::of(DType::Mxfp4, &[8, 64], false).unwrap().scales.len(), 1);
    }

    #[test]
    fn bad_shapes_are_typed_errors() {
        assert!(matches!(WeightLayout::of(DType::Mxfp4, &[4, 48], false), Err(LayoutError::PartialBlock { cols: 48, block: 32, .. })));
        assert!(matches!(WeightLayout::of(DType::Q8_0, &[4, 33], false), Err(LayoutError::PartialBlock { .. })));
        assert!(matches!(WeightLayout::of(DType::F8E4m3, &[], false), Err(LayoutError::Scalar { .. })));
        assert!(matches!(WeightLayout::of(DType::Bf16, &[4, 32], true), Err(LayoutError::NoPostscale { .. })));
        assert!(matches!(WeightLayout::of(DType::F8E4m3, &[u64::MAX, 2], false), Err(LayoutError::Overflow { .. })));
        assert!(matches!(WeightLayout::of(DType::Mxfp4, &[1 << 62, 64], false), Err(LayoutError::Overflow { .. })));
    }
}
