//! ThinTensor as a library: [`open`] a `.thin` archive with the engine compiled into this build for
//! its architecture, on the CPU or the GPU, and [`Session::generate`] from it, each token handed to
//! a callback as soon as it is chosen. The `thin` commands (`run`, `bench`, `logits`) are layers
//! over this; a server or an interactive chat takes a [`Session`] the same way.
//!
//! ```no_run
//! let mut s = thin::open("model.thin".as_ref(), &thin::Options::default())?;
//! let prompt = s.prompt("What is the capital of France?", true)?;
//! let stats = s.generate(&prompt, &thin::GenerateOptions::default(), |id| {
//!     print!("{id} ");
//!     Ok(thin::Flow::Continue)
//! })?;
//! println!("\n{:.1} tok/s", stats.gen_tok_s());
//! # Ok::<(), thin::Error>(())
//! ```

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use thin_core::engine::{Engine, EngineError, OpenError};
use thin_core::format::{Archive, FormatError};
use thin_core::sampler::{argmax, Sampler, SamplerConfig};
use thin_core::tokenizer::{ChatMessage, TextTokenizer, TokenizerError};

pub use thin_core::cuda::CudaOptions;
pub use thin_core::format::PagesChecked;
pub use thin_core::residency::{Budget, HostRate, Link, LinkSource, Residency, ResidencyError, ResidencyPlan};

/// What a token callback may fail with (its own I/O, a closed connection).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    // `error` is not a `source`, for the reason `Damaged`'s is not.
    #[error("opening {path}: {error}")]
    Archive { path: String, error: FormatError },
    /// A data page whose blake3 is not the page table's (checked by [`open`] unless
    /// [`Integrity::Trust`]).
    // `damage` is not a `source`: the message already says it, a chain would say it twice.
    #[error("{damage}; no token was computed from it (`thin verify` checks the whole archive; --no-verify skips this check)")]
    Damaged { path: String, damage: FormatError },
    #[error("--ctx {ctx} is more than the model's maximum of {model_max} positions")]
    CtxAboveModel { ctx: usize, model_max: u64 },
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    NoEngine(#[from] OpenError),
    #[error(
        "this thin carries no CUDA engine for this archive ({archive}); rebuild with `cargo build --release --features cuda,<arch>` (arch features: {features})"
    )]
    NoCudaEngine { archive: String, features: String },
    #[error("this thin was built without the CUDA backend; rebuild with `cargo build --release --features cuda,<arch>`")]
    NoCudaBuild,
    #[error("the CUDA backend: {0}")]
    Cuda(String),
    #[error(transparent)]
    Residency(#[from] ResidencyError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("the prompt has no tokens")]
    EmptyPrompt,
    #[error("{what} at position {pos}: {source}")]
    Step { what: &'static str, pos: usize, source: EngineError },
    #[error("{0}")]
    Callback(BoxError),
    #[error("{0}")]
    Unsupported(&'static str),
    #[error(
        "a context of {ctx} positions is more than the CPU engine for {arch} holds: its KV cache has {max_seq} (min(4096, the model's {model_max})); give --ctx {max_seq} or less, or use --backend cuda"
    )]
    CtxAboveEngine { ctx: usize, arch: &'static str, max_seq: usize, model_max: u64 },
}

/// The positions the KV cache of the CPU engine compiled in for this arch holds (its generated
/// `consts::MAX_SEQ`); `None` when no CPU engine of its shape is compiled in.
pub fn cpu_max_seq(arch: &thin_core::arch::ArchConfig) -> Option<usize> {
    thin_generated::cpu_max_seq(&arch.shape_fingerprint())
}

/// The architectures whose CPU engines are compiled into this build (`--features <arch>`).
pub fn compiled_engines() -> Vec<&'static str> {
    thin_generated::CPU_ENGINES.iter().map(|e| e.arch).collect()
}

/// Whether this build carries the CUDA backend (`--features cuda`).
pub const CUDA_COMPILED: bool = cfg!(feature = "cuda");

/// Where the engine runs. `Auto` takes CUDA in a `--features cuda` build when a GPU and driver
/// answer, else says why once and uses the CPU. (Also the CLI's `--backend`.)
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    #[default]
    Auto,
    Cpu,
    /// The GPU (a binary built with `--features cuda`).
    Cuda,
}

/// Positions a session holds when [`Options::ctx`] does not say (fewer if the model's maximum is).
pub const DEFAULT_CTX: usize = 4096;

/// Whether [`open_with`] checks the archive's data pages against their blake3 in the page table.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Integrity {
    /// Every page hashed while the engine loads; a damaged page is [`Error::Damaged`] and no
    /// token is computed from it.
    #[default]
    Verify,
    /// No page hashed (`--no-verify`): a flipped bit in the weights goes unnoticed.
    Trust,
}

