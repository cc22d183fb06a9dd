//! Element types: what an archive stores (`DType`) and what a source file held (`SourceDType`).

use serde::{Deserialize, Serialize};

/// Storage type of a tensor inside a `.thin` archive.
///
/// FP8 and MXFP4 are defined now so that later profiles only add codecs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DType {
    F32,
    F16,
    Bf16,
    /// FP8 e4m3 values; per-row f32 scales live in a companion tensor.
    F8E4m3,
    /// MXFP4: e2m1 values packed two per byte, one e8m0 scale byte per 32 values.
    Mxfp4,
}

impl DType {
    /// Bytes needed for `n` elements, or `None` when `n` is not a valid count for the type
    /// (MXFP4 needs whole blocks of 32) or the product overflows.
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        match self {
            DType::F32 => n.checked_mul(4),
            DType::F16 | DType::Bf16 => n.checked_mul(2),
            DType::F8E4m3 => Some(n),
            DType::Mxfp4 => {
                if n % 32 != 0 {
                    None
                } else {
                    (n / 32).checked_mul(17)
                }
            }
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::F8E4m3 => "f8_e4m3",
            DType::Mxfp4 => "mxfp4",
        }
    }
}

/// Element type of a tensor in a source file (safetensors or GGUF).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SourceDType {
    F32,
    F16,
    Bf16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q4K,
    Q5K,
    Q6K,
}

impl SourceDType {
    /// (elements per block, bytes per block) as laid out by ggml.
    pub fn block(self) -> (u64, u64) {
        match self {
            SourceDType::F32 => (1, 4),
            SourceDType::F16 | SourceDType::Bf16 => (1, 2),
            SourceDType::Q8_0 => (32, 34),
            SourceDType::Q4_0 => (32, 18),
            SourceDType::Q4_1 => (32, 20),
            SourceDType::Q4K => (256, 144),
            SourceDType::Q5K => (256, 176),
            SourceDType::Q6K => (256, 210),
        }
    }

    /// Bytes for `n` elements; `None` if `n` is not a whole number of blocks or overflows.
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        let (per, bytes) = self.block();
        if n % per != 0 {
            return None;
        }
        (n / per).checked_mul(bytes)
    }

    pub fn name(self) -> &'static str {
        match self {
            SourceDType::F32 => "F32",
            SourceDType::F16 => "F16",
            SourceDType::Bf16 => "BF16",
            SourceDType::Q8_0 => "Q8_0",
            SourceDType::Q4_0 => "Q4_0",
            SourceDType::Q4_1 => "Q4_1",
            SourceDType::Q4K => "Q4_K",
            SourceDType::Q5K => "Q5_K",
            SourceDType::Q6K => "Q6_K",
        }
    }

    pub fn is_block_quantized(self) -> bool {
        self.block().0 > 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(DType::Bf16.bytes_for(10), Some(20));
        assert_eq!(DType::Mxfp4.bytes_for(64), Some(34));
        assert_eq!(DType::Mxfp4.bytes_for(33), None);
        assert_eq!(SourceDType::Q4_1.bytes_for(64), Some(40));
        assert_eq!(SourceDType::Q6K.bytes_for(256), Some(210));
        assert_eq!(SourceDType::Q8_0.bytes_for(31), None);
        assert_eq!(DType::F32.bytes_for(u64::MAX), None);
    }
}
