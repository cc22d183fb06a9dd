//! The engine interface generated engines implement, and the weights view they read.

use crate::role::Role;

/// A failure inside an engine step; every variant names what was wrong.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("weight {role:?} (layer {layer:?}) is missing")]
    MissingWeight { role: Role, layer: Option<u32> },
    #[error("weight {role:?} (layer {layer:?}) has {got} elements, expected {expected}")]
    WeightSize { role: Role, layer: Option<u32>, expected: usize, got: usize },
    #[error("token {token} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { token: u32, vocab: usize },
    #[error("context is full: position {pos} reaches max_seq {max_seq}")]
    ContextFull { pos: usize, max_seq: usize },
    #[error("prefill needs at least one token")]
    EmptyPrompt,
    #[error("backend: {0}")]
    Backend(String),
    #[error("shape fingerprint mismatch: engine {engine}, archive {archive}")]
    Fingerprint { engine: String, archive: String },
}

/// A monomorphized decode loop for one architecture.
pub trait Engine {
    /// Run every prompt token through the model; returns the logits after the last one.
    fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>, EngineError>;
    /// Run one token at the next position; returns its logits.
    fn decode_step(&mut self, token: u32) -> Result<Vec<f32>, EngineError>;
    /// Forget the KV cache and start again at position 0.
    fn reset(&mut self);
}

/// A borrowed tensor in the element type it is stored in.
#[derive(Debug, Clone, Copy)]
pub enum WeightView<'a> {
    F32(&'a [f32]),
    Bf16(&'a [half::bf16]),
}

impl WeightView<'_> {
    pub fn len(&self) -> usize {
        match self {
            WeightView::F32(w) => w.len(),
            WeightView::Bf16(w) => w.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i` as f32.
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            WeightView::F32(w) => w[i],
            WeightView::Bf16(w) => w[i].to_f32(),
        }
    }

    /// Elements `start..end` (one expert of a stacked MoE tensor).
    pub fn slice(&self, start: usize, end: usize) -> WeightView<'_> {
        match self {
            WeightView::F32(w) => WeightView::F32(&w[start..end]),
            WeightView::Bf16(w) => WeightView::Bf16(&w[start..end]),
        }
    }

    /// Copy out as f32 (norm vectors are small; the hot matvecs read the view directly).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self {
            WeightView::F32(w) => w.to_vec(),
            WeightView::Bf16(w) => w.iter().map(|x| x.to_f32()).collect(),
        }
    }
}

/// Tensor lookup by role and layer: implemented by the archive reader and by in-memory test weights.
pub trait Weights {
    fn get(&self, role: Role, layer: Option<u32>) -> Option<WeightView<'_>>;

    /// [`Weights::get`] with the element count checked.
    fn expect(&self, role: Role, layer: Option<u32>, expected: usize) -> Result<WeightView<'_>, EngineError> {
        let w = self.get(role, layer).ok_or(EngineError::MissingWeight { role, layer })?;
        if w.len() != expected {
            return Err(EngineError::WeightSize { role, layer, expected, got: w.len() });
        }
        Ok(w)
    }
}

/// Weights held in memory as f32, keyed by (role, layer): for tests and tiny random models.
#[derive(Debug, Default, Clone)]
pub struct MemWeights {
    pub tensors: std::collections::BTreeMap<(Role, Option<u32>), Vec<f32>>,
}

impl Weights for MemWeights {
    fn get(&self, role: Role, layer: Option<u32>) -> Option<WeightView<'_>> {
        self.tensors.get(&(role, layer)).map(|v| WeightView::F32(v.as_slice()))
    }
}

/// An opened archive serves its tensors in place: the views borrow the mmap, no copy.
impl Weights for crate::format::Archive {
    fn get(&self, role: Role, layer: Option<u32>) -> Option<WeightView<'_>> {
        let entry = self.manifest().tensor(role, layer)?;
        match entry.dtype {
            crate::dtype::DType::F32 => self.tensor_f32(role, layer).ok().map(WeightView::F32),
            crate::dtype::DType::Bf16 => self.tensor_bf16(role, layer).ok().map(WeightView::Bf16),
            crate::dtype::DType::F16 | crate::dtype::DType::F8E4m3 | crate::dtype::DType::Mxfp4 => None,
        }
    }
}
