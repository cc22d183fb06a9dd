//! The CUDA runtime: NVRTC compilation with an on-disk cubin cache, weight upload, and the decode
//! step captured once into a CUDA graph and replayed per token.
//!
//! Weight streaming ([`CudaOptions::streamed_layers`]): the streamed layers' matrices are copied
//! once, in their device layout, into one page-locked host buffer; every pass (the decode graph,
//! each prefill chunk) copies each of them into its slot of a ring of device buffers on a second
//! stream, ordered by events alone: a layer's copy waits for the last kernel that read the layer
//! before it in the same slot, its first kernel waits for its copy ([`plan::ring_uses`]). The
//! decode step stays one graph, the copies nodes of it; the host never waits on a layer.
//!
//! Host layers ([`CudaOptions::host_layers`], `--residency hybrid`): the CPU engine computes them
//! in host memory. Their matrices are not uploaded and their KV cache is the CPU engine's. The
//! decode step then runs as launches, not a graph: at a host layer the residual row crosses to a
//! page-locked buffer, the CPU computes the layer, and the row crosses back, while the ring's
//! copies on the copy stream go on around it (so the link and the CPU work at the same time).
//!
//! cudarc loads libcuda and NVRTC at run time, so this compiles on machines without either; at run
//! time their absence is [`CudaError::NoDriver`] / [`CudaError::NoNvrtc`], never a panic.

use std::collections::BTreeMap;
use std::ffi::{c_void, CString};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{result as cu, sys as cusys, CudaContext, CudaStream};
use cudarc::cublas::{result as blas, sys as blassys};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtcsys};

pub use super::CudaOptions;
use super::plan::{self, Arg, Buf, CudaArch, Gemm, LayerSteps, Launch, Layout, RingUse, RopeTable, Step};
use crate::residency::{ring_layout, StreamedLayer, WeightSpan, RING_SLOTS};
use crate::dtype::DType;
use crate::engine::{EngineError, HostLayers};
use crate::format::Archive;
use crate::role::Role;

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA driver (libcuda) found on this machine")]
    NoDriver,
    #[error("no NVRTC library (libnvrtc) found: put the CUDA toolkit's lib64 on LD_LIBRARY_PATH")]
    NoNvrtc,
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    #[error("CUDA driver call failed while {what}: {err}")]
    Driver { what: &'static str, err: String },
    #[error("NVRTC could not compile the {arch} kernels for {target}: {log}")]
    Compile { arch: String, target: String, log: String },
    #[error(transparent)]
    Plan(#[from] plan::PlanError),
    #[error("weight {role:?} (layer {layer:?}): {msg}")]
    Weight { role: Role, layer: Option<u32>, msg: String },
    #[error("the CPU engine's layer {layer}: {err}")]
    Host { layer: u32, err: String },
    #[error("{0} host layers were asked for but no CPU engine was given (CudaEngine::with_host)")]
    NoHostEngine(usize),
    #[error("archive is for arch {archive} (fingerprint {archive_fp}), this engine for {engine} ({engine_fp})")]
    Mismatch { engine: String, engine_fp: String, archive: String, archive_fp: String },
}

fn drv<T>(what: &'static str, r: Result<T, cu::DriverError>) -> Result<T, CudaError> {
    r.map_err(|e| CudaError::Driver { what, err: format!("{e:?}") })
}

/// One device allocation, freed on drop.
struct DeviceBuffer {
    ptr: cusys::CUdeviceptr,
    bytes: usize,
}

impl DeviceBuffer {
    /// `zeroed`: clear it first (the arena: KV cache, position and token start at 0). Weights are
    /// overwritten by their upload and skip the clear.
    fn new(bytes: usize, zeroed: bool, what: &'static str) -> Result<Self, CudaError> {
        let ptr = drv(what, unsafe { cu::malloc_sync(bytes.max(1)) })?;
        if zeroed {
            // cuMemsetD8 is asynchronous to the host on the legacy stream: wait for it, so no
            // upload on the engine's stream can land before the clear.
            drv(what, unsafe { cu::memset_d8_sync(ptr, 0, bytes.max(1)) })?;
            drv(what, cu::ctx::synchronize())?;
        }
        Ok(DeviceBuffer { ptr, bytes })
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        unsafe {
            let _ = cu::free_sync(self.ptr);
        }
    }
}

/// One page-locked host allocation (cuMemHostAlloc), freed on drop: the source of the streamed
/// layers' copies, so they run as DMA without a staging copy and can be graph nodes.
struct PinnedBuffer {
    ptr: *mut u8,
    bytes: usize,
}

impl PinnedBuffer {
    fn new(bytes: usize) -> Result<Self, CudaError> {
        let ptr = drv("allocating page-locked host memory for the streamed layers", unsafe { cu::malloc_host(bytes.max(1), 0) })? as *mut u8;
        Ok(PinnedBuffer { ptr, bytes })
    }

    /// Write `data` at `offset` (in bounds: the ring layout placed it).
    fn write(&mut self, offset: usize, data: &[u8]) -> Result<(), CudaError> {
        if offset.checked_add(data.len()).is_none_or(|end| end > self.bytes) {
            return Err(CudaError::Driver { what: "staging a streamed weight", err: format!("{} bytes at {offset} of {}", data.len(), self.bytes) });
        }
        // In bounds (checked above) of an allocation this buffer owns; `data` is host memory of its own.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(offset), data.len()) };
        Ok(())
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        unsafe {
            let _ = cu::free_host(self.ptr as *mut c_void);
        }
    }
}

/// The streamed layers: their pinned host copy, the ring of device slots they pass through, the
/// copy stream and the events that order the copies against the compute stream.
struct Ring {
    copy: Arc<CudaStream>,
    host: PinnedBuffer,
    slots: Vec<DeviceBuffer>,
    /// In ring order: slot, host offset, bytes, each matrix's offset.
    layers: Vec<StreamedLayer>,
    /// Where each streamed matrix is read from: (slot, offset in it, bytes).
    places: BTreeMap<(Role, Option<u32>), (usize, usize, usize)>,
    /// The decode step's and a prefill pass's use of the ring, by step.
    decode: Vec<RingUse>,
    prefill: Vec<RingUse>,
    /// `start` (recorded on the compute stream, awaited by the copy stream), `joined` (the other
    /// way, at the end of a pass), then per streamed layer `copied` and `done`.
    start: cusys::CUevent,
    joined: cusys::CUevent,
    copied: Vec<cusys::CUevent>,
    done: Vec<cusys::CUevent>,
}

impl Ring {
    fn slot_bytes(&self) -> usize {
        self.slots.iter().map(|s| s.bytes).sum()
    }

    /// Enqueue streamed layer `k`'s copy into its slot on the copy stream, and mark it copied.
    fn copy_layer(&self, k: usize) -> Result<(), CudaError> {
        let l = &self.layers[k];
        let cs = self.copy.cu_stream();
        // The pinned buffer lives as long as the ring, and so do the slots the graph copies into.
        unsafe {
            let src = self.host.ptr.add(l.host_offset as usize) as *const c_void;
            drv("copying a streamed layer", cusys::cuMemcpyHtoDAsync_v2(self.slots[l.slot].ptr, src, l.bytes as usize, cs).result())?;
            drv("recording a streamed layer's copy", cu::event::record(self.copied[k], cs))
        }
    }

    /// Run a pass of `n` steps on `stream` (`step(i, waited)` enqueues step `i`; `waited`: the
    /// stream has just been made to wait for a copy, so the step must not be a programmatic
    /// dependent launch), the ring's copies on the copy stream around them as `uses` orders them.
    /// Captured into a graph as well as run eagerly: nothing here waits on the host.
    fn staged(&self, stream: &CudaStream, n: usize, uses: &[RingUse], mut step: impl FnMut(usize, bool) -> Result<(), CudaError>) -> Result<(), CudaError> {
        let (cs, copy) = (stream.cu_stream(), self.copy.cu_stream());
        let wait = |s, e| drv("ordering a streamed layer", unsafe { cu::stream::wait_event(s, e, cusys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) });
        let record = |e, s| drv("ordering a streamed layer", unsafe { cu::event::record(e, s) });
        record(self.start, cs)?;
        wait(copy, self.start)?;
        let slots = self.slots.len();
        let mut issued = 0;
        let mut issue = |upto: Option<usize>| -> Result<(), CudaError> {
            while let Some(u) = uses.get(issued) {
                match (u.after, upto) {
                    (None, _) => {}
                    (Some(a), Some(i)) if a <= i => wait(copy, self.done[issued - slots])?,
                    _ => break,
                }
                self.copy_layer(issued)?;
                issued += 1;
            }
            Ok(())
        };
        issue(None)?;
        for i in 0..n {
            let mut waited = false;
            for (k, _) in uses.iter().enumerate().filter(|(_, u)| u.first == i) {
                wait(cs, self.copied[k])?;
                waited = true;
            }
            step(i, waited)?;
            for (k, _) in uses.iter().enumerate().filter(|(k, u)| u.last == i && k + slots < uses.len()) {
                record(self.done[k], cs)?;
            }
            issue(Some(i))?;
        }
        record(self.joined, copy)?;
        wait(cs, self.joined)
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        unsafe {
            let _ = cu::stream::synchronize(self.copy.cu_stream());
            for e in [self.start, self.joined].iter().chain(&self.copied).chain(&self.done) {
                let _ = cu::event::destroy(*e);
            }
        }
    }
}

/// The layers the CPU engine computes: the engine, which layers (with their decode launches and
/// prefill steps, which it replaces), and the page-locked rows the residual stream crosses in.
struct HostPart {
    engine: Box<dyn HostLayers + Send>,
    /// Each host layer with its decode launches and prefill steps.
    layers: Vec<(u32, LayerSteps)>,
    /// `[prefill_rows, hidden]` f32.
    rows: PinnedBuffer,
}

impl HostPart {
    /// The host layer whose decode launches (`decode`) or prefill steps hold step `i`, and
    /// whether `i` is its first.
    fn at(&self, i: usize, decode: bool) -> Option<(u32, bool)> {
        self.layers.iter().find_map(|(l, steps)| {
            let r = if decode { &steps.decode } else { &steps.prefill };
            r.contains(&i).then_some((*l, i == r.start))
        })
    }
}

/// Where compiled kernels are cached: `$THIN_CACHE_DIR`, else `$XDG_CACHE_HOME/thin`, else `~/.cache/thin`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("THIN_CACHE_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("thin");
    }
    std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(std::env::temp_dir).join(".cache").join("thin")
}