/// How to open a session.
#[derive(Clone, Debug)]
pub struct Options {
    pub backend: Backend,
    /// KV-cache positions (the GPU allocates them up front); `None`: [`DEFAULT_CTX`] or the
    /// model's maximum if smaller. More than the model's maximum is [`Error::CtxAboveModel`].
    pub ctx: Option<usize>,
    /// Progress bars while loading.
    pub progress: bool,
    /// GPU kernels with in-step timestamps ([`LoadedEngine::timeline`]; benchmarks only).
    pub timeline: bool,
    /// `--gpu-mem`: the most device memory the CUDA engine may take ([`Budget::gpu_mem`]);
    /// `None`: the free memory.
    pub gpu_mem: Option<u64>,
    /// `--residency`: every weight on the device, layers streamed from host memory, or the
    /// first when it fits ([`Residency`]).
    pub residency: Residency,
}

impl Default for Options {
    fn default() -> Self {
        Options { backend: Backend::Auto, ctx: None, progress: false, timeline: false, gpu_mem: None, residency: Residency::Auto }
    }
}

/// Where `archive`'s weights would live on the GPU at `ctx` positions within `budget` under
/// `residency` (host only: nothing is allocated, no GPU is needed): the CUDA buffer layout of the
/// engine compiled in for its arch, the archive's tensor sizes and pages,
/// [`thin_core::residency::plan`]; a plan that streams is checked against the decode step's and
/// prefill's launch order ([`thin_core::cuda::plan::ring_uses`]) as the runtime will stage it.
///
/// `hybrid` measures the CPU engine's rate on the archive first ([`host_rate`]).
pub fn residency_plan(archive: &Archive, ctx: usize, budget: Budget, link: Link, residency: Residency) -> Result<ResidencyPlan, Error> {
    let host = if residency == Residency::Hybrid { host_rate(archive)? } else { HostRate::default() };
    residency_plan_with_host(archive, ctx, budget, link, host, residency)
}

/// [`residency_plan`] with the CPU engine's rate given.
pub fn residency_plan_with_host(archive: &Archive, ctx: usize, budget: Budget, link: Link, host: HostRate, residency: Residency) -> Result<ResidencyPlan, Error> {
    let m = archive.manifest();
    if ctx as u64 > m.arch.max_position_embeddings {
        return Err(Error::CtxAboveModel { ctx, model_max: m.arch.max_position_embeddings });
    }
    let arch = cuda_arch(m)?;
    // The multiprocessor count sizes grids only, never a buffer: 1 stands for any device.
    let layout = thin_core::cuda::plan::Layout::new(&arch, ctx, thin_core::cuda::PREFILL_ROWS.min(ctx), &|(r, l)| m.tensor(r, l).map(|t| t.dtype), 1)
        .map_err(|e| Error::Cuda(e.to_string()))?;
    let demand = thin_core::residency::Demand::of(m, &layout)?;
    let plan = thin_core::residency::plan_with_host(&demand, budget, link, host, residency)?;
    check_ring_order(&arch, &plan.streamed_layers, plan.ring_slots)?;
    if !plan.host_layers.is_empty() {
        let max_seq = thin_generated::cpu_max_seq(&m.shape_fingerprint).unwrap_or(0);
        if ctx > max_seq {
            return Err(Error::CtxAboveEngine { ctx, arch: thin_generated::arch_name(&m.shape_fingerprint).unwrap_or("?"), max_seq, model_max: m.arch.max_position_embeddings });
        }
    }
    Ok(plan)
}

