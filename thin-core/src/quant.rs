//! Quantization: profiles, the precision ladder, and the role-aware plan that picks a storage
//! method for every tensor.

use serde::{Deserialize, Serialize};

use crate::dtype::{DType, SourceDType};
use crate::role::Role;

/// A storage method for one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QuantMethod {
    F32,
    Bf16,
    /// FP8 e4m3 with one f32 scale per output row.
    Fp8RowScale,
    /// MXFP4 (e2m1 values, e8m0 scale per 32) with a BF16 row postscale.
    Mxfp4,
}

impl QuantMethod {
    pub fn storage_dtype(self) -> DType {
        match self {
            QuantMethod::F32 => DType::F32,
            QuantMethod::Bf16 => DType::Bf16,
            QuantMethod::Fp8RowScale => DType::F8E4m3,
            QuantMethod::Mxfp4 => DType::Mxfp4,
        }
    }

    pub fn bits(self) -> u32 {
        match self {
            QuantMethod::F32 => 32,
            QuantMethod::Bf16 => 16,
            QuantMethod::Fp8RowScale => 8,
            QuantMethod::Mxfp4 => 4,
        }
    }
}

/// Methods from most to least faithful. A plan never moves a tensor below what its role allows.
pub fn precision_ladder() -> &'static [QuantMethod] {
    &[QuantMethod::F32, QuantMethod::Bf16, QuantMethod::Fp8RowScale, QuantMethod::Mxfp4]
}

/// A named conversion profile (`--profile`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Profile {
    /// Everything BF16 (norm vectors F32: they are tiny and `1 + w` folding needs the precision).
    Bf16,
    /// Everything F32: exact values of the source, for oracle tests.
    F32,
    /// BF16, but the embedding / LM head and the first and last layers' matrices F32: the
    /// layers most sensitive to rounding kept exact, one archive of two storage types.
    Bf16F32Edges,
}

impl Profile {
    pub fn parse(s: &str) -> Option<Profile> {
        match s {
            "bf16" => Some(Profile::Bf16),
            "f32" => Some(Profile::F32),
            "bf16-f32edges" => Some(Profile::Bf16F32Edges),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Profile::Bf16 => "bf16",
            Profile::F32 => "f32",
            Profile::Bf16F32Edges => "bf16-f32edges",
        }
    }

    pub const NAMES: &'static [&'static str] = &["bf16", "f32", "bf16-f32edges"];
}

/// One tensor's entry in the plan, with the reason it got its method.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedTensor {
    pub name: String,
    pub method: QuantMethod,
    pub reason: String,
}

/// The quantization metadata recorded in a manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuantizationDescriptor {
    /// Profile name (`bf16`).
    pub method: String,
    /// Dominant storage type of the large matrices.
    pub storage_dtype: DType,
    pub bits: u32,
    pub group_size: Option<u64>,
    pub scale_dtype: Option<DType>,
    pub zero_point: bool,
    /// Tensors kept out of the profile's main method (norms, by design).
    pub modules_to_not_convert: Vec<String>,
    /// The source's own quantization: GGUF file type and tensor types, or HF `quantization_config`.
    pub source_config: serde_json::Value,
    pub plan: Vec<PlannedTensor>,
}

/// What the planner needs to know about one tensor.
#[derive(Debug, Clone)]
pub struct PlanInput<'a> {
    pub name: &'a str,
    pub role: Role,
    pub layer: Option<u32>,
    pub source_dtype: SourceDType,
}