/// How the engine came up: for the CLI's report and for benchmarks.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct LoadStats {
    pub device: String,
    pub gpu_target: String,
    pub driver_version: i32,
    pub kernel_cache_hit: bool,
    pub compile_s: f64,
    pub upload_s: f64,
    pub capture_s: f64,
    pub weight_bytes: usize,
    pub arena_bytes: usize,
    pub kv_bytes: usize,
    pub launches_per_step: usize,
    /// Programmatic dependent launch between the decode graph's kernels (sm_90+).
    pub pdl: bool,
    /// The kernels stamp the in-step timeline ([`CudaOptions::timeline`]).
    pub timeline: bool,
    /// Decode attention splits a head ([`plan::Layout::splits`]).
    pub attn_splits: usize,
    /// The storage types of the archive's matrices (one kernel instance each).
    pub weight_types: Vec<String>,
    /// Registers per thread of each kernel, as the compiled module has them.
    pub kernel_regs: std::collections::BTreeMap<String, i32>,
    /// Device memory in use (cuMemGetInfo: total - free) once the context and stream existed,
    /// before this engine allocated anything: what [`CudaEngine::measured_device_bytes`] subtracts.
    pub context_bytes: usize,
    /// Layers whose matrices stream from host memory each pass (empty: all resident).
    pub streamed_layers: Vec<u32>,
    /// The streaming ring's device buffers, all slots together.
    pub ring_bytes: usize,
    /// Page-locked host memory holding the streamed layers: the bytes each token copies.
    pub pinned_host_bytes: usize,
    /// Layers the CPU engine computes (empty: none).
    pub host_layers: Vec<u32>,
}

/// Copy `data` to device address `dst` in `stream`'s order and wait for it to land. (The
/// synchronous cuMemcpyHtoD is not enough: from pageable memory it may return before the DMA
/// has landed, and kernels on a non-blocking stream are not ordered after it.)
fn upload<T>(stream: &CudaStream, dst: u64, data: &[T], what: &'static str) -> Result<(), CudaError> {
    drv(what, unsafe { cu::memcpy_htod_async(dst, data, stream.cu_stream()) })?;
    drv(what, unsafe { cu::stream::synchronize(stream.cu_stream()) })
}

/// Device memory in use on the current context's GPU (total - free), all processes.
fn device_used_bytes() -> Result<usize, CudaError> {
    let (mut free, mut total) = (0usize, 0usize);
    drv("reading device memory in use", unsafe { cusys::cuMemGetInfo_v2(&mut free, &mut total) }.result())?;
    Ok(total.saturating_sub(free))
}

/// Compile `source` for `target` to a cubin, or read it from the cache.
fn compiled_cubin(source: &str, arch: &str, target: &str, driver_version: i32) -> Result<(Vec<u8>, bool, f64), CudaError> {
    let key = plan::kernel_cache_key(source, arch, target, driver_version);
    let dir = cache_dir().join("kernels");
    let path = dir.join(format!("{key}.cubin"));
    if let Ok(bytes) = std::fs::read(&path) {
        if !bytes.is_empty() {
            return Ok((bytes, true, 0.0));
        }
    }
    if !unsafe { nvrtcsys::is_culib_present() } {
        return Err(CudaError::NoNvrtc);
    }
    let t = Instant::now();
    let src = CString::new(source).map_err(|_| CudaError::Compile { arch: arch.into(), target: target.into(), log: "source holds a NUL byte".into() })?;
    let name = CString::new(format!("{arch}.cu")).unwrap_or_default();
    let err = |log: String| CudaError::Compile { arch: arch.into(), target: target.into(), log };
    let prog = nvrtc::create_program(&src, Some(&name)).map_err(|e| err(format!("{e:?}")))?;
    let opts = [format!("--gpu-architecture={target}"), "--std=c++17".to_string(), "--fmad=true".to_string()];
    let compiled = unsafe { nvrtc::compile_program(prog, &opts) };
    let result = match compiled {
        Err(e) => {
            let log = unsafe { nvrtc::get_program_log(prog) }
                .map(|l| unsafe { std::ffi::CStr::from_ptr(l.as_ptr()) }.to_string_lossy().into_owned())
                .unwrap_or_default();
            Err(err(format!("{e:?}: {log}")))
        }
        Ok(()) => unsafe {
            let mut size = 0usize;
            let r = nvrtcsys::nvrtcGetCUBINSize(prog, &mut size);
            if r != nvrtcsys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
                Err(err(format!("nvrtcGetCUBINSize: {r:?}")))
            } else {
                let mut buf = vec![0u8; size];
                let r = nvrtcsys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut std::ffi::c_char);
                if r != nvrtcsys::nvrtcResult::NVRTC_SUCCESS {
                    Err(err(format!("nvrtcGetCUBIN: {r:?}")))
                } else {
                    Ok(buf)
                }
            }
        },
    };
    unsafe {
        let _ = nvrtc::destroy_program(prog);
    }
    let cubin = result?;
    let secs = t.elapsed().as_secs_f64();
    // Best effort: a cache that cannot be written only costs the next start a compile.
    if std::fs::create_dir_all(&dir).is_ok() {
        let tmp = dir.join(format!("{key}.cubin.tmp{}", std::process::id()));
        if std::fs::write(&tmp, &cubin).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok((cubin, false, secs))
}

/// A kernel argument as the driver wants it: a pointer to the value.
enum ParamValue {
    Ptr(u64),
    I32(i32),
}

/// Where an engine's weights come from: an archive, or (kernel tests) values the caller made up.
pub trait WeightSource {
    /// The storage type of a tensor, `None` if absent.
    fn dtype(&self, role: Role, layer: Option<u32>) -> Option<DType>;
    /// The tensor's bytes as stored (little-endian, row-major).
    fn bytes(&self, role: Role, layer: Option<u32>) -> Result<std::borrow::Cow<'_, [u8]>, String>;
    /// The tensor's shape, `None` if absent.
    fn shape(&self, role: Role, layer: Option<u32>) -> Option<Vec<u64>>;
}