/// How fast this machine's CPU engine computes a layer kept on the host: its own matvecs over
/// the archive's last layer, every matrix in its stored type, on the thread pool, best of three
/// passes (the first also faults the pages in), as that layer's bytes a second. Embeddings and
/// norms are left out, as the plan leaves them on the device. (A MoE layer's matvec here reads
/// every expert, where a step reads its top-k: the rate is per byte read either way.)
pub fn host_rate(archive: &Archive) -> Result<HostRate, Error> {
    use thin_core::engine::Weights;
    let m = archive.manifest();
    let last = m.arch.dims.num_layers.saturating_sub(1) as u32;
    let mut jobs = Vec::new();
    for t in m.tensors.iter().filter(|t| t.layer == Some(last) && !t.role.is_norm() && t.shape.len() >= 2) {
        let (role, layer) = (t.role, t.layer);
        let h = archive.find(role, layer).ok_or(EngineError::MissingWeight { role, layer })?;
        let view = archive.try_at(h).map_err(|reason| EngineError::BadWeight { role, layer, reason })?;
        let cols = *t.shape.last().unwrap_or(&1) as usize;
        let rows = (t.shape.iter().product::<u64>() as usize) / cols.max(1);
        jobs.push((view, vec![0.5f32 / cols as f32; cols], vec![0f32; rows], t.byte_len));
    }
    let bytes: u64 = jobs.iter().map(|j| j.3).sum();
    if bytes == 0 {
        return Err(Error::Unsupported("the archive's last layer has no matrices to time the CPU engine on"));
    }
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = std::time::Instant::now();
        for (view, x, out, _) in jobs.iter_mut() {
            thin_core::cpu::matvec(*view, x, out);
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(HostRate { gb_s: bytes as f64 / best / 1e9, source: LinkSource::Measured })
}

/// The decode step and a prefill pass can stage `streamed` through a ring of `slots` (as the
/// runtime will, [`thin_core::cuda::plan::ring_uses`]).
pub fn check_ring_order(arch: &thin_core::cuda::plan::CudaArch, streamed: &[u32], slots: usize) -> Result<(), Error> {
    let decode: Vec<Vec<_>> = arch.schedule.decode.iter().map(|l| l.weights().collect()).collect();
    let prefill: Vec<Vec<_>> = arch.schedule.prefill.iter().map(|s| s.weights()).collect();
    for steps in [decode, prefill] {
        thin_core::cuda::plan::ring_uses(&steps, streamed, slots).map_err(|e| Error::Cuda(e.to_string()))?;
    }
    Ok(())
}

/// The CUDA schedule compiled into this binary for the archive's shapes and math.
fn cuda_arch(m: &thin_core::manifest::Manifest) -> Result<thin_core::cuda::plan::CudaArch, Error> {
    // cuda_arch picks by shape alone; the engine's baked-in constants must be the archive's too.
    thin_core::engine::check_known_math(m, thin_generated::KNOWN_ARCHS)?;
    let arch = thin_generated::cuda_arch(&m.shape_fingerprint).ok_or_else(|| Error::NoCudaEngine {
        archive: format!("{:?}, {} layers, hidden {}, shape fingerprint {}", m.arch.dims.family, m.arch.dims.num_layers, m.arch.dims.hidden_size, m.shape_fingerprint),
        features: thin_generated::AVAILABLE_FEATURES.join(", "),
    })?;
    arch.map_err(|e| Error::Cuda(e.to_string()))
}

/// Free memory on the GPU, if this build has CUDA and a device answers.
pub fn free_device_bytes() -> Option<u64> {
    #[cfg(feature = "cuda")]
    return thin_core::cuda::free_device_bytes().ok().map(|(free, _ctx)| free);
    #[cfg(not(feature = "cuda"))]
    None
}

/// An engine as a session holds it: the decode loop, plus what benchmarks ask of a backend.
pub trait LoadedEngine: Engine + Send {
    /// One greedy decode step; the GPU's reads back only the chosen id.
    fn greedy(&mut self, token: u32) -> Result<u32, EngineError> {
        Ok(argmax(self.decode_step(token)?))
    }
    /// Device memory the engine's own buffers hold (weights, activations, KV cache).
    fn device_bytes(&self) -> Option<usize> {
        None
    }
    /// Device memory the engine has added since its context existed, as the driver counts it.
    fn measured_device_bytes(&self) -> Option<usize> {
        None
    }
    fn load_stats(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
    /// The device's copy rate in GB/s (read + written), measured now; `None` on the CPU.
    fn copy_rate_gb_s(&self) -> Option<f64> {
        None
    }
    /// Host-to-device copy rate from page-locked memory in GB/s, measured now (the streamed
    /// layers' own copies when some stream); `None` on the CPU.
    fn host_link_gb_s(&self) -> Option<f64> {
        None
    }
    /// Per-kernel device times of the decode step.
    fn profile(&mut self, _reps: usize) -> Result<serde_json::Value, Error> {
        Err(Error::Unsupported("this backend has no kernel profile"))
    }
    /// Each kernel's cost inside the replayed decode step.
    fn timeline(&mut self, _steps: usize) -> Result<serde_json::Value, Error> {
        Err(Error::Unsupported("this backend has no step timeline"))
    }
}

impl LoadedEngine for Box<dyn Engine + Send> {}

/// A CPU engine held to fewer positions than its KV cache has (`--ctx` below `MAX_SEQ`): past
/// `ctx` it is full, as the engine itself is at its own end.
struct CtxLimit {
    inner: Box<dyn Engine + Send>,
    pos: usize,
    ctx: usize,
}

impl Engine for CtxLimit {
    fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32], EngineError> {
        if self.pos + tokens.len() > self.ctx {
            return Err(EngineError::ContextFull { pos: self.pos + tokens.len(), max_seq: self.ctx });
        }
        let logits = self.inner.prefill(tokens)?;
        self.pos += tokens.len();
        Ok(logits)
    }
    fn decode_step(&mut self, token: u32) -> Result<&[f32], EngineError> {
        if self.pos >= self.ctx {
            return Err(EngineError::ContextFull { pos: self.pos, max_seq: self.ctx });
        }
        let logits = self.inner.decode_step(token)?;
        self.pos += 1;
        Ok(logits)
    }
    fn reset(&mut self) {
        self.inner.reset();
        self.pos = 0;
    }
}

impl LoadedEngine for CtxLimit {}

#[cfg(feature = "cuda")]
impl LoadedEngine for thin_core::cuda::runtime::CudaEngine {
    fn greedy(&mut self, token: u32) -> Result<u32, EngineError> {
        self.next_greedy(token)
    }
    fn device_bytes(&self) -> Option<usize> {
        Some(thin_core::cuda::runtime::CudaEngine::device_bytes(self))
    }
    fn measured_device_bytes(&self) -> Option<usize> {
        thin_core::cuda::runtime::CudaEngine::measured_device_bytes(self).ok()
    }
    fn load_stats(&self) -> serde_json::Value {
        serde_json::to_value(&self.stats).unwrap_or_default()
    }
    fn copy_rate_gb_s(&self) -> Option<f64> {
        thin_core::cuda::runtime::CudaEngine::copy_rate_gb_s(self).ok()
    }
    fn host_link_gb_s(&self) -> Option<f64> {
        thin_core::cuda::runtime::CudaEngine::host_link_gb_s(self).ok()
    }
    fn profile(&mut self, reps: usize) -> Result<serde_json::Value, Error> {
        let rows = thin_core::cuda::runtime::CudaEngine::profile(self, reps).map_err(|e| Error::Cuda(e.to_string()))?;
        self.reset();
        serde_json::to_value(rows).map_err(|e| Error::Cuda(e.to_string()))
    }
    fn timeline(&mut self, steps: usize) -> Result<serde_json::Value, Error> {
        let (rows, span_us) = thin_core::cuda::runtime::CudaEngine::timeline(self, steps).map_err(|e| Error::Cuda(e.to_string()))?;
        Ok(serde_json::json!({"steps": steps, "first_to_last_start_us": span_us, "kernels": rows}))
    }
}

/// The CUDA engine compiled into this binary for the archive's arch, with the weights placed as
/// its residency plan (within `gpu_mem` and the free memory, under `residency`) says: the layers
/// it streams are staged from host memory. A plan that cannot run is refused before the engine
/// allocates anything. The plan's line goes to stderr with progress on.
#[cfg(feature = "cuda")]
fn open_cuda(archive: &Arc<Archive>, opts: &CudaOptions, gpu_mem: Option<u64>, residency: Residency) -> Result<(Box<dyn LoadedEngine>, ResidencyPlan), Error> {
    let arch = cuda_arch(archive.manifest())?;
    // Held until the engine has its buffers: the engine opens the same primary context.
    let (free, _ctx) = thin_core::cuda::free_device_bytes().map_err(Error::Cuda)?;
    let plan = residency_plan(archive, opts.ctx, Budget { gpu_mem, free: Some(free) }, Link::default(), residency)?;
    if opts.progress {
        eprintln!("{}", plan.one_line());
    }
    let opts = CudaOptions { streamed_layers: plan.streamed_layers.clone(), host_layers: plan.host_layers.clone(), ..opts.clone() };
    let host = if plan.host_layers.is_empty() { None } else { Some(thin_generated::open_host_layers(archive.clone())?) };
    let e = thin_core::cuda::runtime::CudaEngine::new(archive, &arch, &opts, host).map_err(|e| Error::Cuda(e.to_string()))?;
    Ok((Box::new(e), plan))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_archive: &Arc<Archive>, _opts: &CudaOptions, _gpu_mem: Option<u64>, _residency: Residency) -> Result<(Box<dyn LoadedEngine>, ResidencyPlan), Error> {
    Err(Error::NoCudaBuild)
}

/// An archive opened with its engine and tokenizer.
pub struct Session {
    archive: Arc<Archive>,
    /// Shared, so a token callback can decode while the session generates.
    tokenizer: Arc<TextTokenizer>,
    engine: Box<dyn LoadedEngine>,
    backend: &'static str,
    arch: &'static str,
    ctx: usize,
    pages_checked: Option<PagesChecked>,
    /// The residency plan the CUDA engine was opened with; `None` on the CPU.
    residency: Option<ResidencyPlan>,
}

/// Open `path` with the engine compiled in for its architecture, on `opts.backend`, every data
/// page checked against its blake3 ([`Integrity::Verify`]).
pub fn open(path: &Path, opts: &Options) -> Result<Session, Error> {
    open_with(path, opts, Integrity::Verify)
}

/// [`open`], with the page check as `integrity` says.
///
/// The check overlaps loading: the pages are hashed on threads of their own from the moment
/// the page table is trusted, while the tokenizer loads and the engine binds its weights (the
/// CPU engine: views into the mapped file) or copies them to the GPU, and the session is
/// returned only once every page matched. So no token is ever computed from a byte that was not
/// checked: binding reads at most scale sections (and a bind error is reported as the damage
/// when the pages are damaged), a GPU upload of a damaged page is dropped unused. The CPU engine
/// computes from the mapped file itself, so what is checked is the file as it is while it is
/// open: like every mmap reader (llama.cpp's too), this guards against damage at rest
/// (truncation, flipped bits, a tampered page), not against another process rewriting the file
/// while it runs. Hashing as pages are first touched would overlap more on the CPU, but the
/// generated engines read their weights in the hot loop without a hook for it.
pub fn open_with(path: &Path, opts: &Options, integrity: Integrity) -> Result<Session, Error> {
    let shown = || path.display().to_string();
    let (archive, check) = match integrity {
        Integrity::Verify => {
            let (a, check) = Archive::open_checking_pages(path).map_err(|error| Error::Archive { path: shown(), error })?;
            (a, Some(check))
        }
        Integrity::Trust => (Archive::open(path).map_err(|error| Error::Archive { path: shown(), error })?, None),
    };
    // Archive::open loaded the tokenizer and exercised it and the chat template.
    let tokenizer = archive.tokenizer().clone();
    let archive = Arc::new(archive);
    let m = archive.manifest();
    let arch = thin_generated::arch_name(&m.shape_fingerprint).unwrap_or("?");
    let model_max = m.arch.max_position_embeddings.max(1);
    let ctx = match opts.ctx {
        Some(ctx) if ctx as u64 > model_max => return Err(Error::CtxAboveModel { ctx, model_max }),
        Some(ctx) => ctx,
        None => DEFAULT_CTX.min(model_max as usize),
    };
    let cuda = CudaOptions { ctx, progress: opts.progress, timeline: opts.timeline, ..CudaOptions::new(ctx) };
    let cpu = |a: Arc<Archive>| -> Result<Box<dyn LoadedEngine>, Error> {
        let model_max = a.manifest().arch.max_position_embeddings;
        let fingerprint = a.manifest().shape_fingerprint.clone();
        let engine = thin_generated::open_cpu(a)?;
        // The engine that just opened is the one of this fingerprint.
        let max_seq = thin_generated::cpu_max_seq(&fingerprint).unwrap_or(0);
        if ctx > max_seq {
            return Err(Error::CtxAboveEngine { ctx, arch, max_seq, model_max });
        }
        Ok(if ctx < max_seq { Box::new(CtxLimit { inner: engine, pos: 0, ctx }) } else { Box::new(engine) })
    };
    let on_cpu = |a: Arc<Archive>| cpu(a).map(|e| (e, "cpu", None));
    let loaded = match opts.backend {
        Backend::Cpu => on_cpu(archive.clone()),
        Backend::Cuda => open_cuda(&archive, &cuda, opts.gpu_mem, opts.residency).map(|(e, p)| (e, "cuda", Some(p))),
        Backend::Auto if cfg!(feature = "cuda") => match open_cuda(&archive, &cuda, opts.gpu_mem, opts.residency) {
            Ok((e, p)) => Ok((e, "cuda", Some(p))),
            Err(e) => {
                eprintln!("CUDA backend unavailable ({e}); using the CPU backend");
                on_cpu(archive.clone())
            }
        },
        Backend::Auto => on_cpu(archive.clone()),
    };
    // Damaged pages explain any load error too, so they are reported first.
    let pages_checked = check.map(|c| c.wait()).transpose().map_err(|damage| Error::Damaged { path: shown(), damage })?;
    let (engine, backend, residency) = loaded?;
    Ok(Session { archive, tokenizer, engine, backend, arch, ctx, pages_checked, residency })
}

/// Whether generation goes on after a token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    Continue,
    /// Stop here (a stop string matched, the client went away): [`Stop::Cancelled`].
    Stop,
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    Eos,
    MaxTokens,
    /// The engine's context (KV cache) is full.
    MaxSeq,
    /// The token callback asked to stop.
    Cancelled,
}