/// Assign a method to every tensor from the profile and its role.
pub fn plan_quantization(profile: Profile, tensors: &[PlanInput<'_>]) -> Vec<PlannedTensor> {
    let last = tensors.iter().filter_map(|t| t.layer).max();
    tensors
        .iter()
        .map(|t| {
            let edge = !t.role.is_per_layer() || t.layer == Some(0) || t.layer == last;
            let (method, reason) = match profile {
                Profile::F32 => (QuantMethod::F32, "profile f32 stores every tensor as f32".to_string()),
                Profile::Bf16 | Profile::Bf16F32Edges if t.role.is_norm() => (
                    QuantMethod::F32,
                    format!("{} is a norm vector: kept f32 (tiny, and `1 + w` folding needs the precision)", t.role.name()),
                ),
                Profile::Bf16F32Edges if edge => {
                    let at = t.layer.map_or("the embedding / LM head".to_string(), |l| format!("layer {l}, the first or last"));
                    (QuantMethod::F32, format!("profile bf16-f32edges: {at} kept f32"))
                }
                Profile::Bf16 | Profile::Bf16F32Edges => {
                    let why = if t.source_dtype.is_block_quantized() {
                        format!("profile bf16: {} blocks dequantized to bf16", t.source_dtype.name())
                    } else {
                        format!("profile bf16: {} source stored as bf16", t.source_dtype.name())
                    };
                    (QuantMethod::Bf16, why)
                }
            };
            PlannedTensor { name: t.name.to_string(), method, reason }
        })
        .collect()
}

impl QuantizationDescriptor {
    pub fn for_profile(profile: Profile, plan: Vec<PlannedTensor>, source_config: serde_json::Value) -> Self {
        let (storage_dtype, bits) = match profile {
            Profile::Bf16 | Profile::Bf16F32Edges => (DType::Bf16, 16),
            Profile::F32 => (DType::F32, 32),
        };
        let main = match profile {
            Profile::Bf16 | Profile::Bf16F32Edges => QuantMethod::Bf16,
            Profile::F32 => QuantMethod::F32,
        };
        let modules_to_not_convert =
            plan.iter().filter(|p| p.method != main).map(|p| p.name.clone()).collect();
        QuantizationDescriptor {
            method: profile.name().to_string(),
            storage_dtype,
            bits,
            group_size: None,
            scale_dtype: None,
            zero_point: false,
            modules_to_not_convert,
            source_config,
            plan,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ladder_is_ordered_by_bits() {
        let l = precision_ladder();
        assert_eq!(l[0], QuantMethod::F32);
        assert!(l.windows(2).all(|w| w[0].bits() > w[1].bits()));
    }

    #[test]
    fn bf16_plan_keeps_norms_f32() {
        let inputs = [
            PlanInput { name: "blk.0.attn_q", role: Role::AttnQ, layer: Some(0), source_dtype: SourceDType::Q4_1 },
            PlanInput { name: "blk.0.attn_norm", role: Role::AttnNorm, layer: Some(0), source_dtype: SourceDType::F32 },
            PlanInput { name: "token_embd", role: Role::TokenEmbd, layer: None, source_dtype: SourceDType::Bf16 },
        ];
        let plan = plan_quantization(Profile::Bf16, &inputs);
        assert_eq!(plan[0].method, QuantMethod::Bf16);
        assert!(plan[0].reason.contains("Q4_1 blocks dequantized"));
        assert_eq!(plan[1].method, QuantMethod::F32);
        assert_eq!(plan[2].method, QuantMethod::Bf16);
        let d = QuantizationDescriptor::for_profile(Profile::Bf16, plan, serde_json::Value::Null);
        assert_eq!(d.modules_to_not_convert, vec!["blk.0.attn_norm".to_string()]);
        assert_eq!(d.bits, 16);
        let f = plan_quantization(Profile::F32, &inputs);
        assert!(f.iter().all(|p| p.method == QuantMethod::F32));
    }

    #[test]
    fn edges_profile_keeps_the_embedding_and_first_and_last_layers_f32() {
        let t = |name, role, layer| PlanInput { name, role, layer, source_dtype: SourceDType::Bf16 };
        let inputs = [
            t("token_embd", Role::TokenEmbd, None),
            t("blk.0.attn_q", Role::AttnQ, Some(0)),
            t("blk.1.attn_q", Role::AttnQ, Some(1)),
            t("blk.1.attn_norm", Role::AttnNorm, Some(1)),
            t("blk.2.ffn_down", Role::FfnDown, Some(2)),
        ];
        let methods: Vec<QuantMethod> = plan_quantization(Profile::Bf16F32Edges, &inputs).iter().map(|p| p.method).collect();
        assert_eq!(methods, [QuantMethod::F32, QuantMethod::F32, QuantMethod::Bf16, QuantMethod::F32, QuantMethod::F32]);
        assert_eq!(Profile::parse("bf16-f32edges"), Some(Profile::Bf16F32Edges));
    }
}
