//! thin-core: what every ThinTensor engine shares — the `.thin` archive, the importers, quantization,
//! tokenizer, sampler, CPU reference ops and (behind `cuda`) the CUDA runtime.

pub mod arch;
pub mod dtype;
pub mod manifest;
pub mod quant;
pub mod role;
