//! The JSON manifest of a `.thin` archive: what the model is and where each tensor lives.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::arch::ArchConfig;
use crate::dtype::{DType, SourceDType};
use crate::quant::QuantizationDescriptor;
use crate::role::Role;
use crate::weight_format::ScaleSection;

fn one() -> u64 {
    1
}

pub const MANIFEST_FORMAT: &str = "thin-manifest/0";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`MANIFEST_FORMAT`].
    pub format: String,
    pub arch: ArchConfig,
    /// blake3 of the normalized shape dims; see [`crate::arch::ShapeDims::fingerprint`].
    pub shape_fingerprint: String,
    pub tokenizer: TokenizerInfo,
    pub tensors: Vec<TensorEntry>,
    pub quantization: QuantizationDescriptor,
    pub backend_hints: BackendHints,
    pub validation: Validation,
    pub source: SourceInfo,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenizerInfo {
    /// A complete Hugging Face `tokenizer.json`, embedded verbatim (HF source) or built from
    /// GGUF metadata; empty when `sentencepiece` holds the tokenizer instead.
    pub tokenizer_json: String,
    /// A SentencePiece vocabulary (a GGUF's `tokenizer.ggml.model = "llama"`), stored as the GGUF
    /// has it; the tokenizer is built from it at open (`crate::tokenizer::sentencepiece`). Absent
    /// for every other tokenizer, and in archives written before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sentencepiece: Option<SentencePieceVocab>,
    pub chat_template: Option<String>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// Prepend BOS when encoding a prompt.
    pub add_bos: bool,
}

/// One entry per token id: its text, its SentencePiece score, its llama.cpp token type
/// (`tokenizer.ggml.token_type`: 2 unknown, 3 control, 4 user-defined, 6 byte, ...).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SentencePieceVocab {
    pub tokens: Vec<String>,
    pub scores: Vec<f32>,
    pub types: Vec<i32>,
    pub unknown_token_id: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// Canonical name, `Role::tensor_name(layer)`.
    pub name: String,
    pub role: Role,
    pub layer: Option<u32>,
    /// Row-major shape, outermost first (`[out_features, in_features]` for linear weights).
    pub shape: Vec<u64>,
    /// Storage type of the values.
    pub dtype: DType,
    /// Values that share one scale along a row: 1 for plain types, 32 for GGUF blocks and MXFP4,
    /// the row length for FP8 row scales. Checked against the storage type at open.
    #[serde(default = "one")]
    pub block_size: u64,
    /// The scale sections stored after the values in this tensor's bytes, as
    /// [`crate::weight_format::WeightLayout::of`] lays them out; empty for plain and GGUF types.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub scales: Vec<ScaleSection>,
    /// Pages `first_page .. first_page + page_count` hold the tensor's bytes back to back.
    pub first_page: u32,
    pub page_count: u32,
    /// Bytes of the tensor (sum of the raw sizes of its pages).
    pub byte_len: u64,
    /// What the source file stored, and its own name there.
    pub source_dtype: SourceDType,
    pub source_name: String,
    /// True when the stored bytes are the source's bytes unchanged.
    pub exact_storage_preserved: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BackendHints {
    /// Alignment of every page's offset in the file.
    pub alignment: u64,
    /// Largest page; tensors larger than this span several pages.
    pub max_page_size: u64,
    /// Preferred layout per role, e.g. `"attn_q": "row_major"`.
    pub layouts: BTreeMap<String, String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Validation {
    pub parameter_count: u64,
    pub tensor_count: u64,
    /// Reference checksums: blake3 of each tensor's bytes, by canonical name.
    pub tensor_blake3: BTreeMap<String, String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SourceInfo {
    /// `"gguf"` or `"safetensors"`.
    pub kind: String,
    /// File names (not paths) the archive was made from.
    pub files: Vec<String>,
    /// GGUF version, general.file_type and the like.
    pub details: BTreeMap<String, String>,
}

impl Manifest {
    pub fn tensor(&self, role: Role, layer: Option<u32>) -> Option<&TensorEntry> {
        self.tensors.iter().find(|t| t.role == role && t.layer == layer)
    }

    /// Weight bytes one decode step reads: every matrix whole (values and scales), except the
    /// token embedding (one row; the whole table again when tied, as the LM head) and MoE experts
    /// (top_k of num_experts). The numerator of a profile's roofline.
    pub fn weight_bytes_per_token(&self) -> u64 {
        let d = &self.arch.dims;
        self.tensors
            .iter()
            .map(|t| match t.role {
                Role::TokenEmbd if d.tie_word_embeddings => t.byte_len + t.byte_len / d.vocab_size.max(1),
                Role::TokenEmbd => t.byte_len / d.vocab_size.max(1),
                Role::MoeGate | Role::MoeUp | Role::MoeDown => t.byte_len / d.num_experts.max(1) * d.top_k,
                _ => t.byte_len,
            })
            .sum()
    }
}
