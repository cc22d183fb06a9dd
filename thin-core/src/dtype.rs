//! Element types: what an archive stores (`DType`) and what a source file held (`SourceDType`).

use serde::{Deserialize, Serialize};

/// Storage type of a tensor's values inside a `.thin` archive. Scales that are not inline live in
/// the tensor's scale sections ([`crate::weight_format`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DType {
    F32,
    F16,
    Bf16,
    /// FP8 e4m3 values, one byte each; one f32 scale per row in a scale section.
    F8E4m3,
    /// MXFP4: e2m1 codes packed two per byte; one e8m0 exponent per 32 values in a scale section.
    Mxfp4,
    /// GGUF Q8_0 blocks as ggml stores them: f16 scale and 32 i8 values (34 bytes).
    #[serde(rename = "q8_0")]
    Q8_0,
    /// GGUF Q4_1 blocks as ggml stores them: f16 scale, f16 minimum, 32 4-bit values (20 bytes).
    #[serde(rename = "q4_1")]
    Q4_1,
}

impl DType {
    /// Bytes of the values (scale sections not counted) of `n` elements, or `None` when `n` is
    /// not a whole number of blocks of 32 (MXFP4, Q8_0, Q4_1) or the product overflows.
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        let blocks = |bytes: u64| if n % 32 == 0 { (n / 32).checked_mul(bytes) } else { None };
        match self {
            DType::F32 => n.checked_mul(4),
            DType::F16 | DType::Bf16 => n.checked_mul(2),
            DType::F8E4m3 => Some(n),
            DType::Mxfp4 => blocks(16),
            DType::Q8_0 => blocks(34),
            DType::Q4_1 => blocks(20),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::F8E4m3 => "f8_e4m3",
            DType::Mxfp4 => "mxfp4",
            DType::Q8_0 => "q8_0",
            DType::Q4_1 => "q4_1",
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
    Q5_0,
    Q5_1,
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
            SourceDType::Q5_0 => (32, 22),
            SourceDType::Q5_1 => (32, 24),
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
            SourceDType::Q5_0 => "Q5_0",
            SourceDType::Q5_1 => "Q5_1",
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
        assert_eq!(DType::Mxfp4.bytes_for(64), Some(32));
        assert_eq!(DType::Q8_0.bytes_for(64), Some(68));
        assert_eq!(DType::Q4_1.bytes_for(64), Some(40));
        assert_eq!(serde_json::to_string(&DType::Q4_1).unwrap(), "\"q4_1\"");
        assert_eq!(serde_json::to_string(&DType::F8E4m3).unwrap(), "\"f8_e4m3\"");
        assert_eq!(DType::Mxfp4.bytes_for(33), None);
        assert_eq!(SourceDType::Q4_1.bytes_for(64), Some(40));
        assert_eq!(SourceDType::Q6K.bytes_for(256), Some(210));
        assert_eq!(SourceDType::Q5_0.bytes_for(64), Some(44));
        assert_eq!(SourceDType::Q5_1.bytes_for(64), Some(48));
        assert_eq!(SourceDType::Q8_0.bytes_for(31), None);
        assert_eq!(DType::F32.bytes_for(u64::MAX), None);
    }
}