impl Stop {
    pub fn name(self) -> &'static str {
        match self {
            Stop::Eos => "eos",
            Stop::MaxTokens => "max_tokens",
            Stop::MaxSeq => "max_seq",
            Stop::Cancelled => "cancelled",
        }
    }
}

/// Prompt and generation speed, apart.
#[derive(Clone, Copy, Debug)]
pub struct Stats {
    pub prompt_tokens: usize,
    /// Sampled tokens, EOS included.
    pub generated_tokens: usize,
    /// `decode_step` calls: the first generated token comes from the prefill logits.
    pub decode_steps: usize,
    pub prompt_s: f64,
    pub gen_s: f64,
    pub stop: Stop,
}

fn per_s(n: usize, s: f64) -> f64 {
    if n > 0 && s > 0.0 {
        n as f64 / s
    } else {
        0.0
    }
}

impl Stats {
    pub fn prompt_tok_s(&self) -> f64 {
        per_s(self.prompt_tokens, self.prompt_s)
    }

    /// Decode steps per second.
    pub fn gen_tok_s(&self) -> f64 {
        per_s(self.decode_steps, self.gen_s)
    }
}

/// How much to generate and how to choose each token.
#[derive(Clone, Copy, Debug)]
pub struct GenerateOptions {
    /// Most tokens to generate (EOS and a full context stop earlier).
    pub max_tokens: usize,
    pub sampling: SamplerConfig,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions { max_tokens: 256, sampling: SamplerConfig::default() }
    }
}