impl WeightSource for Archive {
    fn dtype(&self, role: Role, layer: Option<u32>) -> Option<DType> {
        self.manifest().tensor(role, layer).map(|t| t.dtype)
    }
    fn bytes(&self, role: Role, layer: Option<u32>) -> Result<std::borrow::Cow<'_, [u8]>, String> {
        let e = self.manifest().tensor(role, layer).ok_or("missing from the archive")?;
        self.tensor_bytes(e).map(std::borrow::Cow::Borrowed).map_err(|e| e.to_string())
    }
    fn shape(&self, role: Role, layer: Option<u32>) -> Option<Vec<u64>> {
        self.manifest().tensor(role, layer).map(|t| t.shape.clone())
    }
}

/// Device time of one kernel of the decode step, from [`CudaEngine::profile`].
#[derive(Debug, Clone, serde::Serialize)]
pub struct KernelTime {
    pub kernel: &'static str,
    /// Launches of this kernel in one decode step.
    pub launches: usize,
    /// Mean device time per launch, replayed back to back in step order (so each launch reads
    /// its own weights from HBM, as in the step).
    pub us_per_launch: f64,
    /// Weight bytes all its launches read per step.
    pub weight_bytes: usize,
    /// weight_bytes over the time of all its launches.
    pub weight_gb_s: f64,
}

/// One kernel's share of the decode step as it runs inside the graph, from [`CudaEngine::timeline`].
#[derive(Debug, Clone, serde::Serialize)]
pub struct TimelineRow {
    pub kernel: &'static str,
    /// Launches of this kernel in one decode step.
    pub launches: usize,
    /// Mean time from a launch's start (its predecessor complete) to its successor's start, over
    /// its launches and the timed steps: the launch's whole cost in the step, drain and
    /// dependency latency included. The step's last kernel has no successor and no row.
    pub us_per_launch: f64,
    /// All its launches' time per step.
    pub us_per_step: f64,
}

pub use super::PREFILL_ROWS;

/// The CUDA engine: every weight resident on the device, or the streamed layers staged through
/// a ring each pass ([`CudaOptions::streamed_layers`]); the decode step one graph, prefill batched
/// (cuBLAS GEMMs over all prompt rows, causal attention over the cache).
pub struct CudaEngine {
    _ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    module: cusys::CUmodule,
    graph: cusys::CUgraphExec,
    graph_def: cusys::CUgraph,
    weights: DeviceBuffer,
    /// (offset, bytes) of every resident weight in `weights`.
    offsets: std::collections::BTreeMap<(Role, Option<u32>), (usize, usize)>,
    /// The streamed layers, if any: read from the ring's slots.
    ring: Option<Ring>,
    /// The layers the CPU engine computes, if any (taken out while a pass runs).
    host: Option<HostPart>,
    /// Every kernel the schedule launches, by instance name ([`Layout::kernel`]).
    funcs: BTreeMap<String, cusys::CUfunction>,
    /// The arch, its schedule among it.
    spec: CudaArch,
    blas: Option<blassys::cublasHandle_t>,
    arena: DeviceBuffer,
    layout: Layout,
    pos: usize,
    /// The token id the device already holds in `Tok` (the last argmax), if known.
    device_tok: Option<u32>,
    /// The last logits read back (the engine's own buffer: no allocation per step).
    logits: Vec<f32>,
    pub stats: LoadStats,
}

/// GPU 0 with a context and a stream, and what the plan needs to know of it.
struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    sm_count: u32,
    /// Compute capability major (PDL and clusters from 9).
    major: i32,
}

impl Device {
    fn open(stats: &mut LoadStats) -> Result<Device, CudaError> {
        if !unsafe { cusys::is_culib_present() } {
            return Err(CudaError::NoDriver);
        }
        let ctx = CudaContext::new(0).map_err(|e| CudaError::NoDevice(format!("{e:?}")))?;
        unsafe { ctx.disable_event_tracking() };
        let stream = drv("creating a stream", ctx.new_stream())?;
        stats.device = ctx.name().unwrap_or_default();
        stats.context_bytes = device_used_bytes()?;
        let (major, minor) = drv("reading the compute capability", ctx.compute_capability())?;
        stats.gpu_target = format!("sm_{major}{minor}");
        let mut dv = 0i32;
        unsafe { cusys::cuDriverGetVersion(&mut dv) };
        stats.driver_version = dv;
        let sm_count = drv("reading the multiprocessor count", ctx.attribute(cusys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT))? as u32;
        Ok(Device { ctx, stream, sm_count, major })
    }
}

/// The kernel module of one arch, compiled (or read from the cache) and loaded with the weight
/// types `layout` found in the archive (each a `#define THIN_WEIGHTS_<type>` in front of the
/// source, so only their kernel instances are compiled), and every kernel the schedule launches
/// resolved by its instance name.
fn compile(dev: &Device, arch: &CudaArch, layout: &Layout, timeline: bool, stats: &mut LoadStats) -> Result<(cusys::CUmodule, BTreeMap<String, cusys::CUfunction>), CudaError> {
    let types: std::collections::BTreeSet<&'static str> = layout.types.iter().filter(|(w, _)| !w.0.is_norm()).map(|(_, t)| t.name()).collect();
    stats.weight_types = types.iter().map(|t| t.to_string()).collect();
    let mut defines: String = types.iter().map(|t| format!("#define THIN_WEIGHTS_{t} 1\n")).collect();
    // The timeline variant is its own cached cubin too.
    if timeline {
        defines.push_str("#define THIN_TIMELINE 1\n");
    }
    let source = format!("{defines}{}", arch.kernels);
    let (cubin, hit, compile_s) = compiled_cubin(&source, arch.arch, &stats.gpu_target, stats.driver_version)?;
    stats.kernel_cache_hit = hit;
    stats.compile_s = compile_s;
    drv("binding the context", dev.ctx.bind_to_thread())?;
    let module = drv("loading the kernel module", unsafe { cu::module::load_data(cubin.as_ptr() as *const c_void) })?;
    let mut funcs = BTreeMap::new();
    for l in arch.schedule.launches() {
        let k = layout.kernel(l);
        if funcs.contains_key(&k) {
            continue;
        }
        let name = CString::new(k.as_str()).map_err(|_| CudaError::Driver { what: "resolving a kernel", err: format!("bad kernel name {k:?}") })?;
        let f = drv("resolving a kernel", unsafe { cu::module::get_function(module, name) })?;
        let mut regs = 0i32;
        if unsafe { cusys::cuFuncGetAttribute(&mut regs, cusys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NUM_REGS, f) } == cusys::CUresult::CUDA_SUCCESS {
            stats.kernel_regs.insert(k.clone(), regs);
        }
        funcs.insert(k, f);
    }
    // Prefill's GEMMs over quantized matrices decode them first (`dequant_<type>`).
    for g in arch.schedule.gemms() {
        let t = layout.type_of(g.weight).ok_or(CudaError::Weight { role: g.weight.0, layer: g.weight.1, msg: "no type".into() })?;
        let k = plan::instance("dequant", t);
        if !plan::dequantized_for_gemm(t) || funcs.contains_key(&k) {
            continue;
        }
        let name = CString::new(k.as_str()).map_err(|_| CudaError::Driver { what: "resolving a kernel", err: format!("bad kernel name {k:?}") })?;
        let f = drv("resolving a kernel", unsafe { cu::module::get_function(module, name) })?;
        funcs.insert(k, f);
    }
    Ok((module, funcs))
}

