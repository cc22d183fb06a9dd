//! The CUDA backend. [`plan`] (buffer layout, the decode step's launch list, kernel cache keys) is
//! plain host code, built and tested everywhere; [`runtime`] (behind the `cuda` feature) runs it.

pub mod plan;
#[cfg(feature = "cuda")]
pub mod runtime;