/// Prefill `prompt`, then sample up to `max_tokens` tokens, calling `on_token` with each as soon
/// as it is chosen. Stops after EOS (which is passed to `on_token`), at `max_tokens`, when the
/// engine's context is full, or when `on_token` says [`Flow::Stop`].
pub fn generate(
    engine: &mut dyn Engine,
    prompt: &[u32],
    sampler: &mut Sampler,
    max_tokens: usize,
    is_eos: &dyn Fn(u32) -> bool,
    mut on_token: impl FnMut(u32) -> Result<Flow, BoxError>,
) -> Result<Stats, Error> {
    if prompt.is_empty() {
        return Err(Error::EmptyPrompt);
    }
    let start = Instant::now();
    // The prompt is part of the repetition penalty's window (as in llama.cpp).
    prompt.iter().for_each(|&t| sampler.accept(t));
    let mut id = match engine.prefill(prompt) {
        Ok(logits) => sampler.sample(logits),
        Err(source) => return Err(Error::Step { what: "prefill of the prompt", pos: 0, source }),
    };
    let prompt_s = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let (mut generated, mut steps) = (0usize, 0usize);
    let stop = loop {
        if generated >= max_tokens {
            break Stop::MaxTokens;
        }
        generated += 1;
        sampler.accept(id);
        if on_token(id).map_err(Error::Callback)? == Flow::Stop {
            break Stop::Cancelled;
        }
        if is_eos(id) {
            break Stop::Eos;
        }
        if generated >= max_tokens {
            break Stop::MaxTokens;
        }
        id = match engine.decode_step(id) {
            Ok(logits) => sampler.sample(logits),
            Err(EngineError::ContextFull { .. }) => break Stop::MaxSeq,
            Err(source) => return Err(Error::Step { what: "decode step", pos: prompt.len() + steps, source }),
        };
        steps += 1;
    };
    let gen_s = start.elapsed().as_secs_f64();
    Ok(Stats { prompt_tokens: prompt.len(), generated_tokens: generated, decode_steps: steps, prompt_s, gen_s, stop })
}