/// Every weight the schedule reads, as the kernels read it ([`plan::device_bytes`]): the resident
/// ones uploaded into one device buffer (with each tensor's (offset, bytes) in it), the matrices
/// of `streamed` layers copied into one page-locked host buffer as [`ring_layout`] places them
/// (with that layout).
#[allow(clippy::type_complexity)]
fn upload_weights(
    dev: &Device,
    src: &dyn WeightSource,
    arch: &CudaArch,
    streamed: &[u32],
    host: &[u32],
    progress: bool,
) -> Result<(DeviceBuffer, BTreeMap<(Role, Option<u32>), (usize, usize)>, Option<(PinnedBuffer, usize, usize, Vec<StreamedLayer>)>), CudaError> {
    let mut offsets = BTreeMap::new();
    let mut total = 0usize;
    let mut sources = Vec::new();
    let mut stream_sources = BTreeMap::new();
    let mut spans = Vec::new();
    for (role, layer) in arch.schedule.weights() {
        // Norm vectors are f32 in every profile (the kernels read them as such).
        let stored = src.dtype(role, layer);
        if role.is_norm() && stored != Some(DType::F32) {
            return Err(CudaError::Weight { role, layer, msg: format!("stored as {stored:?}; the kernels read norm weights as f32") });
        }
        let bytes = match (stored, src.shape(role, layer)) {
            (Some(t), Some(shape)) => src.bytes(role, layer).and_then(|b| plan::device_bytes(t, &shape, b)),
            _ => Err("missing".to_string()),
        }
        .map_err(|msg| CudaError::Weight { role, layer, msg })?;
        let n = bytes.len();
        let aligned = n.div_ceil(plan::ALIGN) * plan::ALIGN;
        let span = WeightSpan { role, layer, bytes: aligned as u64, first_page: 0, page_count: 0 };
        if !span.always_resident() && layer.is_some_and(|l| host.contains(&l)) {
            // The CPU engine reads it in host memory.
            continue;
        }
        if !span.always_resident() && layer.is_some_and(|l| streamed.contains(&l)) {
            spans.push(span);
            stream_sources.insert((role, layer), bytes);
            continue;
        }
        offsets.insert((role, layer), (total, n));
        sources.push((bytes, total));
        total += aligned;
    }
    let weights = DeviceBuffer::new(total, false, "allocating weights")?;
    let ring = if streamed.is_empty() {
        None
    } else {
        let (slots, slot_bytes, layers) = ring_layout(&spans, streamed, RING_SLOTS);
        let mut host = PinnedBuffer::new(layers.iter().map(|l| l.bytes as usize).sum())?;
        for l in &layers {
            for t in &l.tensors {
                let bytes = &stream_sources[&(t.role, Some(l.layer))];
                host.write((l.host_offset + t.offset) as usize, bytes)?;
            }
        }
        Some((host, slots, slot_bytes as usize, layers))
    };
    let bar = progress.then(|| {
        let b = indicatif::ProgressBar::new(total as u64);
        b.set_style(indicatif::ProgressStyle::with_template("uploading weights {bar:40} {bytes}/{total_bytes} {bytes_per_sec}").unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()));
        b
    });
    for (bytes, off) in sources {
        upload(&dev.stream, weights.ptr + off as u64, &bytes[..], "uploading weights")?;
        if let Some(b) = &bar {
            b.inc(bytes.len() as u64);
        }
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    Ok((weights, offsets, ring))
}

/// The ring for `layers` (as [`upload_weights`] staged them in `host`): its slots and copy stream,
/// events, and its use by the decode step and a prefill pass, checked against both schedules (and
/// the epilogue, which must read no streamed matrix).
fn make_ring(dev: &Device, arch: &CudaArch, host: PinnedBuffer, slots: usize, slot_bytes: usize, layers: Vec<StreamedLayer>) -> Result<Ring, CudaError> {
    let streamed: Vec<u32> = layers.iter().map(|l| l.layer).collect();
    let decode_steps: Vec<Vec<plan::WeightRef>> = arch.schedule.decode.iter().map(|l| l.weights().collect()).collect();
    let prefill_steps: Vec<Vec<plan::WeightRef>> = arch.schedule.prefill.iter().map(Step::weights).collect();
    let decode = plan::ring_uses(&decode_steps, &streamed, slots)?;
    let prefill = plan::ring_uses(&prefill_steps, &streamed, slots)?;
    if let Some((r, l)) = arch.schedule.epilogue.iter().flat_map(|l| l.weights()).find(|&(r, l)| !r.is_norm() && l.is_some_and(|l| streamed.contains(&l))) {
        return Err(CudaError::Weight { role: r, layer: l, msg: "streamed, but read by the prefill epilogue (outside any staged pass)".into() });
    }
    let places = layers.iter().flat_map(|l| l.tensors.iter().map(move |t| ((t.role, Some(l.layer)), (l.slot, t.offset as usize, t.bytes as usize)))).collect();
    let slot_bufs = (0..slots).map(|_| DeviceBuffer::new(slot_bytes, false, "allocating the streaming ring")).collect::<Result<Vec<_>, _>>()?;
    let copy = drv("creating the copy stream", dev.ctx.new_stream())?;
    let event = || drv("creating an event", cu::event::create(cusys::CUevent_flags::CU_EVENT_DISABLE_TIMING));
    let n = layers.len();
    Ok(Ring {
        copy,
        host,
        slots: slot_bufs,
        layers,
        places,
        decode,
        prefill,
        start: event()?,
        joined: event()?,
        copied: (0..n).map(|_| event()).collect::<Result<_, _>>()?,
        done: (0..n).map(|_| event()).collect::<Result<_, _>>()?,
    })
}

/// cuBLAS on the engine's stream, if the library is there (prefill's GEMMs; without it prefill
/// replays the decode step token by token).
fn blas_handle(dev: &Device) -> Result<Option<blassys::cublasHandle_t>, CudaError> {
    if !unsafe { blassys::is_culib_present() } {
        return Ok(None);
    }
    let h = blas::create_handle().map_err(|e| CudaError::Driver { what: "creating the cuBLAS handle", err: format!("{e:?}") })?;
    unsafe { blas::set_stream(h, dev.stream.cu_stream() as blassys::cudaStream_t) }.map_err(|e| CudaError::Driver { what: "binding cuBLAS to the stream", err: format!("{e:?}") })?;
    Ok(Some(h))
}

impl CudaEngine {
    /// Bring `arch` up on GPU 0 with the archive's weights.
    /// `host`: the CPU engine over the same archive, for [`CudaOptions::host_layers`].
    pub fn new(archive: &Archive, arch: &CudaArch, opts: &CudaOptions, host: Option<Box<dyn HostLayers + Send>>) -> Result<Self, CudaError> {
        let m = archive.manifest();
        if m.shape_fingerprint != arch.fingerprint {
            let a = &m.arch;
            return Err(CudaError::Mismatch {
                engine: arch.arch.into(),
                engine_fp: arch.fingerprint.into(),
                archive: format!("{:?} ({} layers, hidden {}, vocab {})", a.dims.family, a.dims.num_layers, a.dims.hidden_size, a.dims.vocab_size),
                archive_fp: m.shape_fingerprint.clone(),
            });
        }
        Self::with_host(archive, arch, opts, host)
    }

    /// Bring `arch` up on GPU 0 with weights from `src` (which must hold `arch`'s shapes): compile
    /// the kernels, lay out the buffers, upload the weights, capture the decode step.
    pub fn with_weights(src: &dyn WeightSource, arch: &CudaArch, opts: &CudaOptions) -> Result<Self, CudaError> {
        Self::with_host(src, arch, opts, None)
    }

