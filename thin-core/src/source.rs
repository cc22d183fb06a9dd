//! What an importer hands the converter: the model's config, tokenizer and raw tensors borrowed
//! from the memory-mapped source files (no copies until the converter decides what to store).

use std::collections::BTreeMap;

use crate::arch::ArchConfig;
use crate::dtype::SourceDType;
use crate::manifest::TokenizerInfo;

/// One tensor as the source file stores it.
#[derive(Debug, Clone)]
pub struct SourceTensor<'a> {
    /// The tensor's own name in the source (`blk.0.attn_q.weight`, `model.layers.0.self_attn.q_proj.weight`).
    pub name: String,
    /// Row-major shape, outermost first (`[out_features, in_features]` for linear weights).
    /// GGUF lists dims innermost first; its importer reverses them.
    pub shape: Vec<u64>,
    pub dtype: SourceDType,
    /// Exactly `dtype.bytes_for(product(shape))` bytes, borrowed from the mapped file.
    pub bytes: &'a [u8],
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceKind {
    Gguf,
    Safetensors,
}

impl SourceKind {
    pub fn name(self) -> &'static str {
        match self {
            SourceKind::Gguf => "gguf",
            SourceKind::Safetensors => "safetensors",
        }
    }
}

/// A whole model as read from its source, ready for `convert`.
#[derive(Debug, Clone)]
pub struct SourceModel<'a> {
    pub kind: SourceKind,
    pub arch: ArchConfig,
    pub tokenizer: TokenizerInfo,
    pub tensors: Vec<SourceTensor<'a>>,
    /// File names (not paths) the model was read from.
    pub files: Vec<String>,
    /// GGUF version, general.file_type, general.name and the like.
    pub details: BTreeMap<String, String>,
    /// The source's own quantization/config summary (GGUF tensor type counts, HF `quantization_config`).
    pub source_config: serde_json::Value,
}