/// Generated text with stop strings cut off: text that ends in (or contains) a stop string ends
/// there, the stop string itself not emitted; while it streams, a tail that could still grow into
/// a stop string is held back until the next piece decides it (as llama-server and OpenAI do).
#[derive(Debug, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    /// Decoded text not yet handed out: a prefix of some stop string, at most.
    held: String,
}

impl StopStrings {
    /// Empty strings are ignored (they would match before any text).
    pub fn new(stops: &[String]) -> StopStrings {
        StopStrings { stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(), held: String::new() }
    }

    /// Adds the next decoded piece; returns the text that is safe to emit now and whether a stop
    /// string was reached (then generation should end: later pieces are not looked at).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        self.held.push_str(piece);
        let first = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min();
        if let Some(at) = first {
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        // Hold back the longest tail of the text that is a proper prefix of some stop string.
        let hold = self
            .stops
            .iter()
            .map(|s| {
                (1..s.len().min(self.held.len() + 1))
                    .rev()
                    .find(|&n| s.is_char_boundary(n) && self.held.ends_with(&s[..n]))
                    .unwrap_or(0)
            })
            .max()
            .unwrap_or(0);
        let emit = self.held.len() - hold;
        let out = self.held[..emit].to_string();
        self.held.drain(..emit);
        (out, false)
    }