    /// [`Self::with_weights`], with `host` computing [`CudaOptions::host_layers`] (the CPU engine
    /// over the same weights; required when any layer is on the host).
    pub fn with_host(src: &dyn WeightSource, arch: &CudaArch, opts: &CudaOptions, host: Option<Box<dyn HostLayers + Send>>) -> Result<Self, CudaError> {
        let mut stats = LoadStats::default();
        let host_engine = match (host, opts.host_layers.len()) {
            (_, 0) => None,
            (None, n) => return Err(CudaError::NoHostEngine(n)),
            (Some(h), _) => Some(h),
        };
        if let Some(h) = &host_engine {
            if let Some(&l) = opts.host_layers.iter().find(|&&l| l as usize >= h.num_layers() || l as usize >= arch.schedule.layers.len()) {
                return Err(CudaError::Host { layer: l, err: format!("not a layer of this model ({} layers)", arch.schedule.layers.len()) });
            }
            if h.max_seq() < opts.ctx {
                return Err(CudaError::Host { layer: opts.host_layers[0], err: format!("the CPU engine holds {} positions, fewer than the context of {}", h.max_seq(), opts.ctx) });
            }
        }
        let dev = Device::open(&mut stats)?;
        // Each launch's kernel instance is that of its weights' storage type.
        let layout = Layout::new(arch, opts.ctx, PREFILL_ROWS.min(opts.ctx), &|(r, l)| src.dtype(r, l), dev.sm_count)?.without_kv_of(&opts.host_layers);
        stats.timeline = opts.timeline;
        stats.pdl = dev.major >= 9;
        stats.attn_splits = layout.splits;
        stats.launches_per_step = arch.schedule.decode.len();
        let (module, funcs) = compile(&dev, arch, &layout, opts.timeline, &mut stats)?;

        let t = Instant::now();
        let (weights, offsets, staged) = upload_weights(&dev, src, arch, &opts.streamed_layers, &opts.host_layers, opts.progress)?;
        stats.weight_bytes = weights.bytes;
        let ring = match staged {
            Some((host, slots, slot_bytes, layers)) => Some(make_ring(&dev, arch, host, slots, slot_bytes, layers)?),
            None => None,
        };
        if let Some(r) = &ring {
            stats.streamed_layers = opts.streamed_layers.clone();
            stats.ring_bytes = r.slot_bytes();
            stats.pinned_host_bytes = r.host.bytes;
        }
        let arena = DeviceBuffer::new(layout.total_bytes, true, "allocating activations and KV cache")?;
        for t in [RopeTable::Global, RopeTable::Local] {
            if let (Some((co, _)), Some((so, _))) = (layout.get(Buf::Cos(t)), layout.get(Buf::Sin(t))) {
                let (c, s) = plan::rope_tables(arch, t, opts.ctx);
                upload(&dev.stream, arena.ptr + co as u64, &c, "uploading RoPE tables")?;
                upload(&dev.stream, arena.ptr + so as u64, &s, "uploading RoPE tables")?;
            }
        }
        stats.upload_s = t.elapsed().as_secs_f64();
        stats.arena_bytes = layout.total_bytes;
        stats.kv_bytes = layout.kv_bytes();

        let host = match host_engine {
            Some(engine) => {
                let layers = opts.host_layers.iter().map(|&l| (l, arch.schedule.layers[l as usize].clone())).collect();
                stats.host_layers = opts.host_layers.clone();
                Some(HostPart { engine, layers, rows: PinnedBuffer::new(layout.prefill_rows * arch.dims.hidden_size as usize * 4)? })
            }
            None => None,
        };
        let blas = blas_handle(&dev)?;
        let mut e = CudaEngine {
            _ctx: dev.ctx,
            stream: dev.stream,
            module,
            graph: std::ptr::null_mut(),
            graph_def: std::ptr::null_mut(),
            weights,
            offsets,
            ring,
            host,
            funcs,
            spec: arch.clone(),
            blas,
            arena,
            layout,
            pos: 0,
            device_tok: None,
            logits: vec![0.0; arch.dims.vocab_size as usize],
            stats,
        };
        // With host layers the step runs as launches (the host computes inside it): no graph.
        if e.host.is_none() {
            e.capture()?;
        }
        Ok(e)
    }

    /// Capture the decode step once into a graph.
    fn capture(&mut self) -> Result<(), CudaError> {
        let t = Instant::now();
        let cs = self.stream.cu_stream();
        drv("starting graph capture", unsafe { cu::stream::begin_capture(cs, cusys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) })?;
        let decode = &self.spec.schedule.decode;
        let captured = match &self.ring {
            // A launch right after a wait for a copy is an ordinary one: its weights are read
            // before pdl_enter(), so its start must wait for the copy, not only its predecessor's drain.
            Some(r) => r.staged(&self.stream, decode.len(), &r.decode, |i, waited| self.launch(&decode[i], 1, self.stats.pdl && !waited)),
            None => decode.iter().try_for_each(|l| self.launch(l, 1, self.stats.pdl)),
        };
        let capture_err = captured.err();
        let graph_def = drv("ending graph capture", unsafe { cu::stream::end_capture(cs) })?;
        self.graph_def = graph_def;
        if let Some(e) = capture_err {
            return Err(e);
        }
        self.graph = drv("instantiating the graph", unsafe { cu::graph::instantiate(graph_def, cusys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH) })?;
        self.stats.capture_s = t.elapsed().as_secs_f64();
        Ok(())
    }

    /// An argument's value in a pass of `rows` rows (the decode step: 1).
    fn resolve(&self, a: &Arg, rows: usize) -> Result<ParamValue, CudaError> {
        Ok(match *a {
            Arg::Buf(b) => ParamValue::Ptr(self.buf(b)),
            Arg::Weight(r, l) => ParamValue::Ptr(self.weight(r, l)?),
            Arg::Null => ParamValue::Ptr(0),
            Arg::I32(_) | Arg::GridX(_) | Arg::Ctx | Arg::Elements { .. } => ParamValue::I32(self.layout.value(*a, rows).unwrap_or_default()),
        })
    }

    fn weight(&self, r: Role, l: Option<u32>) -> Result<u64, CudaError> {
        if let Some(off) = self.offsets.get(&(r, l)) {
            return Ok(self.weights.ptr + off.0 as u64);
        }
        let ring = self.ring.as_ref();
        let (slot, off, _) = ring.and_then(|ring| ring.places.get(&(r, l))).ok_or(CudaError::Weight { role: r, layer: l, msg: "not uploaded".into() })?;
        Ok(ring.map_or(0, |ring| ring.slots[*slot].ptr) + *off as u64)
    }

    /// Refuse what reads the weights outside a staged pass (a streamed layer's slot holds
    /// whichever layer was copied last).
    fn all_resident(&self, what: &'static str) -> Result<(), CudaError> {
        if let Some(h) = &self.host {
            return Err(CudaError::Driver { what, err: format!("{} layers run on the CPU: this needs every weight on the device (--residency all)", h.layers.len()) });
        }
        match &self.ring {
            Some(r) => Err(CudaError::Driver { what, err: format!("{} layers stream through the ring: this needs every weight resident (--residency all)", r.layers.len()) }),
            None => Ok(()),
        }
    }

    /// Host layer `layer` on `rows` rows of the residual in `buf` (`X`, or prefill's `PX`) at
    /// positions `pos..`: the rows cross to the page-locked buffer, the CPU engine computes the
    /// layer, the rows cross back. Waits for the compute stream only (the copy stream goes on).
    fn host_layer(&self, host: &mut HostPart, layer: u32, buf: Buf, rows: usize, pos: usize) -> Result<(), CudaError> {
        let cs = self.stream.cu_stream();
        let n = rows * self.spec.dims.hidden_size as usize;
        if n * 4 > host.rows.bytes {
            return Err(CudaError::Host { layer, err: format!("{rows} rows exceed the {} bytes of the host rows", host.rows.bytes) });
        }
        let dev = self.buf(buf);
        unsafe {
            drv("copying rows to a host layer", cusys::cuMemcpyDtoHAsync_v2(host.rows.ptr as *mut c_void, dev, n * 4, cs).result())?;
            drv("waiting for rows to reach a host layer", cu::stream::synchronize(cs))?;
        }
        // The buffer is page-aligned, holds at least `n` f32 (checked above) and nothing else
        // touches it while the stream is idle on it.
        let x = unsafe { std::slice::from_raw_parts_mut(host.rows.ptr as *mut f32, n) };
        let done = if buf == Buf::X { host.engine.layer_step(layer as usize, x, pos) } else { host.engine.layer_prompt(layer as usize, x, pos) };
        done.map_err(|e| CudaError::Host { layer, err: e.to_string() })?;
        unsafe { drv("copying rows back from a host layer", cusys::cuMemcpyHtoDAsync_v2(dev, host.rows.ptr as *const c_void, n * 4, cs).result()) }
    }

    /// The decode step as launches, with the host layers computed by the CPU engine in place of
    /// theirs, and the ring's copies around them as the graph would order them.
    fn decode_with_host(&self, host: &mut HostPart) -> Result<(), CudaError> {
        let decode = &self.spec.schedule.decode;
        let mut after_host = false;
        let mut step = |i: usize, waited: bool| -> Result<(), CudaError> {
            if let Some((layer, first)) = host.at(i, true) {
                if first {
                    self.host_layer(host, layer, Buf::X, 1, self.pos)?;
                }
                after_host = true;
                return Ok(());
            }
            // After a wait for a copy or the host's rows: an ordinary launch (see `capture`).
            let pdl = self.stats.pdl && !waited && !after_host;
            after_host = false;
            self.launch(&decode[i], 1, pdl)
        };
        match &self.ring {
            Some(r) => r.staged(&self.stream, decode.len(), &r.decode, step),
            None => (0..decode.len()).try_for_each(|i| step(i, false)),
        }
    }

