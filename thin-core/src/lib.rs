//! thin-core: what every ThinTensor engine shares — the `.thin` archive, the importers, quantization,
//! tokenizer, sampler, CPU reference ops and (behind `cuda`) the CUDA runtime.

pub mod arch;
pub mod codec;
pub mod codecs;
pub mod convert;
pub mod cpu;
pub mod cuda;
pub mod dtype;
pub mod engine;
pub mod format;
pub mod gguf;
pub mod manifest;
pub mod names;
pub mod quant;
pub mod residency;
pub mod role;
pub mod safetensors_dir;
pub mod sampler;
pub mod source;
pub mod tokenizer;
pub mod weight_format;