    /// At the end of generation (no stop string came): the text still held back.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

impl Session {
    pub fn archive(&self) -> &Archive {
        &self.archive
    }

    pub fn tokenizer(&self) -> &Arc<TextTokenizer> {
        &self.tokenizer
    }

    /// `cpu` or `cuda`.
    pub fn backend(&self) -> &'static str {
        self.backend
    }

    /// The description whose engine runs the archive (`smollm2-135m`).
    pub fn arch(&self) -> &'static str {
        self.arch
    }

    /// Positions a prompt and its answer may take together: `Options::ctx` ([`DEFAULT_CTX`] or
    /// the model's maximum if smaller, when not given). A CPU engine holds [`cpu_max_seq`]
    /// positions: a larger `ctx` is refused at open, a smaller one ends generation there.
    pub fn ctx(&self) -> usize {
        self.ctx
    }

    /// What the page check at open covered (`None`: opened with [`Integrity::Trust`]).
    pub fn pages_checked(&self) -> Option<PagesChecked> {
        self.pages_checked
    }

    /// The residency plan the CUDA engine was opened with (`None` on the CPU).
    pub fn residency(&self) -> Option<&ResidencyPlan> {
        self.residency.as_ref()
    }

    /// The engine itself (benchmarks, teacher-forced logits).
    pub fn engine(&mut self) -> &mut dyn LoadedEngine {
        self.engine.as_mut()
    }

    /// `text` as prompt ids; with `chat`, inside the archive's chat template as one user message
    /// with the generation prompt on.
    pub fn prompt(&self, text: &str, chat: bool) -> Result<Vec<u32>, Error> {
        if chat {
            return self.chat_prompt(&[ChatMessage { role: "user".into(), content: text.into() }]);
        }
        let ids = self.tokenizer.encode(text)?;
        if ids.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        Ok(ids)
    }

    /// `messages` rendered through the archive's chat template (generation prompt on), as ids.
    pub fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, Error> {
        let ids = self.tokenizer.encode(&self.tokenizer.render_chat(messages)?)?;
        if ids.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        Ok(ids)
    }

    /// From an empty context: prefill `prompt`, then generate (see [`generate`]), EOS as the
    /// archive's tokenizer defines it.
    pub fn generate(&mut self, prompt: &[u32], opts: &GenerateOptions, on_token: impl FnMut(u32) -> Result<Flow, BoxError>) -> Result<Stats, Error> {
        self.engine.reset();
        let mut sampler = Sampler::new(opts.sampling);
        let tok = &self.tokenizer;
        generate(self.engine.as_mut(), prompt, &mut sampler, opts.max_tokens, &|id| tok.is_eos(id), on_token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Logits that always favour `next[pos]`; context of `max_seq` positions.
    struct Scripted {
        next: Vec<u32>,
        pos: usize,
        max_seq: usize,
        logits: Vec<f32>,
    }

    impl Scripted {
        fn new(next: &[u32], max_seq: usize) -> Scripted {
            Scripted { next: next.to_vec(), pos: 0, max_seq, logits: vec![0.0; 8] }
        }
        fn logits(&mut self) -> &[f32] {
            self.logits.iter_mut().for_each(|x| *x = 0.0);
            self.logits[self.next[self.pos - 1] as usize] = 10.0;
            &self.logits
        }
    }

    impl Engine for Scripted {
        fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32], EngineError> {
            for _ in tokens {
                self.decode_step(0)?;
            }
            Ok(self.logits())
        }
        fn decode_step(&mut self, _token: u32) -> Result<&[f32], EngineError> {
            if self.pos >= self.max_seq {
                return Err(EngineError::ContextFull { pos: self.pos, max_seq: self.max_seq });
            }
            self.pos += 1;
            Ok(self.logits())
        }
        fn reset(&mut self) {
            self.pos = 0;
        }
    }

    fn go(next: &[u32], prompt: usize, max_tokens: usize, max_seq: usize) -> (Vec<u32>, Stats) {
        let mut e = Scripted::new(next, max_seq);
        let mut s = Sampler::new(SamplerConfig::default());
        let mut got = Vec::new();
        let prompt: Vec<u32> = vec![1; prompt];
        let stats = generate(&mut e, &prompt, &mut s, max_tokens, &|id| id == 7, |id| {
            got.push(id);
            Ok(Flow::Continue)
        })
        .expect("generate");
        (got, stats)
    }

    /// Pieces through StopStrings: (emitted pieces, whether a stop string ended it, the rest).
    fn stop_run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, bool, String) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut f = StopStrings::new(&stops);
        let mut out = Vec::new();
        for p in pieces {
            let (text, stop) = f.push(p);
            out.push(text);
            if stop {
                return (out, true, String::new());
            }
        }
        (out, false, f.finish())
    }

    #[test]
    fn stop_strings_cut_the_text_and_hold_back_possible_prefixes() {
        // "</s" could begin "</stop>", so it waits; "</x" cannot, so it goes out with the next piece.
        let (out, stop, rest) = stop_run(&["</stop>"], &["Hello", " </s", "x", " wor", "</st", "op> more"]);
        assert_eq!(out, ["Hello", " ", "</sx", " wor", "", ""]);
        assert!(stop);
        assert!(rest.is_empty());
        // The stop string inside one piece: the text before it is emitted, the rest never.
        let (out, stop, _) = stop_run(&["\n\n", "END"], &["a b", "c\n\nd END"]);
        assert_eq!((out, stop), (vec!["a b".to_string(), "c".to_string()], true));
        // The earliest of two stop strings wins.
        let (out, stop, _) = stop_run(&["b", "a"], &["xab"]);
        assert_eq!((out, stop), (vec!["x".to_string()], true));
        // No stop string came: the held tail is handed back at the end, nothing is lost.
        let (out, stop, rest) = stop_run(&["STOP"], &["one ST", "O"]);
        assert_eq!((out.concat(), stop, rest.as_str()), ("one ".to_string(), false, "STO"));
        // Multi-byte characters: prefixes are cut on character boundaries only.
        let (out, stop, rest) = stop_run(&["é!"], &["café", "?"]);
        assert_eq!((out, stop, rest.as_str()), (vec!["caf".to_string(), "é?".to_string()], false, ""));
        // No stop strings (or only empty ones): everything passes through at once.
        let (out, stop, rest) = stop_run(&[""], &["a", "b"]);
        assert_eq!((out, stop, rest.as_str()), (vec!["a".to_string(), "b".to_string()], false, ""));
    }

    #[test]
    fn stops_at_eos_and_reports_it() {
        // After 2 prompt tokens the script favours next[1] = 3, then 4, then EOS (7).
        let (ids, st) = go(&[0, 3, 4, 7, 5, 5], 2, 10, 100);
        assert_eq!(ids, [3, 4, 7]);
        assert_eq!((st.stop, st.generated_tokens, st.decode_steps, st.prompt_tokens), (Stop::Eos, 3, 2, 2));
    }

    #[test]
    fn stops_at_max_tokens_without_an_extra_step() {
        let (ids, st) = go(&[3, 3, 3, 3, 3], 1, 3, 100);
        assert_eq!(ids, [3, 3, 3]);
        assert_eq!((st.stop, st.decode_steps), (Stop::MaxTokens, 2));
        let (ids, st) = go(&[3], 1, 0, 100);
        assert!(ids.is_empty());
        assert_eq!(st.stop, Stop::MaxTokens);
    }

    #[test]
    fn the_callback_can_stop_generation() {
        let mut e = Scripted::new(&[3; 8], 100);
        let mut s = Sampler::new(SamplerConfig::default());
        let mut n = 0;
        let st = generate(&mut e, &[1], &mut s, 10, &|_| false, |_| {
            n += 1;
            Ok(if n == 2 { Flow::Stop } else { Flow::Continue })
        })
        .expect("generate");
        assert_eq!((st.stop, st.generated_tokens, st.decode_steps), (Stop::Cancelled, 2, 1));
        let err = generate(&mut e, &[1], &mut s, 10, &|_| false, |_| Err("client went away".into())).err().expect("callback error");
        assert_eq!(err.to_string(), "client went away");
    }

    #[test]
    fn a_full_context_ends_generation_and_an_overlong_prompt_is_an_error() {
        let (ids, st) = go(&[3; 8], 2, 10, 4);
        assert_eq!((ids.len(), st.stop), (3, Stop::MaxSeq));
        let mut e = Scripted::new(&[3; 8], 4);
        let mut s = Sampler::new(SamplerConfig::default());
        let err = generate(&mut e, &[1; 5], &mut s, 4, &|_| false, |_| Ok(Flow::Continue)).err().expect("too long");
        assert!(err.to_string().contains("max_seq 4"), "{err}");
        let err = generate(&mut e, &[], &mut s, 4, &|_| false, |_| Ok(Flow::Continue)).err().expect("empty");
        assert!(err.to_string().contains("no tokens"));
    }
}