    /// Launch one kernel; with `pdl` (graph capture on sm_90+) as a programmatic dependent launch:
    /// it may start while the previous kernel drains, and its `pdl_enter()` (every kernel calls it
    /// before touching activations) waits for that kernel's completion and writes.
    fn launch(&self, l: &Launch, rows: usize, pdl: bool) -> Result<(), CudaError> {
        let name = self.layout.kernel(l);
        let f = *self.funcs.get(&name).ok_or(CudaError::Driver { what: "launching", err: format!("{name} is not a kernel of this schedule") })?;
        let grid = self.layout.grid(l.grid, rows);
        let mut values: Vec<ParamValue> = l.args.iter().map(|a| self.resolve(a, rows)).collect::<Result<_, _>>()?;
        let mut params: Vec<*mut c_void> = values
            .iter_mut()
            .map(|v| match v {
                ParamValue::Ptr(p) => p as *mut u64 as *mut c_void,
                ParamValue::I32(i) => i as *mut i32 as *mut c_void,
            })
            .collect();
        if !pdl {
            return drv("launching a kernel", unsafe { cu::launch_kernel(f, grid, (l.block, 1, 1), 0, self.stream.cu_stream(), &mut params) });
        }
        let mut attr: cusys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = cusys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let cfg = cusys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: l.block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        drv("launching a kernel (programmatic dependent launch)", unsafe { cusys::cuLaunchKernelEx(&cfg, f, params.as_mut_ptr(), std::ptr::null_mut()) }.result())
    }

    /// One prefill GEMM: `out[:, col..col+n] (+)= input · W^T` (row-major), as cuBLAS's
    /// column-major `C[n, rows] = op(W)^T · X`.
    fn gemm(&self, handle: blassys::cublasHandle_t, g: &Gemm, rows: usize) -> Result<(), CudaError> {
        let mut w = self.weight(g.weight.0, g.weight.1)?;
        let stored = self.layout.type_of(g.weight).ok_or(CudaError::Weight { role: g.weight.0, layer: g.weight.1, msg: "not in the layout".into() })?;
        if plan::dequantized_for_gemm(stored) {
            // A quantized matrix: decoded to bf16 into PW first, on the same stream.
            let f = *self.funcs.get(&plan::instance("dequant", stored)).ok_or(CudaError::Driver { what: "launching", err: format!("no dequant kernel for {}", stored.name()) })?;
            let (mut src, mut n, mut k, mut dst) = (w, g.n as i32, g.k as i32, self.buf(Buf::PW));
            let mut params: Vec<*mut c_void> = vec![&mut src as *mut u64 as *mut c_void, &mut n as *mut i32 as *mut c_void, &mut k as *mut i32 as *mut c_void, &mut dst as *mut u64 as *mut c_void];
            let blocks = ((g.n * g.k).div_ceil(256) as u32).min(self.layout.sm_count * 8);
            drv("dequantizing a prefill GEMM's weights", unsafe { cu::launch_kernel(f, (blocks, 1, 1), (256, 1, 1), 0, self.stream.cu_stream(), &mut params) })?;
            w = self.buf(Buf::PW);
        }
        // The weights as the GEMM reads them; the input rows were written in the same type (the layout checked).
        let wtype = match plan::gemm_type(stored) {
            DType::F32 => blassys::cudaDataType::CUDA_R_32F,
            _ => blassys::cudaDataType::CUDA_R_16BF,
        };
        let x = self.buf(g.input);
        let c = self.buf(g.out) + (g.out_col * 4) as u64;
        let (alpha, beta) = (1.0f32, if g.accumulate { 1.0f32 } else { 0.0f32 });
        unsafe {
            blas::gemm_ex(
                handle,
                blassys::cublasOperation_t::CUBLAS_OP_T,
                blassys::cublasOperation_t::CUBLAS_OP_N,
                g.n as i32,
                rows as i32,
                g.k as i32,
                &alpha as *const f32 as *const c_void,
                w as *const c_void,
                wtype,
                g.k as i32,
                x as *const c_void,
                wtype,
                g.k as i32,
                &beta as *const f32 as *const c_void,
                c as *mut c_void,
                blassys::cudaDataType::CUDA_R_32F,
                g.ldc as i32,
                blassys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blassys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        }
        .map_err(|e| CudaError::Driver { what: "running a prefill GEMM", err: format!("{e:?}") })
    }

    fn set_pos(&self, pos: usize) -> Result<(), CudaError> {
        let p = [pos as i32];
        drv("writing the position", unsafe { cu::memcpy_htod_async(self.buf(Buf::Pos), &p, self.stream.cu_stream()) })
    }

    /// Batched prefill: chunks of up to `prefill_rows` tokens, each one pass of GEMMs; then the
    /// decode step's final norm, LM head and argmax on the last row.
    fn prefill_batched(&mut self, handle: blassys::cublasHandle_t, tokens: &[u32]) -> Result<&[f32], EngineError> {
        if self.pos + tokens.len() > self.layout.ctx {
            return Err(EngineError::ContextFull { pos: self.pos + tokens.len(), max_seq: self.layout.ctx });
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.spec.dims.vocab_size as usize) {
            return Err(EngineError::TokenOutOfRange { token: t, vocab: self.spec.dims.vocab_size as usize });
        }
        let cs = self.stream.cu_stream();
        let mut last_rows = 0;
        for chunk in tokens.chunks(self.layout.prefill_rows) {
            let ids: Vec<i32> = chunk.iter().map(|&t| t as i32).collect();
            drv("writing prompt ids", unsafe { cu::memcpy_htod_async(self.buf(Buf::PToks), &ids, cs) }).map_err(Self::engine_err)?;
            let steps = &self.spec.schedule.prefill;
            let mut host = self.host.take();
            let pos = self.pos;
            let mut run = |i: usize, _waited: bool| match host.as_mut().and_then(|h| h.at(i, false).map(|at| (h, at))) {
                Some((h, (layer, true))) => self.host_layer(h, layer, Buf::PX, chunk.len(), pos),
                Some(_) => Ok(()),
                None => match &steps[i] {
                    Step::Kernel(l) => self.launch(l, chunk.len(), false),
                    Step::Gemm(g) => self.gemm(handle, g, chunk.len()),
                },
            };
            let ran = match &self.ring {
                Some(r) => r.staged(&self.stream, steps.len(), &r.prefill, &mut run),
                None => (0..steps.len()).try_for_each(|i| run(i, false)),
            };
            self.host = host;
            ran.map_err(Self::engine_err)?;
            self.pos += chunk.len();
            self.set_pos(self.pos).map_err(Self::engine_err)?;
            last_rows = chunk.len();
        }
        // The last prompt row becomes the decode step's residual; its epilogue runs at pos - 1.
        let row = (last_rows - 1) * self.spec.dims.hidden_size as usize * 4;
        drv("copying the last row", unsafe { cu::memcpy_dtod_async(self.buf(Buf::X), self.buf(Buf::PX) + row as u64, self.spec.dims.hidden_size as usize * 4, cs) }).map_err(Self::engine_err)?;
        self.set_pos(self.pos - 1).map_err(Self::engine_err)?;
        for l in &self.spec.schedule.epilogue {
            self.launch(l, 1, false).map_err(Self::engine_err)?;
        }
        self.device_tok = None;
        self.read_logits()
    }

    fn buf(&self, b: Buf) -> u64 {
        self.arena.ptr + self.layout.get(b).map(|x| x.0).unwrap_or(0) as u64
    }

    fn engine_err(e: CudaError) -> EngineError {
        EngineError::Backend(e.to_string())
    }

    /// One replay of the decode step with `token` at the current position.
    fn step(&mut self, token: u32) -> Result<(), EngineError> {
        drv("binding the context", self._ctx.bind_to_thread()).map_err(Self::engine_err)?;
        if token as usize >= self.spec.dims.vocab_size as usize {
            return Err(EngineError::TokenOutOfRange { token, vocab: self.spec.dims.vocab_size as usize });
        }
        if self.pos >= self.layout.ctx {
            return Err(EngineError::ContextFull { pos: self.pos, max_seq: self.layout.ctx });
        }
        let cs = self.stream.cu_stream();
        if self.device_tok != Some(token) {
            let t = [token as i32];
            drv("writing the token", unsafe { cu::memcpy_htod_async(self.buf(Buf::Tok), &t, cs) }).map_err(Self::engine_err)?;
        }
        match self.host.take() {
            Some(mut h) => {
                let ran = self.decode_with_host(&mut h);
                self.host = Some(h);
                ran.map_err(Self::engine_err)?;
            }
            None => drv("replaying the decode graph", unsafe { cu::graph::launch(self.graph, cs) }).map_err(Self::engine_err)?,
        }
        self.pos += 1;
        self.device_tok = None;
        Ok(())
    }

    fn read_logits(&mut self) -> Result<&[f32], EngineError> {
        let cs = self.stream.cu_stream();
        let src = self.buf(Buf::Logits);
        drv("reading logits", unsafe { cu::memcpy_dtoh_async(&mut self.logits, src, cs) }).map_err(Self::engine_err)?;
        drv("synchronizing", unsafe { cu::stream::synchronize(cs) }).map_err(Self::engine_err)?;
        Ok(&self.logits)
    }

    /// Greedy decode step: only the argmax id crosses to the host.
    pub fn next_greedy(&mut self, token: u32) -> Result<u32, EngineError> {
        self.step(token)?;
        let mut t = [0i32];
        let cs = self.stream.cu_stream();
        drv("reading the token", unsafe { cu::memcpy_dtoh_async(&mut t, self.buf(Buf::Tok), cs) }).map_err(Self::engine_err)?;
        drv("synchronizing", unsafe { cu::stream::synchronize(cs) }).map_err(Self::engine_err)?;
        self.device_tok = Some(t[0] as u32);
        Ok(t[0] as u32)
    }

    /// Bytes this engine holds on the device (resident weights + streaming ring + activations + KV cache).
    pub fn device_bytes(&self) -> usize {
        self.stats.weight_bytes + self.stats.ring_bytes + self.arena.bytes
    }

    /// Device memory this engine has added since its context existed, as the driver counts it
    /// (cuMemGetInfo): its own buffers plus the kernel module, the captured graph and cuBLAS's
    /// workspace. Nothing is freed while the engine lives, so the value at the end of a run is
    /// that run's peak. Other processes on the same GPU would count too.
    pub fn measured_device_bytes(&self) -> Result<usize, CudaError> {
        Ok(device_used_bytes()?.saturating_sub(self.stats.context_bytes))
    }
}

/// Kernel-level access, for the kernel tests (each kernel against the CPU reference on random
/// inputs) and `thin bench --profile`.
impl CudaEngine {
    /// The decode step's launches, in order.
    /// Device-to-device copy rate in GB/s, bytes read plus bytes written (the roofline's
    /// denominator, as METHOD.md measures it): 512 MiB copied 10 times after one untimed copy, on
    /// two buffers allocated for it and freed after.
    pub fn copy_rate_gb_s(&self) -> Result<f64, CudaError> {
        const BYTES: usize = 512 << 20;
        let (a, b) = (DeviceBuffer::new(BYTES, true, "allocating the copy test")?, DeviceBuffer::new(BYTES, false, "allocating the copy test")?);
        let cs = self.stream.cu_stream();
        let copy = || drv("timing a device copy", unsafe { cu::memcpy_dtod_async(b.ptr, a.ptr, BYTES, cs) });
        copy()?;
        drv("timing a device copy", self.stream.synchronize())?;
        let t = std::time::Instant::now();
        for _ in 0..10 {
            copy()?;
        }
        drv("timing a device copy", self.stream.synchronize())?;
        Ok(2.0 * BYTES as f64 * 10.0 / t.elapsed().as_secs_f64() / 1e9)
    }

