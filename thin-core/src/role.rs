//! Tensor roles: what a weight is for, independent of what any file format calls it.

use serde::{Deserialize, Serialize};

/// The job of one tensor in the model. Importers map source names to roles through the tables in
/// [`crate::names`]; engines ask the archive for tensors by role and layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    TokenEmbd,
    OutputNorm,
    LmHead,
    AttnNorm,
    AttnQ,
    AttnK,
    AttnV,
    AttnO,
    AttnQNorm,
    AttnKNorm,
    /// Gemma 3 `post_attention_layernorm` (applied to the attention output before the residual add).
    AttnPostNorm,
    /// Norm before the MLP: Llama `post_attention_layernorm`, Gemma `pre_feedforward_layernorm`.
    FfnNorm,
    /// Gemma 3 `post_feedforward_layernorm`.
    FfnPostNorm,
    FfnGate,
    FfnUp,
    FfnDown,
    /// MoE router, `[experts, hidden]`.
    MoeRouter,
    /// Stacked expert weights, `[experts, intermediate, hidden]` / `[experts, hidden, intermediate]`.
    MoeGate,
    MoeUp,
    MoeDown,
}

pub const ALL_ROLES: [Role; 20] = [
    Role::TokenEmbd,
    Role::OutputNorm,
    Role::LmHead,
    Role::AttnNorm,
    Role::AttnQ,
    Role::AttnK,
    Role::AttnV,
    Role::AttnO,
    Role::AttnQNorm,
    Role::AttnKNorm,
    Role::AttnPostNorm,
    Role::FfnNorm,
    Role::FfnPostNorm,
    Role::FfnGate,
    Role::FfnUp,
    Role::FfnDown,
    Role::MoeRouter,
    Role::MoeGate,
    Role::MoeUp,
    Role::MoeDown,
];

impl Role {
    /// Short stable name, used for canonical tensor names (`blk.3.attn_q`) and in `thin inspect`.
    pub fn name(self) -> &'static str {
        match self {
            Role::TokenEmbd => "token_embd",
            Role::OutputNorm => "output_norm",
            Role::LmHead => "lm_head",
            Role::AttnNorm => "attn_norm",
            Role::AttnQ => "attn_q",
            Role::AttnK => "attn_k",
            Role::AttnV => "attn_v",
            Role::AttnO => "attn_o",
            Role::AttnQNorm => "attn_q_norm",
            Role::AttnKNorm => "attn_k_norm",
            Role::AttnPostNorm => "attn_post_norm",
            Role::FfnNorm => "ffn_norm",
            Role::FfnPostNorm => "ffn_post_norm",
            Role::FfnGate => "ffn_gate",
            Role::FfnUp => "ffn_up",
            Role::FfnDown => "ffn_down",
            Role::MoeRouter => "moe_router",
            Role::MoeGate => "moe_gate",
            Role::MoeUp => "moe_up",
            Role::MoeDown => "moe_down",
        }
    }

    /// Whether the role belongs to a transformer block (has a layer index).
    pub fn is_per_layer(self) -> bool {
        match self {
            Role::TokenEmbd | Role::OutputNorm | Role::LmHead => false,
            Role::AttnNorm
            | Role::AttnQ
            | Role::AttnK
            | Role::AttnV
            | Role::AttnO
            | Role::AttnQNorm
            | Role::AttnKNorm
            | Role::AttnPostNorm
            | Role::FfnNorm
            | Role::FfnPostNorm
            | Role::FfnGate
            | Role::FfnUp
            | Role::FfnDown
            | Role::MoeRouter
            | Role::MoeGate
            | Role::MoeUp
            | Role::MoeDown => true,
        }
    }

    /// Norm weights are small vectors that stay F32 in every profile.
    pub fn is_norm(self) -> bool {
        match self {
            Role::OutputNorm
            | Role::AttnNorm
            | Role::AttnQNorm
            | Role::AttnKNorm
            | Role::AttnPostNorm
            | Role::FfnNorm
            | Role::FfnPostNorm => true,
            Role::TokenEmbd
            | Role::LmHead
            | Role::AttnQ
            | Role::AttnK
            | Role::AttnV
            | Role::AttnO
            | Role::FfnGate
            | Role::FfnUp
            | Role::FfnDown
            | Role::MoeRouter
            | Role::MoeGate
            | Role::MoeUp
            | Role::MoeDown => false,
        }
    }

    /// Canonical archive name of the tensor with this role.
    pub fn tensor_name(self, layer: Option<u32>) -> String {
        match layer {
            Some(l) => format!("blk.{l}.{}", self.name()),
            None => self.name().to_string(),
        }
    }

    pub fn from_name(s: &str) -> Option<Role> {
        ALL_ROLES.iter().copied().find(|r| r.name() == s)
    }
}
