//! The CUDA backend. [`plan`] (the schedule as data, buffer layout, grids, kernel cache keys) is
//! plain host code, built and tested everywhere; [`runtime`] (behind the `cuda` feature) runs it.

pub mod plan;
#[cfg(feature = "cuda")]
pub mod runtime;

/// How to bring an engine up: the choices a user or a benchmark makes.
#[derive(Debug, Clone)]
pub struct CudaOptions {
    /// KV-cache positions to allocate.
    pub ctx: usize,
    /// A progress bar while the weights upload.
    pub progress: bool,
    /// Build the kernels with in-step timestamps (`thin bench --timeline`):
    /// a separately cached module, slower by the stamps' cost.
    pub timeline: bool,
}

impl CudaOptions {
    pub fn new(ctx: usize) -> CudaOptions {
        CudaOptions { ctx, progress: false, timeline: false }
    }
}