    /// Host-to-device copy rate in GB/s from page-locked memory, the way streamed layers cross the
    /// link: with a ring, every streamed layer copied into its slot on the copy stream, three rounds
    /// timed after one untimed (every pass refills the slots, so this disturbs nothing); without
    /// one, 256 MiB from a pinned buffer into a device buffer, both made for it and freed after.
    pub fn host_link_gb_s(&self) -> Result<f64, CudaError> {
        const ROUNDS: usize = 3;
        drv("binding the context", self._ctx.bind_to_thread())?;
        drv("synchronizing", self.stream.synchronize())?;
        let (a, b) = (
            drv("creating an event", cu::event::create(cusys::CUevent_flags::CU_EVENT_DEFAULT))?,
            drv("creating an event", cu::event::create(cusys::CUevent_flags::CU_EVENT_DEFAULT))?,
        );
        let timed = (|| -> Result<f64, CudaError> {
            const PROBE_BYTES: usize = 256 << 20;
            let probe = match self.ring {
                Some(_) => None,
                None => Some((PinnedBuffer::new(PROBE_BYTES)?, DeviceBuffer::new(PROBE_BYTES, false, "allocating the host-link probe")?)),
            };
            let cs = self.ring.as_ref().map_or(self.stream.cu_stream(), |r| r.copy.cu_stream());
            // One round of copies: the bytes it moved.
            let round = || -> Result<usize, CudaError> {
                if let Some(r) = &self.ring {
                    (0..r.layers.len()).try_for_each(|k| r.copy_layer(k))?;
                    return Ok(r.host.bytes);
                }
                let Some((h, d)) = &probe else { return Ok(0) };
                drv("timing a host copy", unsafe { cusys::cuMemcpyHtoDAsync_v2(d.ptr, h.ptr as *const c_void, h.bytes, cs).result() })?;
                Ok(h.bytes)
            };
            let bytes = round()?;
            unsafe {
                drv("recording an event", cu::event::record(a, cs))?;
                for _ in 0..ROUNDS {
                    round()?;
                }
                drv("recording an event", cu::event::record(b, cs))?;
                drv("synchronizing", cu::stream::synchronize(cs))?;
                let ms = drv("reading an event", cu::event::elapsed(a, b))?;
                Ok((bytes * ROUNDS) as f64 / (ms as f64 * 1e-3) / 1e9)
            }
        })();
        unsafe {
            let _ = cu::event::destroy(a);
            let _ = cu::event::destroy(b);
        }
        timed
    }

