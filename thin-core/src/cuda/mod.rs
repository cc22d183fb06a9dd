//! The CUDA backend. [`plan`] (the schedule as data, buffer layout, grids, kernel cache keys) is
//! plain host code, built and tested everywhere; [`runtime`] (behind the `cuda` feature) runs it.

pub mod plan;
#[cfg(feature = "cuda")]
pub mod runtime;

/// Prompt tokens one batched prefill pass takes (the layout's prefill rows, at most the context;
/// longer prompts go in chunks of this many): the runtime sizes its arena with it, and host-side
/// planning with the same figure.
pub const PREFILL_ROWS: usize = 512;

/// Free memory on GPU 0 as the driver reports it once a context exists, and that context (the
/// device's primary context: holding it until the engine opens keeps the driver from tearing it
/// down and building it again in between).
#[cfg(feature = "cuda")]
pub fn free_device_bytes() -> Result<(u64, std::sync::Arc<cudarc::driver::CudaContext>), String> {
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("no CUDA driver (libcuda) found".into());
    }
    let ctx = cudarc::driver::CudaContext::new(0).map_err(|e| format!("no CUDA device: {e:?}"))?;
    ctx.bind_to_thread().map_err(|e| format!("binding the CUDA context: {e:?}"))?;
    let (free, _total) = cudarc::driver::result::mem_get_info().map_err(|e| format!("reading free device memory: {e:?}"))?;
    Ok((free as u64, ctx))
}

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
    /// Layers whose matrices stay in page-locked host memory and are staged through a ring of
    /// device buffers each pass (the residency plan's `streamed_layers`, in step order); empty:
    /// every weight resident.
    pub streamed_layers: Vec<u32>,
    /// Layers the CPU engine computes in host memory (the residency plan's `host_layers`, for
    /// `--residency hybrid`): their matrices and KV cache never reach the device, and the engine
    /// must be opened with the CPU engine ([`runtime::CudaEngine::with_host`]).
    pub host_layers: Vec<u32>,
}

impl CudaOptions {
    pub fn new(ctx: usize) -> CudaOptions {
        CudaOptions { ctx, progress: false, timeline: false, streamed_layers: Vec::new(), host_layers: Vec::new() }
    }
}