    pub fn launches(&self) -> &[Launch] {
        &self.spec.schedule.decode
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Write `data` at the start of buffer `b` (it must fit).
    pub fn write_buf(&self, b: Buf, data: &[u8]) -> Result<(), CudaError> {
        let (_, n) = self.layout.get(b).ok_or(CudaError::Driver { what: "writing a buffer", err: format!("{b:?} is not in this layout") })?;
        if data.len() > n {
            return Err(CudaError::Driver { what: "writing a buffer", err: format!("{} bytes into {b:?} of {n}", data.len()) });
        }
        drv("binding the context", self._ctx.bind_to_thread())?;
        upload(&self.stream, self.buf(b), data, "writing a buffer")
    }

    /// The whole of buffer `b`.
    pub fn read_buf(&self, b: Buf) -> Result<Vec<u8>, CudaError> {
        let (_, n) = self.layout.get(b).ok_or(CudaError::Driver { what: "reading a buffer", err: format!("{b:?} is not in this layout") })?;
        let mut out = vec![0u8; n];
        drv("binding the context", self._ctx.bind_to_thread())?;
        drv("synchronizing", unsafe { cu::stream::synchronize(self.stream.cu_stream()) })?;
        drv("reading a buffer", unsafe { cu::memcpy_dtoh_sync(&mut out, self.buf(b)) })?;
        Ok(out)
    }

    /// Run one decode or prefill step (a kernel or a GEMM over `rows` rows) outside any graph and wait for it.
    pub fn run_step(&self, step: &Step, rows: usize) -> Result<(), CudaError> {
        self.all_resident("running one step alone")?;
        drv("binding the context", self._ctx.bind_to_thread())?;
        match step {
            Step::Kernel(l) => self.launch(l, rows, false)?,
            Step::Gemm(g) => {
                let h = self.blas.ok_or(CudaError::Driver { what: "running a GEMM", err: "no cuBLAS on this machine".into() })?;
                self.gemm(h, g, rows)?
            }
        }
        drv("synchronizing", unsafe { cu::stream::synchronize(self.stream.cu_stream()) })
    }

    /// Device time of `launches` captured into one graph, replayed `reps` times (after 3 warm-up replays).
    fn time_graph(&self, launches: &[&Launch], reps: usize) -> Result<f64, CudaError> {
        let cs = self.stream.cu_stream();
        drv("starting graph capture", unsafe { cu::stream::begin_capture(cs, cusys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) })?;
        let launched: Result<(), CudaError> = launches.iter().try_for_each(|l| self.launch(l, 1, self.stats.pdl));
        let g = drv("ending graph capture", unsafe { cu::stream::end_capture(cs) })?;
        let result = launched.and_then(|()| {
            let exec = drv("instantiating a profile graph", unsafe { cu::graph::instantiate(g, cusys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH) })?;
            let timed = (|| {
                let (a, b) = (
                    drv("creating an event", cu::event::create(cusys::CUevent_flags::CU_EVENT_DEFAULT))?,
                    drv("creating an event", cu::event::create(cusys::CUevent_flags::CU_EVENT_DEFAULT))?,
                );
                let r = (|| unsafe {
                    for _ in 0..3 {
                        drv("replaying", cu::graph::launch(exec, cs))?;
                    }
                    drv("recording an event", cu::event::record(a, cs))?;
                    for _ in 0..reps {
                        drv("replaying", cu::graph::launch(exec, cs))?;
                    }
                    drv("recording an event", cu::event::record(b, cs))?;
                    drv("synchronizing", cu::stream::synchronize(cs))?;
                    drv("reading an event", cu::event::elapsed(a, b))
                })();
                unsafe {
                    let _ = cu::event::destroy(a);
                    let _ = cu::event::destroy(b);
                }
                r
            })();
            unsafe {
                let _ = cu::graph::exec_destroy(exec);
            }
            timed
        });
        unsafe {
            let _ = cu::graph::destroy(g);
        }
        Ok(result? as f64 * 1e3 / reps as f64)
    }

    /// Per-kernel device time of the decode step: each kernel's launches (every layer's, in step
    /// order) captured alone into a graph and replayed, so a launch pays its own weight traffic
    /// and the gap to the next launch, as in the step. The last row is the whole step, timed the
    /// same way. Leaves the KV cache and position changed: call `reset` before generating.
    pub fn profile(&mut self, reps: usize) -> Result<Vec<KernelTime>, CudaError> {
        self.all_resident("profiling kernels one by one")?;
        drv("binding the context", self._ctx.bind_to_thread())?;
        let reps = reps.max(1);
        let pos = self.pos.min(self.layout.ctx.saturating_sub(4 * reps + 16));
        let mut names: Vec<&'static str> = Vec::new();
        for l in &self.spec.schedule.decode {
            if !names.contains(&l.kernel) {
                names.push(l.kernel);
            }
        }
        // Weight bytes a launch reads: whole tensors, but one row of the embedding table and the
        // chosen top_k of a stacked expert tensor's experts (as Manifest::weight_bytes_per_token).
        let row = self.offsets.get(&(Role::TokenEmbd, None)).map_or(0, |x| x.1 / self.spec.dims.vocab_size as usize);
        let (experts, top_k) = (self.spec.dims.num_experts.max(1) as usize, self.spec.dims.top_k as usize);
        let wbytes = |ls: &[&Launch]| -> usize {
            ls.iter()
                .flat_map(|l| l.args.iter().map(move |a| (l.kernel, a)))
                .filter_map(|(k, a)| match a {
                    Arg::Weight(..) if k == "embed" => Some(row),
                    Arg::Weight(r @ (Role::MoeGate | Role::MoeUp | Role::MoeDown), l) => self.offsets.get(&(*r, *l)).map(|x| x.1 / experts * top_k),
                    Arg::Weight(r, l) => self.offsets.get(&(*r, *l)).map(|x| x.1),
                    _ => None,
                })
                .sum()
        };
        let mut out = Vec::new();
        let mut rows: Vec<(&'static str, Vec<&Launch>)> = names.iter().map(|&n| (n, self.spec.schedule.decode.iter().filter(|l| l.kernel == n).collect())).collect();
        rows.push(("step", self.spec.schedule.decode.iter().collect()));
        for (name, ls) in rows {
            // Every timing starts from the same position, so attention reads the same cache span
            // (argmax_step advances it by one per replay).
            self.set_pos(pos)?;
            let us = self.time_graph(&ls, reps)?;
            let n = if name == "step" { 1 } else { ls.len() };
            let bytes = wbytes(&ls);
            out.push(KernelTime { kernel: name, launches: ls.len(), us_per_launch: us / n as f64, weight_bytes: bytes, weight_gb_s: bytes as f64 / (us * 1e3) });
        }
        self.set_pos(self.pos)?;
        Ok(out)
    }
}

/// The in-step timeline (an engine brought up with [`CudaOptions::timeline`]).
impl CudaEngine {
    /// Replay `steps` greedy decode steps from the current position, each alone, reading the
    /// kernels' start stamps after each ([`TimelineRow`]); returns the rows in step order of
    /// first launch and the mean span from the first kernel's start to the last one's. Advances
    /// the position.
    pub fn timeline(&mut self, steps: usize) -> Result<(Vec<TimelineRow>, f64), CudaError> {
        self.all_resident("reading the step timeline")?;
        if !self.stats.timeline {
            return Err(CudaError::Driver { what: "reading the step timeline", err: "the kernels were built without stamps: bring the engine up with the timeline option (thin bench --timeline)".into() });
        }
        drv("binding the context", self._ctx.bind_to_thread())?;
        let (stamps, _) = drv("finding the timeline", unsafe { cu::module::get_global(self.module, CString::new("thin_timeline").unwrap()) })?;
        let (count, _) = drv("finding the timeline", unsafe { cu::module::get_global(self.module, CString::new("thin_timeline_n").unwrap()) })?;
        let n = self.spec.schedule.decode.len();
        let steps = steps.min(self.layout.ctx.saturating_sub(self.pos + 1));
        let mut per_launch = vec![0f64; n.saturating_sub(1)];
        let mut span = 0f64;
        let mut tok = self.device_tok.unwrap_or(0);
        for _ in 0..steps {
            upload(&self.stream, count, &[0u32], "resetting the timeline")?;
            tok = self.next_greedy(tok).map_err(|e| CudaError::Driver { what: "a timeline step", err: e.to_string() })?;
            let mut got = [0u32];
            let mut t = vec![0u64; n];
            drv("reading the timeline", unsafe { cu::memcpy_dtoh_sync(&mut got, count) })?;
            if got[0] as usize != n {
                return Err(CudaError::Driver { what: "reading the step timeline", err: format!("{} stamps for {n} launches", got[0]) });
            }
            drv("reading the timeline", unsafe { cu::memcpy_dtoh_sync(&mut t, stamps) })?;
            for k in 0..n - 1 {
                per_launch[k] += t[k + 1].saturating_sub(t[k]) as f64 / 1e3;
            }
            span += t[n - 1].saturating_sub(t[0]) as f64 / 1e3;
        }
        let steps_f = steps.max(1) as f64;
        let mut rows: Vec<TimelineRow> = Vec::new();
        for (k, l) in self.spec.schedule.decode[..n - 1].iter().enumerate() {
            let us = per_launch[k] / steps_f;
            match rows.iter_mut().find(|r| r.kernel == l.kernel) {
                Some(r) => {
                    r.launches += 1;
                    r.us_per_step += us;
                }
                None => rows.push(TimelineRow { kernel: l.kernel, launches: 1, us_per_launch: 0.0, us_per_step: us }),
            }
        }
        for r in &mut rows {
            r.us_per_launch = r.us_per_step / r.launches as f64;
        }
        Ok((rows, span / steps_f))
    }
}

impl crate::engine::Engine for CudaEngine {
    fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32], EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        drv("binding the context", self._ctx.bind_to_thread()).map_err(Self::engine_err)?;
        match self.blas {
            Some(h) => self.prefill_batched(h, tokens),
            None => {
                // No cuBLAS on this machine: the decode graph, token by token.
                for &t in tokens {
                    self.step(t)?;
                }
                self.read_logits()
            }
        }
    }

    fn decode_step(&mut self, token: u32) -> Result<&[f32], EngineError> {
        self.step(token)?;
        self.read_logits()
    }

    fn reset(&mut self) {
        let _ = self._ctx.bind_to_thread();
        let z = [0i32];
        let _ = upload(&self.stream, self.buf(Buf::Pos), &z, "resetting the position");
        self.pos = 0;
        self.device_tok = None;
    }
}

// The engine owns its context, stream, module and graph outright; every entry point binds the
// context to the calling thread first, so moving the engine between threads is sound.
unsafe impl Send for CudaEngine {}

impl Drop for CudaEngine {
    fn drop(&mut self) {
        unsafe {
            let _ = cu::stream::synchronize(self.stream.cu_stream());
            if !self.graph.is_null() {
                let _ = cu::graph::exec_destroy(self.graph);
                let _ = cu::graph::destroy(self.graph_def);
            }
            let _ = cu::module::unload(self.module);
            if let Some(h) = self.blas {
                let _ = blas::destroy_handle(h);
            }
        }
    }
}
