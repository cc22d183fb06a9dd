//! Which weights stay resident on the GPU and which would stream over the host link, decided
//! before anything is allocated: what `thin plan` prints and what `run`/`bench` check when they
//! load on the CUDA backend. Host-only arithmetic over the archive's manifest and the CUDA buffer
//! layout ([`crate::cuda::plan::Layout`]); no device is needed.
//!
//! The device holds, besides the weights: the activations and the KV cache (the layout's arena),
//! cuBLAS's workspace, and the kernel module with the captured decode graph. The last two are
//! allowances calibrated on the device, not computed (see [`CUBLAS_WORKSPACE_BYTES`]).
//!
//! Streaming keeps the token embedding, the LM head and every norm resident, then as many whole
//! layers as fit (the first ones: the ring then has the whole resident prefix of the step to fetch
//! the first streamed layer), and leaves room for a ring of [`RING_SLOTS`] buffers, each the size
//! of the largest streamed layer. Every streamed layer crosses the host link once per token.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::cuda::plan::{device_len, Layout, ALIGN};
use crate::manifest::{Manifest, TensorEntry};
use crate::role::Role;

/// cuBLAS's own workspace for prefill's GEMMs: the library's default on Hopper (32 MiB; 4 MiB on
/// older GPUs — the larger is taken). The runtime does not set one.
pub const CUBLAS_WORKSPACE_BYTES: u64 = 32 << 20;
/// The kernel module, the captured decode graph and the driver's other allocations for them.
/// Calibrated on the device: `peak_gib - held_gib` (what cuMemGetInfo says the engine added,
/// minus its own weight and arena buffers) was 71.5 to 73.2 MiB for SmolLM2-135M, Gemma-3-270M,
/// Llama-3.2-1B and SmolLM3-3B, bf16, ctx 4096, on H100 and H200 (bench/results/runs/
/// run28-ae1d926-h100-formats-raw.tgz and run29-751a5ec-h100-dims-formats-ab-raw.tgz, `load`
/// objects). Less the 32 MiB of cuBLAS that is at most 41.2 MiB; 48 MiB leaves about 7 MiB of margin.
pub const MODULE_AND_GRAPH_BYTES: u64 = 48 << 20;
/// Streaming buffers in the ring. Two: the layer being computed reads one while the copy stream
/// fills the other with the next streamed layer. A streamed layer takes far longer to cross the
/// host link than to compute (SmolLM3-3B: 156 MB, about 3 ms at 50 GB/s, against tens of µs from
/// HBM), so with two the link is never idle and a third slot would only cost a layer's memory.
pub const RING_SLOTS: usize = 2;
/// Free device memory `auto` leaves unused when no `--gpu-mem` is given: the driver's figure moves
/// with other processes and the allocator's rounding, so a plan that fills it exactly is fragile.
/// 1 GiB, the margin llama.cpp's `--fit` leaves by default. `all` and `stream` take the free
/// memory as it is; a given `--gpu-mem` is honoured exactly by every mode (within the free memory).
pub const AUTO_FREE_MARGIN: u64 = 1 << 30;
/// Host-to-device bandwidth when none was measured: PCIe Gen5 x16 carries 63 GB/s a direction
/// after 128b/130b coding; 80% of that, 50 GB/s, is assumed reachable for pinned copies. Assumed.
pub const ASSUMED_LINK_GB_S: f64 = 50.0;
/// The CPU engine's matvec rate when none was measured: 20 GB/s, below what it measured on a
/// 2-core VM (28.5 GB/s, bf16) and far below a 16-core host's (about 77). `thin plan` and the
/// loaders measure it on the archive ([`HostRate`]); this only stands in where nothing ran.
pub const ASSUMED_HOST_GB_S: f64 = 20.0;

#[derive(Debug, thiserror::Error)]
pub enum ResidencyError {
    #[error("weight {role:?} {layer:?} is read by the CUDA schedule but absent from the archive")]
    MissingWeight { role: Role, layer: Option<u32> },
    /// Refused before anything is allocated: even the plan that needs least under `residency`
    /// (every layer streamed but those a ring would cost as much as; `all`: every weight resident)
    /// exceeds the budget. `min_gpu_mem` is the smallest `--gpu-mem` that runs in that mode.
    #[error("{}", does_not_fit(.plan, *.min_gpu_mem, *.residency))]
    DoesNotFit { plan: Box<ResidencyPlan>, min_gpu_mem: u64, residency: Residency },
}

fn does_not_fit(plan: &ResidencyPlan, min_gpu_mem: u64, residency: Residency) -> String {
    if residency == Residency::All {
        return format!(
            "--residency all: every weight must be on the device, {} at ctx {} (weights {}, KV cache {}, activations {}, cuBLAS workspace + module/graph {}); {}. The smallest that runs this way: --gpu-mem {}; --residency auto or stream runs from --gpu-mem {} by streaming layers from host memory",
            show(plan.all_resident_bytes),
            plan.ctx,
            show(plan.weight_bytes),
            show(plan.kv_bytes),
            show(plan.activation_bytes),
            show(plan.cublas_workspace_bytes + plan.module_and_graph_bytes),
            plan.budget.describe(residency),
            show_gpu_mem(min_gpu_mem),
            show_gpu_mem(plan.min_stream_bytes)
        );
    }
    if residency == Residency::Hybrid {
        return format!(
            "the model cannot run on this GPU even with every layer on the CPU: it needs at least {} on the device ({} always resident, KV cache of the layers on the device {}, activations {}, cuBLAS workspace + module/graph {}); {}. The smallest that runs: --gpu-mem {} (or a smaller --ctx)",
            show(plan.min_stream_bytes),
            show(plan.always_resident_bytes),
            show(plan.kv_bytes),
            show(plan.activation_bytes),
            show(plan.cublas_workspace_bytes + plan.module_and_graph_bytes),
            plan.budget.describe(residency),
            show_gpu_mem(min_gpu_mem)
        );
    }
    format!(
        "the model cannot run on this GPU even streaming: it needs at least {} on the device, {} ({} always resident, {}KV cache {} at ctx {}, activations {}, cuBLAS workspace + module/graph {}); {}. The smallest that runs: --gpu-mem {} (or a smaller --ctx)",
        show(plan.min_stream_bytes),
        if plan.streamed_layers.is_empty() {
            "every weight resident (streaming would take no less)".to_string()
        } else {
            format!("{} of {} layers streamed", plan.streamed_layers.len(), plan.layer_bytes.len())
        },
        show(plan.always_resident_bytes),
        if plan.ring_slots > 0 { format!("a ring of {} × {}, ", plan.ring_slots, show(plan.ring_slot_bytes)) } else { String::new() },
        show(plan.kv_bytes),
        plan.ctx,
        show(plan.activation_bytes),
        show(plan.cublas_workspace_bytes + plan.module_and_graph_bytes),
        plan.budget.describe(residency),
        show_gpu_mem(min_gpu_mem)
    )
}

/// One weight the CUDA schedule reads: its bytes on the device and the archive pages holding it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WeightSpan {
    pub role: Role,
    pub layer: Option<u32>,
    /// Bytes it takes on the device, aligned as the runtime lays weights out back to back.
    pub bytes: u64,
    /// Pages `first_page .. first_page + page_count` of the archive hold it.
    pub first_page: u32,
    pub page_count: u32,
}

impl WeightSpan {
    /// Stays resident in every plan: outside the layers (embedding, LM head, final norm) or a norm.
    pub fn always_resident(&self) -> bool {
        self.layer.is_none() || self.role.is_norm()
    }
}

/// What a model needs on the device at one context length, before any placement is chosen.
#[derive(Debug, Clone, PartialEq)]
pub struct Demand {
    pub ctx: usize,
    pub weights: Vec<WeightSpan>,
    pub kv_bytes: u64,
    /// Each layer's part of `kv_bytes` (K and V): what leaves the device with a layer kept on the host.
    pub kv_by_layer: BTreeMap<u32, u64>,
    /// The layout's arena less its KV cache: decode and prefill activations, RoPE tables.
    pub activation_bytes: u64,
    pub cublas_workspace_bytes: u64,
    pub module_and_graph_bytes: u64,
}

/// Bytes a tensor takes on the device ([`device_len`]: as the runtime lays it out), aligned to
/// [`ALIGN`] as the runtime packs them.
fn device_len_aligned(t: &TensorEntry) -> u64 {
    device_len(t.dtype, &t.shape, t.byte_len).div_ceil(ALIGN as u64) * ALIGN as u64
}

impl Demand {
    /// The weights `layout` says the schedule reads, from `m`, and the layout's buffers.
    pub fn of(m: &Manifest, layout: &Layout) -> Result<Demand, ResidencyError> {
        let weights = layout
            .types
            .keys()
            .map(|&(role, layer)| {
                let t = m.tensor(role, layer).ok_or(ResidencyError::MissingWeight { role, layer })?;
                Ok(WeightSpan { role, layer, bytes: device_len_aligned(t), first_page: t.first_page, page_count: t.page_count })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut kv_by_layer = BTreeMap::new();
        for (b, _, n) in layout.regions() {
            if let Some(l) = b.kv_layer() {
                *kv_by_layer.entry(l as u32).or_insert(0) += n as u64;
            }
        }
        let kv: u64 = kv_by_layer.values().sum();
        Ok(Demand {
            ctx: layout.ctx,
            weights,
            kv_bytes: kv,
            kv_by_layer,
            activation_bytes: layout.total_bytes as u64 - kv,
            cublas_workspace_bytes: CUBLAS_WORKSPACE_BYTES,
            module_and_graph_bytes: MODULE_AND_GRAPH_BYTES,
        })
    }

    /// Everything but the layers' matrices: always-resident weights, KV, activations, allowances.
    fn fixed_bytes(&self) -> u64 {
        let resident: u64 = self.weights.iter().filter(|w| w.always_resident()).map(|w| w.bytes).sum();
        resident + self.kv_bytes + self.activation_bytes + self.cublas_workspace_bytes + self.module_and_graph_bytes
    }

    /// Bytes of each layer's matrices (norms excluded), by layer index.
    fn layer_bytes(&self) -> BTreeMap<u32, u64> {
        let mut out = BTreeMap::new();
        for w in self.weights.iter().filter(|w| !w.always_resident()) {
            if let Some(l) = w.layer {
                *out.entry(l).or_insert(0) += w.bytes;
            }
        }
        out
    }
}

/// The device memory a plan may take.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct Budget {
    /// `--gpu-mem`: the most this engine may allocate (weights, arena, workspace, module, graph;
    /// not the CUDA context, which the driver holds before any of it — as HF's `max_memory`).
    pub gpu_mem: Option<u64>,
    /// Free device memory once the CUDA context exists, as the driver reports it.
    pub free: Option<u64>,
}

impl Budget {
    /// The smaller of the limit and the free memory; `None` when neither is known.
    pub fn bytes(&self) -> Option<u64> {
        match (self.gpu_mem, self.free) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// What a plan under `residency` may take: [`Budget::bytes`], except that `auto` without a
    /// `--gpu-mem` leaves [`AUTO_FREE_MARGIN`] of the free memory unused.
    pub fn bytes_for(&self, residency: Residency) -> Option<u64> {
        match (residency, self.gpu_mem, self.free) {
            (Residency::Auto, None, Some(f)) => Some(f.saturating_sub(AUTO_FREE_MARGIN)),
            _ => self.bytes(),
        }
    }

    /// `the budget is --gpu-mem 2.00 GiB (76.3 GiB free on the device)`, or that it is unknown.
    pub fn describe(&self, residency: Residency) -> String {
        match (self.gpu_mem, self.free) {
            (Some(l), Some(f)) => format!("the budget is --gpu-mem {} ({} free on the device)", show(l), show(f)),
            (Some(l), None) => format!("the budget is --gpu-mem {}", show(l)),
            (None, Some(f)) if residency == Residency::Auto => {
                format!("the budget is the {} free on the device less auto's margin of {}", show(f), show(AUTO_FREE_MARGIN))
            }
            (None, Some(f)) => format!("the budget is the {} free on the device", show(f)),
            (None, None) => "the device budget is unknown (no GPU answered and no --gpu-mem)".into(),
        }
    }
}

/// `--residency`: where the weights may live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Residency {
    /// Every weight on the device, or refused.
    All,
    /// The first layers that fit the budget resident, the rest streamed (none when all fit).
    Stream,
    /// `all` when every weight fits with [`AUTO_FREE_MARGIN`] to spare, else as `stream`.
    #[default]
    Auto,
    /// The first layers that fit resident; the rest split between the host link (streamed, as
    /// `stream`) and the CPU engine (computed in host memory, their KV cache there too), so the
    /// link and the CPU work on one token at the same time. llama.cpp's `-ngl`, with a ring beside it.
    Hybrid,
}

impl Residency {
    pub const ALL: [Residency; 4] = [Residency::All, Residency::Stream, Residency::Auto, Residency::Hybrid];

    pub fn name(self) -> &'static str {
        match self {
            Residency::All => "all",
            Residency::Stream => "stream",
            Residency::Auto => "auto",
            Residency::Hybrid => "hybrid",
        }
    }
}

impl std::str::FromStr for Residency {
    type Err = String;
    fn from_str(s: &str) -> Result<Residency, String> {
        Residency::ALL.into_iter().find(|r| r.name() == s).ok_or_else(|| format!("{s:?} is not a residency: all, stream, auto or hybrid"))
    }
}

/// Host-to-device bandwidth the tok/s bound is computed with.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Link {
    pub gb_s: f64,
    pub source: LinkSource,
}

/// Where a [`Link`] figure came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LinkSource {
    /// [`ASSUMED_LINK_GB_S`]: PCIe Gen5 x16, not measured.
    Assumed,
    /// Given by the user (`--link-gb-s`).
    Given,
    /// Measured on this machine.
    Measured,
}

impl LinkSource {
    fn label(self) -> &'static str {
        match self {
            LinkSource::Assumed => "assumed: PCIe Gen5 x16",
            LinkSource::Given => "given",
            LinkSource::Measured => "measured",
        }
    }
}

impl Default for Link {
    fn default() -> Self {
        Link { gb_s: ASSUMED_LINK_GB_S, source: LinkSource::Assumed }
    }
}

/// How fast the CPU engine computes a layer kept on the host, as bytes of that layer's weights a
/// second (a decode step reads each host layer's matrices once, as the GPU reads the others).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct HostRate {
    pub gb_s: f64,
    pub source: LinkSource,
}

/// The CPU engine's rate when none was measured: [`ASSUMED_HOST_GB_S`].
impl Default for HostRate {
    fn default() -> Self {
        HostRate { gb_s: ASSUMED_HOST_GB_S, source: LinkSource::Assumed }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    /// Every weight on the device.
    AllResident,
    /// The layers in `streamed_layers` cross the host link every token.
    Stream,
    /// Some layers stream, the layers in `host_layers` run on the CPU engine.
    Hybrid,
    /// No budget known: the plan shown is every weight resident, with the budgets that would run.
    BudgetUnknown,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    Resident,
    Streamed,
    /// Never on the device: the CPU engine computes the layer in host memory.
    Host,
}

/// One weight and where the plan keeps it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TensorPlacement {
    #[serde(flatten)]
    pub weight: WeightSpan,
    pub placement: Placement,
}

/// One matrix of a streamed layer: where it sits in its layer's ring slot (and at the same offset
/// in the layer's pinned host copy), and the archive pages it is read from once at load.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SlotTensor {
    pub role: Role,
    /// Offset in the slot (and from the layer's `host_offset`), aligned to [`ALIGN`].
    pub offset: u64,
    /// Its device bytes, aligned to [`ALIGN`] ([`WeightSpan::bytes`]).
    pub bytes: u64,
    pub first_page: u32,
    pub page_count: u32,
}

/// A streamed layer's matrices: one contiguous copy a token from pinned host memory into its slot.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StreamedLayer {
    pub layer: u32,
    /// The ring slot it is staged through: its index among the streamed layers modulo the slots
    /// (so the copy of the next layer for a slot waits for the last use of the one before).
    pub slot: usize,
    /// Where its copy starts in the pinned host buffer (the streamed layers back to back).
    pub host_offset: u64,
    /// Bytes of the copy: its matrices back to back.
    pub bytes: u64,
    pub tensors: Vec<SlotTensor>,
}

/// The streamed layers' places in a ring of `slots` buffers (fewer if fewer layers stream), in
/// the order given (the order the step uses them), with the largest layer's bytes per slot: each
/// layer's matrices back to back, each taking its [`WeightSpan::bytes`] (aligned to [`ALIGN`] by
/// whoever made the span, so every offset is). The one layout the planner counts and the runtime
/// allocates and copies by.
pub fn ring_layout(weights: &[WeightSpan], streamed: &[u32], slots: usize) -> (usize, u64, Vec<StreamedLayer>) {
    let slots = slots.min(streamed.len());
    let mut host = 0;
    let layers: Vec<StreamedLayer> = streamed
        .iter()
        .enumerate()
        .map(|(i, &layer)| {
            let mut offset = 0;
            let tensors = weights
                .iter()
                .filter(|w| w.layer == Some(layer) && !w.always_resident())
                .map(|w| {
                    let t = SlotTensor { role: w.role, offset, bytes: w.bytes, first_page: w.first_page, page_count: w.page_count };
                    offset += w.bytes;
                    t
                })
                .collect();
            let l = StreamedLayer { layer, slot: i % slots.max(1), host_offset: host, bytes: offset, tensors };
            host += offset;
            l
        })
        .collect();
    (slots, layers.iter().map(|l| l.bytes).max().unwrap_or(0), layers)
}

/// The decision and every number it was made from.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ResidencyPlan {
    pub decision: Decision,
    /// The `--residency` it was made under.
    pub residency: Residency,
    pub ctx: usize,
    pub budget: Budget,
    /// What the plan may take under `residency` ([`Budget::bytes_for`]); `None`: unknown.
    pub budget_bytes: Option<u64>,
    pub link: Link,
    /// Every weight the schedule reads, on the device.
    pub weight_bytes: u64,
    /// Weight bytes by role (all layers together).
    pub role_bytes: BTreeMap<&'static str, u64>,
    /// Each layer's matrices (norms excluded), by layer index.
    pub layer_bytes: Vec<u64>,
    /// Embedding, LM head and every norm: resident in every plan.
    pub always_resident_bytes: u64,
    pub kv_bytes: u64,
    pub activation_bytes: u64,
    pub cublas_workspace_bytes: u64,
    pub module_and_graph_bytes: u64,
    pub resident_layers: Vec<u32>,
    pub streamed_layers: Vec<u32>,
    /// Streaming buffers (0 when nothing streams) and the bytes of each.
    pub ring_slots: usize,
    pub ring_slot_bytes: u64,
    /// What this plan allocates on the device.
    pub device_bytes: u64,
    /// Bytes over the host link per decoded token: every streamed layer once.
    pub streamed_bytes_per_token: u64,
    /// Archive pages whose bytes cross the host link each token (a page of a streamed matrix).
    pub streamed_pages_per_token: u64,
    /// Page-locked host memory holding the streamed layers (copied once from the archive at load).
    pub pinned_host_bytes: u64,
    /// Every streamed layer in ring order: its slot, host offset and matrices with their pages.
    pub ring: Vec<StreamedLayer>,
    /// Layers the CPU engine computes (`--residency hybrid`): their matrices and KV cache stay in
    /// host memory.
    pub host_layers: Vec<u32>,
    /// Bytes of the host layers' matrices, read by the CPU once per token.
    pub host_bytes_per_token: u64,
    /// The host layers' KV cache at `ctx`, in host memory (f32, as the CPU engine keeps it).
    pub host_kv_bytes: u64,
    /// The CPU engine's rate the plan assumed; `None` unless the plan was made for `hybrid`.
    pub host_rate: Option<HostRate>,
    /// Tokens a second the plan allows: `link.gb_s / streamed_bytes_per_token`, or with host
    /// layers the slower of that and `host_rate / host_bytes_per_token` (the link and the CPU work
    /// at the same time); `None` when every layer is on the device.
    pub bound_tok_s: Option<f64>,
    /// The smallest budget that runs every weight resident.
    pub all_resident_bytes: u64,
    /// The smallest budget that runs at all (streaming as many layers as that takes).
    pub min_stream_bytes: u64,
    /// Every weight with its pages and placement, in the schedule's weight order.
    pub tensors: Vec<TensorPlacement>,
}

/// Decide the placement of `d`'s weights within `budget` under `residency`, the tok/s bound over
/// `link` (and, for `hybrid`, the CPU engine's [`HostRate::default`]). Below the smallest need of
/// that mode: [`ResidencyError::DoesNotFit`] with that plan.
pub fn plan(d: &Demand, budget: Budget, link: Link, residency: Residency) -> Result<ResidencyPlan, ResidencyError> {
    plan_with_host(d, budget, link, HostRate::default(), residency)
}

/// Where each non-resident layer goes: through the ring (`streamed`) or to the CPU (`host`).
#[derive(Debug, Clone, Default)]
struct Split {
    streamed: Vec<u32>,
    host: Vec<u32>,
}

/// [`plan`] with the CPU engine's rate `host` (used by `hybrid` only).
///
/// `hybrid` weighs, for every count of resident layers (the first ones), two ways to place the
/// rest: all of it on the CPU (no ring), or split layer by layer, in step order, to whichever of
/// the link and the CPU the step's time grows least on (each layer's bytes over its rate; the two
/// work at the same time, so a step takes the longer of the two). Each way's device memory counts
/// the ring only if something streams and drops the host layers' KV cache. The fastest plan that
/// fits is taken; among equals, the one with more layers resident.
pub fn plan_with_host(d: &Demand, budget: Budget, link: Link, host: HostRate, residency: Residency) -> Result<ResidencyPlan, ResidencyError> {
    let fixed = d.fixed_bytes();
    let layers = d.layer_bytes();
    let ids: Vec<u32> = layers.keys().copied().collect();
    let sizes: Vec<u64> = layers.values().copied().collect();
    let n = sizes.len();
    let total: u64 = sizes.iter().sum();
    let size_of = |l: u32| layers.get(&l).copied().unwrap_or(0);
    let kv_of = |ls: &[u32]| ls.iter().map(|l| d.kv_by_layer.get(l).copied().unwrap_or(0)).sum::<u64>();
    // Device bytes with the first `k` layers resident and the rest placed as `split` says.
    let need = |k: usize, split: &Split| -> (u64, u64) {
        let slot = split.streamed.iter().map(|&l| size_of(l)).max().unwrap_or(0);
        let slots = RING_SLOTS.min(split.streamed.len()) as u64;
        (fixed - kv_of(&split.host) + sizes[..k].iter().sum::<u64>() + slots * slot, slot)
    };
    let streamed_from = |k: usize| Split { streamed: ids[k..].to_vec(), host: Vec::new() };
    let link_s = |b: u64| b as f64 / (link.gb_s * 1e9);
    let host_s = |b: u64| b as f64 / (host.gb_s * 1e9);
    let step_s = |split: &Split| {
        let (s, h): (u64, u64) = (split.streamed.iter().map(|&l| size_of(l)).sum(), split.host.iter().map(|&l| size_of(l)).sum());
        link_s(s).max(host_s(h))
    };
    // The layers from `k` on, each to where the step's time grows least.
    let greedy = |k: usize| {
        let (mut split, mut on_link, mut on_host) = (Split::default(), 0.0f64, 0.0f64);
        for &l in &ids[k..] {
            let b = size_of(l);
            if (on_link + link_s(b)).max(on_host) <= on_link.max(on_host + host_s(b)) {
                on_link += link_s(b);
                split.streamed.push(l);
            } else {
                on_host += host_s(b);
                split.host.push(l);
            }
        }
        split
    };
    let all_resident = fixed + total;
    // The plan that needs least in this mode (among equals, the most resident layers): streaming,
    // every k with the rest through the ring (layers of one size and more than RING_SLOTS of them:
    // every layer streamed; with fewer, all resident); hybrid, every layer on the CPU.
    let (min_k, min_split) = if residency == Residency::Hybrid {
        (0, Split { streamed: Vec::new(), host: ids.clone() })
    } else {
        let k = (0..=n).rev().min_by_key(|&k| need(k, &streamed_from(k)).0).unwrap_or(0);
        (k, streamed_from(k))
    };
    let min_need = need(min_k, &min_split).0;
    let build = |decision, k: usize, split: Split| {
        let (device, slot) = need(k, &split);
        let Split { streamed, host: host_layers } = split;
        let streamed_bytes: u64 = streamed.iter().map(|&l| size_of(l)).sum();
        let host_bytes: u64 = host_layers.iter().map(|&l| size_of(l)).sum();
        let mut role_bytes = BTreeMap::new();
        for w in &d.weights {
            *role_bytes.entry(w.role.name()).or_insert(0) += w.bytes;
        }
        let tensors = d
            .weights
            .iter()
            .map(|w| {
                let layer_of = |set: &[u32]| !w.always_resident() && w.layer.is_some_and(|l| set.contains(&l));
                let placement = if layer_of(&streamed) {
                    Placement::Streamed
                } else if layer_of(&host_layers) {
                    Placement::Host
                } else {
                    Placement::Resident
                };
                TensorPlacement { weight: w.clone(), placement }
            })
            .collect();
        let (ring_slots, ring_slot_bytes, ring) = ring_layout(&d.weights, &streamed, RING_SLOTS);
        debug_assert_eq!((ring_slot_bytes, ring.iter().map(|l| l.bytes).sum::<u64>()), (slot, streamed_bytes));
        let host_kv = kv_of(&host_layers);
        let bound = match (streamed_bytes, host_bytes) {
            (0, 0) => None,
            (s, h) => Some(1.0 / link_s(s).max(host_s(h))),
        };
        ResidencyPlan {
            decision,
            residency,
            ctx: d.ctx,
            budget,
            budget_bytes: budget.bytes_for(residency),
            link,
            weight_bytes: d.weights.iter().map(|w| w.bytes).sum(),
            role_bytes,
            layer_bytes: sizes.clone(),
            always_resident_bytes: d.weights.iter().filter(|w| w.always_resident()).map(|w| w.bytes).sum(),
            kv_bytes: d.kv_bytes - host_kv,
            activation_bytes: d.activation_bytes,
            cublas_workspace_bytes: d.cublas_workspace_bytes,
            module_and_graph_bytes: d.module_and_graph_bytes,
            resident_layers: ids[..k].to_vec(),
            ring_slots,
            streamed_layers: streamed,
            ring_slot_bytes,
            device_bytes: device,
            streamed_bytes_per_token: streamed_bytes,
            streamed_pages_per_token: ring.iter().flat_map(|l| &l.tensors).map(|t| t.page_count as u64).sum(),
            pinned_host_bytes: streamed_bytes,
            ring,
            host_layers,
            host_bytes_per_token: host_bytes,
            // The CPU engine keeps K and V in f32: twice the device's bf16.
            host_kv_bytes: 2 * host_kv,
            host_rate: (residency == Residency::Hybrid).then_some(host),
            bound_tok_s: bound,
            all_resident_bytes: all_resident,
            min_stream_bytes: min_need,
            tensors,
        }
    };
    let decision_of = |split: &Split| match (split.streamed.is_empty(), split.host.is_empty()) {
        (true, true) => Decision::AllResident,
        (_, false) => Decision::Hybrid,
        (false, true) => Decision::Stream,
    };
    let Some(avail) = budget.bytes_for(residency) else {
        return Ok(build(Decision::BudgetUnknown, n, Split::default()));
    };
    if all_resident <= avail {
        return Ok(build(Decision::AllResident, n, Split::default()));
    }
    if residency == Residency::All {
        return Err(ResidencyError::DoesNotFit { plan: Box::new(build(Decision::AllResident, n, Split::default())), min_gpu_mem: all_resident, residency });
    }
    let chosen = if residency == Residency::Hybrid {
        // Every resident count, each with the rest on the CPU alone and split with the link.
        let mut best: Option<(f64, usize, Split)> = None;
        for k in (0..n).rev() {
            for split in [Split { streamed: Vec::new(), host: ids[k..].to_vec() }, greedy(k)] {
                if need(k, &split).0 > avail {
                    continue;
                }
                let t = step_s(&split);
                if best.as_ref().is_none_or(|(bt, _, _)| t < *bt) {
                    best = Some((t, k, split));
                }
            }
        }
        best.map(|(_, k, split)| (k, split))
    } else {
        // The most resident layers whose plan fits (every k is tried: layers of unequal size too).
        (0..n).rev().find(|&k| need(k, &streamed_from(k)).0 <= avail).map(|k| (k, streamed_from(k)))
    };
    match chosen {
        Some((k, split)) => Ok(build(decision_of(&split), k, split)),
        None => {
            let plan = build(decision_of(&min_split), min_k, min_split);
            Err(ResidencyError::DoesNotFit { plan: Box::new(plan), min_gpu_mem: min_need, residency })
        }
    }
}

impl ResidencyPlan {
    /// `plan: all resident, 6.16 GiB of 76.3 GiB free (weights 5.73 GiB, KV 288.0 MiB at ctx 4096, ...)`.
    pub fn one_line(&self) -> String {
        let what = match self.decision {
            Decision::AllResident => "all resident".to_string(),
            Decision::BudgetUnknown => "all resident (budget unknown)".to_string(),
            Decision::Stream => format!(
                "{} of {} layers resident, {} streamed through {} × {} ({} a token, at most {:.1} tok/s at {:.0} GB/s, {})",
                self.resident_layers.len(),
                self.layer_bytes.len(),
                self.streamed_layers.len(),
                self.ring_slots,
                show(self.ring_slot_bytes),
                show(self.streamed_bytes_per_token),
                self.bound_tok_s.unwrap_or(0.0),
                self.link.gb_s,
                self.link.source.label()
            ),
            Decision::Hybrid => format!(
                "{} of {} layers resident, {} streamed ({} a token at {:.0} GB/s, {}), {} on the CPU ({} a token at {:.0} GB/s, {}); at most {:.1} tok/s",
                self.resident_layers.len(),
                self.layer_bytes.len(),
                self.streamed_layers.len(),
                show(self.streamed_bytes_per_token),
                self.link.gb_s,
                self.link.source.label(),
                self.host_layers.len(),
                show(self.host_bytes_per_token),
                self.host_rate.map_or(0.0, |h| h.gb_s),
                self.host_rate.map_or("", |h| h.source.label()),
                self.bound_tok_s.unwrap_or(0.0)
            ),
        };
        let of = self.budget_bytes.map_or_else(String::new, |b| format!(" of {}", show(b)));
        format!(
            "plan: {what}; {}{of} on the device (weights {}, KV {} at ctx {}, activations {}, workspace+graph {})",
            show(self.device_bytes),
            show(self.weight_bytes),
            show(self.kv_bytes),
            self.ctx,
            show(self.activation_bytes),
            show(self.cublas_workspace_bytes + self.module_and_graph_bytes)
        )
    }

    /// The readable table of `thin plan`.
    pub fn table(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let row = |s: &mut String, what: &str, bytes: u64, note: &str| {
            let _ = writeln!(s, "  {what:<28} {:>12}  {note}", show(bytes));
        };
        let _ = writeln!(s, "weights by role");
        for (role, b) in &self.role_bytes {
            row(&mut s, role, *b, "");
        }
        let _ = writeln!(s, "weights by layer (matrices; norms stay resident)");
        let mut i = 0;
        while i < self.layer_bytes.len() {
            let placed = |j: usize| match j as u32 {
                l if self.host_layers.contains(&l) => "on the CPU",
                l if self.streamed_layers.contains(&l) => "streamed",
                _ => "resident",
            };
            let mut j = i;
            while j + 1 < self.layer_bytes.len() && self.layer_bytes[j + 1] == self.layer_bytes[i] && placed(j + 1) == placed(i) {
                j += 1;
            }
            let name = if i == j { format!("layer {i}") } else { format!("layers {i}-{j} ({} each)", show(self.layer_bytes[i])) };
            let where_ = placed(i);
            row(&mut s, &name, self.layer_bytes[i] * (j - i + 1) as u64, where_);
            i = j + 1;
        }
        let _ = writeln!(s, "device memory");
        row(&mut s, "weights, always resident", self.always_resident_bytes, "embedding, LM head, norms");
        let layers_resident: u64 = self.layer_bytes[..self.resident_layers.len().min(self.layer_bytes.len())].iter().sum();
        row(&mut s, &format!("layers resident ({})", self.resident_layers.len()), layers_resident, "");
        if self.ring_slots > 0 {
            row(&mut s, &format!("streaming ring ({} × {})", self.ring_slots, show(self.ring_slot_bytes)), self.ring_slots as u64 * self.ring_slot_bytes, "");
        }
        row(&mut s, &format!("KV cache (ctx {})", self.ctx), self.kv_bytes, "bf16");
        row(&mut s, "activations", self.activation_bytes, "decode, prefill rows, RoPE tables");
        row(&mut s, "cuBLAS workspace", self.cublas_workspace_bytes, "cuBLAS's default on Hopper");
        row(&mut s, "module + graph", self.module_and_graph_bytes, "allowance, calibrated on H100/H200");
        row(&mut s, "total", self.device_bytes, "");
        let _ = writeln!(s, "budget: {}", self.budget.describe(self.residency));
        let decision = match self.decision {
            Decision::AllResident => "all resident".to_string(),
            Decision::BudgetUnknown => "all resident shown; whether it fits is unknown".to_string(),
            Decision::Stream => format!(
                "stream {} of {} layers ({} pages of layers {}) through a ring of {}, from {} of pinned host memory",
                self.streamed_layers.len(),
                self.layer_bytes.len(),
                self.streamed_pages_per_token,
                ranges(&self.streamed_layers),
                self.ring_slots,
                show(self.pinned_host_bytes)
            ),
            Decision::Hybrid => format!(
                "{} of {} layers on the CPU (layers {}; their KV cache, {}, in host memory){}",
                self.host_layers.len(),
                self.layer_bytes.len(),
                ranges(&self.host_layers),
                show(self.host_kv_bytes),
                if self.streamed_layers.is_empty() {
                    String::new()
                } else {
                    format!(
                        "; stream {} ({} pages of layers {}) through a ring of {}, from {} of pinned host memory",
                        self.streamed_layers.len(),
                        self.streamed_pages_per_token,
                        ranges(&self.streamed_layers),
                        self.ring_slots,
                        show(self.pinned_host_bytes)
                    )
                }
            ),
        };
        let _ = writeln!(s, "decision: {decision}");
        if let (Some(h), Some(b)) = (self.host_rate, self.bound_tok_s) {
            if !self.host_layers.is_empty() {
                let link = if self.streamed_bytes_per_token == 0 {
                    String::new()
                } else {
                    format!("; streamed per token {} at {:.1} GB/s host link ({}), at the same time", show(self.streamed_bytes_per_token), self.link.gb_s, self.link.source.label())
                };
                let _ = writeln!(s, "on the CPU per token: {} at {:.1} GB/s ({}){link}; bound {b:.1} tok/s", show(self.host_bytes_per_token), h.gb_s, h.source.label());
            }
        }
        if let (Some(b), true) = (self.bound_tok_s, self.host_layers.is_empty()) {
            let _ = writeln!(
                s,
                "streamed per token: {}; bound {:.1} tok/s at {:.1} GB/s host link ({})",
                show(self.streamed_bytes_per_token),
                b,
                self.link.gb_s,
                self.link.source.label()
            );
        }
        let _ = writeln!(s, "smallest --gpu-mem, all resident: {}", show_gpu_mem(self.all_resident_bytes));
        let how = if self.residency == Residency::Hybrid { "every layer on the CPU" } else { "streaming" };
        let _ = writeln!(s, "smallest --gpu-mem that runs at all ({how}): {}", show_gpu_mem(self.min_stream_bytes));
        s
    }
}

/// `3-5, 9` from sorted layer indices.
fn ranges(ids: &[u32]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ids.len() {
        let mut j = i;
        while j + 1 < ids.len() && ids[j + 1] == ids[j] + 1 {
            j += 1;
        }
        out.push(if i == j { ids[i].to_string() } else { format!("{}-{}", ids[i], ids[j]) });
        i = j + 1;
    }
    out.join(", ")
}

/// Bytes for people: `6.16 GiB`, `149.0 MiB`, `72.0 KiB`, `200 B`.
pub fn show(bytes: u64) -> String {
    let b = bytes as f64;
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else if bytes >= 1 << 20 {
        format!("{:.1} MiB", b / (1u64 << 20) as f64)
    } else if bytes >= 1 << 10 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{bytes} B")
    }
}

/// A `--gpu-mem` value that covers `bytes`: whole MiB, rounded up (`1247MiB`).
pub fn show_gpu_mem(bytes: u64) -> String {
    format!("{}MiB", bytes.div_ceil(1 << 20))
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SizeError {
    #[error("{input:?} is not a size: give a number and a unit, e.g. 2GiB, 4G, 512MiB, 1.5GiB")]
    Malformed { input: String },
    #[error("{input:?}: unknown unit {unit:?} (B, K/KiB, M/MiB, G/GiB, T/TiB are binary; KB, MB, GB, TB decimal)")]
    Unit { input: String, unit: String },
    #[error("{input:?} is more bytes than this machine can count")]
    Overflow { input: String },
    #[error("{input:?} is zero bytes")]
    Zero { input: String },
}

/// A size like `2GiB`, `4G`, `512MiB`, `1.5GiB`, `8GB` or `1048576`: a decimal number and an
/// optional unit, case-insensitive. `K`/`M`/`G`/`T` and `KiB`..`TiB` are powers of 1024 (as
/// Docker's and the JVM's `4g`); `KB`..`TB` are powers of 1000. A fraction of a byte rounds down.
pub fn parse_size(input: &str) -> Result<u64, SizeError> {
    let s = input.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = (&s[..split], s[split..].trim());
    let malformed = || SizeError::Malformed { input: input.to_string() };
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if int.is_empty() && frac.is_empty() || frac.contains('.') || !int.bytes().chain(frac.bytes()).all(|b| b.is_ascii_digit()) {
        return Err(malformed());
    }
    let scale: u128 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(SizeError::Unit { input: input.to_string(), unit: unit.to_string() }),
    };
    let overflow = || SizeError::Overflow { input: input.to_string() };
    // Whole part and fraction in integers: 1.5GiB is exactly 1610612736.
    let int_v: u128 = if int.is_empty() { 0 } else { int.parse().map_err(|_| overflow())? };
    let frac = &frac[..frac.len().min(18)];
    let frac_v: u128 = if frac.is_empty() { 0 } else { frac.parse().map_err(|_| overflow())? };
    let denom = 10u128.pow(frac.len() as u32);
    let bytes = int_v.checked_mul(scale).and_then(|b| b.checked_add(frac_v.checked_mul(scale)? / denom)).ok_or_else(overflow)?;
    let bytes = u64::try_from(bytes).map_err(|_| overflow())?;
    if bytes == 0 {
        return Err(SizeError::Zero { input: input.to_string() });
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The weights of a SmolLM3-3B-shaped bf16 archive (tied embeddings, no LM head tensor),
    /// built from its dims (archs/smollm3-3b.toml), each on pages of 64 MiB numbered in order.
    fn smollm3_3b(ctx: usize) -> Demand {
        let (vocab, hidden, layers, q, kv, ffn) = (128256u64, 2048u64, 36u32, 16 * 128u64, 4 * 128u64, 11008u64);
        let mut weights = Vec::new();
        let mut page = 0u32;
        let mut add = |role, layer, bytes: u64| {
            let pages = bytes.div_ceil(64 << 20) as u32;
            weights.push(WeightSpan { role, layer, bytes, first_page: page, page_count: pages });
            page += pages;
        };
        add(Role::TokenEmbd, None, vocab * hidden * 2);
        for l in 0..layers {
            add(Role::AttnNorm, Some(l), hidden * 4);
            add(Role::AttnQ, Some(l), q * hidden * 2);
            add(Role::AttnK, Some(l), kv * hidden * 2);
            add(Role::AttnV, Some(l), kv * hidden * 2);
            add(Role::AttnO, Some(l), hidden * q * 2);
            add(Role::FfnNorm, Some(l), hidden * 4);
            add(Role::FfnGate, Some(l), ffn * hidden * 2);
            add(Role::FfnUp, Some(l), ffn * hidden * 2);
            add(Role::FfnDown, Some(l), hidden * ffn * 2);
        }
        add(Role::OutputNorm, None, hidden * 4);
        Demand {
            ctx,
            weights,
            // bf16 K and V of 4 heads × 128 for each of 36 layers.
            kv_bytes: 36 * 2 * ctx as u64 * kv * 2,
            kv_by_layer: (0..36).map(|l| (l, 2 * ctx as u64 * kv * 2)).collect(),
            // The arena the H100 reported at ctx 4096 less its KV cache (run29's `load`:
            // arena_bytes 384749056, kv_bytes 301989888).
            activation_bytes: 384_749_056 - 301_989_888,
            cublas_workspace_bytes: CUBLAS_WORKSPACE_BYTES,
            module_and_graph_bytes: MODULE_AND_GRAPH_BYTES,
        }
    }

    const GIB: u64 = 1 << 30;

    // By hand, SmolLM3-3B bf16 at ctx 4096:
    //   a layer's matrices: q, o 2048·2048·2 = 8388608 each; k, v 512·2048·2 = 2097152 each;
    //   gate, up, down 11008·2048·2 = 45088768 each: 156237824 bytes (149.0 MiB).
    //   always resident: embedding 128256·2048·2 = 525336576, norms 73·2048·4 = 598016.
    //   KV 36·2·4096·512·2 = 301989888; activations 82759168; workspace 32 MiB, module+graph 48 MiB.
    //   fixed = 525934592 + 301989888 + 82759168 + 83886080 = 994569728.
    //   all resident: 994569728 + 36·156237824 = 6619131392 (6.16 GiB; the H100 measured a peak of
    //   6.156 GiB = 6610223104, 8.5 MiB under it).
    //   smallest streaming: fixed + ring 2·156237824 = 1307045376, i.e. --gpu-mem 1247MiB.
    //   2 GiB: (2147483648 - 1307045376) / 156237824 = 5.38: 5 resident, 31 streamed,
    //          31·156237824 = 4843372544 bytes a token, 50e9 / that = 10.32 tok/s.
    //   4 GiB: (4294967296 - 1307045376) / 156237824 = 19.12: 19 resident, 17 streamed,
    //          17·156237824 = 2656043008 bytes a token, 18.82 tok/s.
    const LAYER: u64 = 156_237_824;

    #[test]
    fn smollm3_3b_streams_at_2_and_4_gib() {
        let d = smollm3_3b(4096);
        for (gib, resident, per_token, tok_s) in [(2, 5usize, 4_843_372_544u64, 10.3234), (4, 19, 2_656_043_008, 18.8250)] {
            let p = plan(&d, Budget { gpu_mem: Some(gib * GIB), free: Some(80 * GIB) }, Link::default(), Residency::Stream).unwrap();
            assert_eq!(p.decision, Decision::Stream, "{gib} GiB");
            assert_eq!(p.resident_layers, (0..resident as u32).collect::<Vec<_>>());
            assert_eq!(p.streamed_layers, (resident as u32..36).collect::<Vec<_>>());
            assert_eq!((p.ring_slots, p.ring_slot_bytes), (2, LAYER));
            assert_eq!(p.streamed_bytes_per_token, per_token);
            assert!((p.bound_tok_s.unwrap() - tok_s).abs() < 1e-3, "{:?}", p.bound_tok_s);
            assert_eq!(p.device_bytes, 994_569_728 + (resident as u64 + 2) * LAYER);
            assert!(p.device_bytes <= gib * GIB && p.device_bytes + LAYER > gib * GIB, "one more layer would not fit");
            assert_eq!((p.all_resident_bytes, p.min_stream_bytes), (6_619_131_392, 1_307_045_376));
            // Per tensor: a streamed layer's matrices stream with their pages, its norms stay.
            let of = |role, l| p.tensors.iter().find(|t| t.weight.role == role && t.weight.layer == Some(l)).unwrap();
            assert_eq!(of(Role::FfnDown, 35).placement, Placement::Streamed);
            assert_eq!(of(Role::FfnDown, 35).weight.page_count, 1);
            assert_eq!(of(Role::AttnNorm, 35).placement, Placement::Resident);
            assert_eq!(of(Role::AttnQ, 0).placement, Placement::Resident);
            let streamed: u64 = p.tensors.iter().filter(|t| t.placement == Placement::Streamed).map(|t| t.weight.bytes).sum();
            assert_eq!(streamed, per_token);
        }
        assert_eq!(show_gpu_mem(1_307_045_376), "1247MiB");
    }

    #[test]
    fn smollm3_3b_all_resident_and_budget_unknown() {
        let d = smollm3_3b(4096);
        let p = plan(&d, Budget { gpu_mem: None, free: Some(6_619_131_392) }, Link::default(), Residency::Stream).unwrap();
        assert_eq!((p.decision, p.streamed_layers.len(), p.ring_slots, p.bound_tok_s), (Decision::AllResident, 0, 0, None));
        assert_eq!(p.weight_bytes, 6_150_496_256, "the weight_bytes the H100 run reported for SmolLM3-3B bf16");
        assert_eq!(p.device_bytes, 6_619_131_392);
        // One byte less: streaming, 33 layers resident and a ring of two (994569728 + 35·156237824
        // = 6462893568 fits; 36 layers' worth does not).
        let p = plan(&d, Budget { gpu_mem: None, free: Some(6_619_131_391) }, Link::default(), Residency::Stream).unwrap();
        assert_eq!((p.decision, p.resident_layers.len(), &p.streamed_layers[..]), (Decision::Stream, 33, &[33, 34, 35][..]));
        assert!(p.table().contains("smallest --gpu-mem, all resident: 6313MiB"), "{}", p.table());
        let p = plan(&d, Budget::default(), Link::default(), Residency::Stream).unwrap();
        assert_eq!((p.decision, p.device_bytes, p.min_stream_bytes), (Decision::BudgetUnknown, 6_619_131_392, 1_307_045_376));
        assert!(p.table().contains("budget is unknown") && p.table().contains("1247MiB"), "{}", p.table());
    }

    #[test]
    fn below_the_smallest_streaming_plan_is_refused_with_it() {
        let d = smollm3_3b(4096);
        let e = plan(&d, Budget { gpu_mem: Some(1_307_045_375), free: None }, Link::default(), Residency::Stream).unwrap_err();
        let ResidencyError::DoesNotFit { plan: p, min_gpu_mem, residency: Residency::Stream } = &e else { panic!("{e}") };
        assert_eq!(*min_gpu_mem, 1_307_045_376);
        assert_eq!((p.resident_layers.len(), p.streamed_layers.len(), p.device_bytes), (0, 36, 1_307_045_376));
        assert!(e.to_string().contains("--gpu-mem 1247MiB"), "{e}");
        // Exactly enough: every layer streamed.
        let p = plan(&d, Budget { gpu_mem: Some(1_307_045_376), free: None }, Link::default(), Residency::Stream).unwrap();
        assert_eq!((p.resident_layers.len(), p.streamed_bytes_per_token), (0, 36 * LAYER));
        // A longer context takes KV from the layers: ctx 65536 adds 15·301989888 = 4529848320.
        let p = plan(&smollm3_3b(65536), Budget { gpu_mem: Some(4 * GIB), free: None }, Link::default(), Residency::Stream);
        assert!(matches!(p, Err(ResidencyError::DoesNotFit { min_gpu_mem: 5_836_893_696, .. })), "{p:?}");
    }

    #[test]
    fn a_given_link_sets_the_bound() {
        let p = plan(&smollm3_3b(4096), Budget { gpu_mem: Some(4 * GIB), free: None }, Link { gb_s: 25.0, source: LinkSource::Given }, Residency::Stream).unwrap();
        assert!((p.bound_tok_s.unwrap() - 25e9 / 2_656_043_008.0).abs() < 1e-9);
        assert!(p.one_line().contains("19 of 36 layers resident, 17 streamed"), "{}", p.one_line());
        assert!(p.one_line().contains("25 GB/s, given"), "{}", p.one_line());
    }

    #[test]
    fn unequal_layers_ring_sized_by_the_largest_streamed() {
        // Layer 2 is twice the others: with 2 resident the ring holds two of it.
        let w = |l, bytes| WeightSpan { role: Role::FfnDown, layer: Some(l), bytes, first_page: l, page_count: 1 };
        let d = Demand { ctx: 1, weights: vec![w(0, 100), w(1, 100), w(2, 200), w(3, 100)], kv_bytes: 0, kv_by_layer: BTreeMap::new(), activation_bytes: 0, cublas_workspace_bytes: 0, module_and_graph_bytes: 0 };
        // need(k): k=0: 400, 1: 100+400=500, 2: 200+400=600, 3: 400+200=600, 4: 500.
        let p = plan(&d, Budget { gpu_mem: Some(450), free: None }, Link::default(), Residency::Stream).unwrap();
        assert_eq!((p.resident_layers.len(), p.ring_slot_bytes, p.device_bytes), (0, 200, 400));
        assert_eq!(plan(&d, Budget { gpu_mem: Some(500), free: None }, Link::default(), Residency::Stream).unwrap().decision, Decision::AllResident);
        assert!(matches!(plan(&d, Budget { gpu_mem: Some(399), free: None }, Link::default(), Residency::Stream), Err(ResidencyError::DoesNotFit { min_gpu_mem: 400, .. })));
    }

    #[test]
    fn two_layers_never_stream() {
        // A ring of two layers takes what both layers resident take: the smallest plan keeps
        // them resident, and below it the refusal carries that plan.
        let w = |l| WeightSpan { role: Role::AttnQ, layer: Some(l), bytes: 100, first_page: l, page_count: 1 };
        let d = Demand { ctx: 1, weights: vec![w(0), w(1)], kv_bytes: 10, kv_by_layer: BTreeMap::from([(0, 5), (1, 5)]), activation_bytes: 0, cublas_workspace_bytes: 0, module_and_graph_bytes: 0 };
        let e = plan(&d, Budget { gpu_mem: Some(209), free: None }, Link::default(), Residency::Stream).unwrap_err();
        let ResidencyError::DoesNotFit { plan: p, min_gpu_mem: 210, .. } = &e else { panic!("{e}") };
        assert_eq!((p.decision, p.streamed_layers.len(), p.ring_slots), (Decision::AllResident, 0, 0));
        assert!(e.to_string().contains("every weight resident (streaming would take no less)"), "{e}");
    }

    #[test]
    fn the_ring_places_every_streamed_matrix_with_its_pages() {
        let d = smollm3_3b(4096);
        let p = plan(&d, Budget { gpu_mem: Some(2 * GIB), free: None }, Link::default(), Residency::Stream).unwrap();
        assert_eq!(p.ring.len(), 31);
        // Ring order is use order (layers ascending); slots alternate; host copies back to back.
        let mut host = 0;
        for (i, l) in p.ring.iter().enumerate() {
            assert_eq!((l.layer, l.slot, l.host_offset, l.bytes), (5 + i as u32, i % 2, host, LAYER));
            host += l.bytes;
            let roles: Vec<Role> = l.tensors.iter().map(|t| t.role).collect();
            assert_eq!(roles, [Role::AttnQ, Role::AttnK, Role::AttnV, Role::AttnO, Role::FfnGate, Role::FfnUp, Role::FfnDown], "norms stay resident");
            let mut off = 0;
            for t in &l.tensors {
                assert_eq!((t.offset, t.offset % ALIGN as u64), (off, 0));
                off += t.bytes;
                // The archive pages of the tensor, as the demand listed them.
                let w = d.weights.iter().find(|w| w.role == t.role && w.layer == Some(l.layer)).unwrap();
                assert_eq!((t.first_page, t.page_count, t.bytes), (w.first_page, w.page_count, w.bytes));
            }
            assert_eq!(off, l.bytes);
        }
        assert_eq!((p.pinned_host_bytes, host), (p.streamed_bytes_per_token, p.streamed_bytes_per_token));
        // Every matrix here is under one 64 MiB page: 7 pages a streamed layer.
        assert_eq!(p.streamed_pages_per_token, 31 * 7);
        assert!(p.table().contains("217 pages of layers 5-35"), "{}", p.table());
        // Nothing streams: no ring, no pinned memory.
        let p = plan(&d, Budget { gpu_mem: Some(8 * GIB), free: None }, Link::default(), Residency::Stream).unwrap();
        assert_eq!((p.ring.len(), p.pinned_host_bytes, p.streamed_pages_per_token, p.ring_slots), (0, 0, 0, 0));
    }

    #[test]
    fn ring_layout_with_fewer_layers_than_slots_and_unequal_layers() {
        let w = |l, role, bytes, page| WeightSpan { role, layer: Some(l), bytes, first_page: page, page_count: 2 };
        let weights = [w(0, Role::AttnQ, 256, 0), w(0, Role::AttnNorm, 256, 2), w(1, Role::AttnQ, 512, 3), w(1, Role::FfnDown, 256, 5), w(2, Role::AttnQ, 256, 7)];
        let (slots, slot, ring) = ring_layout(&weights, &[1], RING_SLOTS);
        assert_eq!((slots, slot, ring.len(), ring[0].slot, ring[0].bytes), (1, 768, 1, 0, 768));
        assert_eq!(ring[0].tensors[1].offset, 512);
        let (slots, slot, ring) = ring_layout(&weights, &[0, 1, 2], RING_SLOTS);
        assert_eq!((slots, slot), (2, 768), "the largest streamed layer sizes every slot");
        assert_eq!(ring.iter().map(|l| (l.slot, l.host_offset, l.bytes)).collect::<Vec<_>>(), [(0, 0, 256), (1, 256, 768), (0, 1024, 256)]);
        assert_eq!(ring_layout(&weights, &[], RING_SLOTS), (0, 0, vec![]));
    }

    #[test]
    fn residency_modes() {
        let d = smollm3_3b(4096);
        let (all, min) = (6_619_131_392u64, 1_307_045_376u64);
        let at = |gpu_mem, free, r| plan(&d, Budget { gpu_mem, free }, Link::default(), r);
        // all: every weight or refused, naming the all-resident limit and the streaming one.
        assert_eq!(at(Some(all), None, Residency::All).unwrap().decision, Decision::AllResident);
        let e = at(Some(4 * GIB), Some(80 * GIB), Residency::All).unwrap_err();
        let ResidencyError::DoesNotFit { plan: p, min_gpu_mem, residency: Residency::All } = &e else { panic!("{e}") };
        assert_eq!((*min_gpu_mem, p.decision, p.device_bytes), (all, Decision::AllResident, all));
        let msg = e.to_string();
        assert!(msg.contains("--gpu-mem 6313MiB") && msg.contains("from --gpu-mem 1247MiB"), "{msg}");
        // stream and auto honour a given --gpu-mem exactly.
        for r in [Residency::Stream, Residency::Auto] {
            let p = at(Some(4 * GIB), Some(80 * GIB), r).unwrap();
            assert_eq!((p.decision, p.resident_layers.len(), p.residency, p.budget_bytes), (Decision::Stream, 19, r, Some(4 * GIB)));
            assert_eq!(at(Some(all), Some(80 * GIB), r).unwrap().decision, Decision::AllResident);
            let e = at(Some(min - 1), Some(80 * GIB), r).unwrap_err();
            assert!(matches!(e, ResidencyError::DoesNotFit { min_gpu_mem, residency, .. } if min_gpu_mem == min && residency == r));
        }
        // Free memory alone: stream takes all of it, auto leaves its margin.
        let p = at(None, Some(all), Residency::Stream).unwrap();
        assert_eq!(p.decision, Decision::AllResident);
        let p = at(None, Some(all), Residency::Auto).unwrap();
        assert_eq!((p.decision, p.budget_bytes), (Decision::Stream, Some(all - AUTO_FREE_MARGIN)));
        // (6619131392 - 2^30 - 994569728) / 156237824 = 29.1 layers' worth: 27 resident and the ring's two.
        assert_eq!(p.resident_layers.len(), 27);
        assert!(p.one_line().contains("27 of 36 layers resident"), "{}", p.one_line());
        assert!(p.budget.describe(Residency::Auto).contains("less auto's margin of 1.00 GiB"));
        assert_eq!(at(None, Some(all + AUTO_FREE_MARGIN), Residency::Auto).unwrap().decision, Decision::AllResident);
        // A device with less free than the margin: nothing left, refused with the plan.
        assert!(matches!(at(None, Some(GIB / 2), Residency::Auto), Err(ResidencyError::DoesNotFit { min_gpu_mem, .. }) if min_gpu_mem == min));
        for r in Residency::ALL {
            assert_eq!(r.name().parse::<Residency>(), Ok(r));
        }
        for bad in ["", "ALL", "resident", "auto ", "none"] {
            assert!(bad.parse::<Residency>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn hybrid_splits_the_rest_between_link_and_cpu() {
        // Run 35's rates on the H100's host: the link 55.5 GB/s, the CPU engine taken as 77.
        let d = smollm3_3b(4096);
        let link = Link { gb_s: 55.5, source: LinkSource::Measured };
        let cpu = HostRate { gb_s: 77.0, source: LinkSource::Given };
        let p = plan_with_host(&d, Budget { gpu_mem: Some(2 * GIB), free: None }, link, cpu, Residency::Hybrid).unwrap();
        assert_eq!(p.decision, Decision::Hybrid);
        // By hand: a layer takes 156237824 / 55.5e9 = 2.815 ms over the link, / 77e9 = 2.029 ms on
        // the CPU; a host layer frees its 8 MiB of KV (2·4096·512·2 = 8388608).
        // 6 resident + a ring of 2: fixed 994569728 + 8·156237824 = 2244472320 > 2 GiB less the
        // host KV (18·8388608 = 150994944): 2093477376 fits, with 54 MB to spare; 7 resident
        // would need 156 MB more. The other 30 split greedily: 12 streamed (33.78 ms), 18 on the
        // CPU (36.52 ms): the bound is 1 / 36.52 ms = 27.38 tok/s.
        assert_eq!(p.resident_layers, (0..6).collect::<Vec<_>>());
        assert_eq!((p.streamed_layers.len(), p.host_layers.len()), (12, 18));
        assert_eq!(p.device_bytes, 994_569_728 + 8 * LAYER - 18 * 8_388_608);
        assert!(p.device_bytes <= 2 * GIB);
        assert_eq!((p.streamed_bytes_per_token, p.host_bytes_per_token), (12 * LAYER, 18 * LAYER));
        assert_eq!((p.kv_bytes, p.host_kv_bytes), (18 * 8_388_608, 2 * 18 * 8_388_608));
        let bound = 1.0 / (18.0 * LAYER as f64 / 77e9);
        assert!((p.bound_tok_s.unwrap() - bound).abs() < 1e-9 && (bound - 27.38).abs() < 0.01, "{:?}", p.bound_tok_s);
        // Interleaved in step order, so the link always has the next streamed layer to carry while
        // the CPU computes: never more than two host layers in a row here.
        let mut placed: Vec<char> = (6..36).map(|l| if p.host_layers.contains(&l) { 'h' } else { 's' }).collect();
        placed.dedup_by(|a, b| a == b && *a == 's');
        assert!(!placed.iter().collect::<String>().contains("hhh"), "{placed:?}");
        // Per tensor: a host layer's matrices are on the host, its norms stay on the device.
        let of = |role, l| p.tensors.iter().find(|t| t.weight.role == role && t.weight.layer == Some(l)).unwrap().placement;
        let h = p.host_layers[0];
        assert_eq!((of(Role::FfnDown, h), of(Role::AttnNorm, h)), (Placement::Host, Placement::Resident));
        assert!(p.one_line().contains("18 on the CPU") && p.table().contains("on the CPU"), "{}\n{}", p.one_line(), p.table());
        // The same budget streaming alone: 5 resident, 31 streamed, 1 / (31 · 2.815 ms) = 11.46 tok/s.
        let s = plan_with_host(&d, Budget { gpu_mem: Some(2 * GIB), free: None }, link, cpu, Residency::Stream).unwrap();
        assert_eq!((s.decision, s.resident_layers.len(), s.host_layers.len(), s.host_rate), (Decision::Stream, 5, 0, None));
        assert!(p.bound_tok_s.unwrap() > 2.3 * s.bound_tok_s.unwrap());
        // A CPU slower than the link: fewer layers go to it.
        let slow = plan_with_host(&d, Budget { gpu_mem: Some(2 * GIB), free: None }, link, HostRate { gb_s: 10.0, source: LinkSource::Given }, Residency::Hybrid).unwrap();
        assert!(slow.host_layers.len() < slow.streamed_layers.len(), "{} on the CPU, {} streamed", slow.host_layers.len(), slow.streamed_layers.len());
        // Everything fits: all resident, nothing on the host.
        let all = plan_with_host(&d, Budget { gpu_mem: Some(8 * GIB), free: None }, link, cpu, Residency::Hybrid).unwrap();
        assert_eq!((all.decision, all.host_layers.len(), all.bound_tok_s), (Decision::AllResident, 0, None));
        // The least hybrid needs: every layer on the CPU, no ring, no KV on the device.
        let least = 994_569_728 - 36 * 8_388_608;
        let e = plan_with_host(&d, Budget { gpu_mem: Some(least - 1), free: None }, link, cpu, Residency::Hybrid).unwrap_err();
        let ResidencyError::DoesNotFit { plan: q, min_gpu_mem, residency: Residency::Hybrid } = &e else { panic!("{e}") };
        assert_eq!((*min_gpu_mem, q.host_layers.len(), q.ring_slots, q.kv_bytes), (least, 36, 0, 0));
        assert!(e.to_string().contains("every layer on the CPU"), "{e}");
        let p = plan_with_host(&d, Budget { gpu_mem: Some(least), free: None }, link, cpu, Residency::Hybrid).unwrap();
        assert_eq!((p.host_layers.len(), p.device_bytes), (36, least));
    }

    #[test]
    fn budget_is_the_smaller_of_limit_and_free() {
        assert_eq!(Budget { gpu_mem: Some(5), free: Some(3) }.bytes(), Some(3));
        assert_eq!(Budget { gpu_mem: Some(2), free: Some(3) }.bytes(), Some(2));
        assert_eq!(Budget { gpu_mem: None, free: Some(3) }.bytes(), Some(3));
        assert_eq!(Budget::default().bytes(), None);
    }

    #[test]
    fn sizes_parse_with_binary_and_decimal_units() {
        for (s, v) in [
            ("2GiB", 2 << 30),
            ("4G", 4 << 30),
            ("4g", 4 << 30),
            ("512MiB", 512 << 20),
            ("1.5GiB", 1_610_612_736),
            ("8GB", 8_000_000_000),
            ("1048576", 1 << 20),
            (" 1247MiB ", 1247 << 20),
            ("1.5 K", 1536),
            (".5k", 512),
            ("1T", 1 << 40),
            ("0.001KiB", 1),
        ] {
            assert_eq!(parse_size(s), Ok(v), "{s}");
        }
        for s in ["", " ", "GiB", "-1G", "-0", "-3", "1.2.3G", ".", "NaN", "inf", "+4G", "4 G B", "0x10G"] {
            assert!(parse_size(s).is_err(), "{s}");
        }
        assert!(matches!(parse_size("4Q"), Err(SizeError::Unit { unit, .. }) if unit == "Q"));
        assert!(matches!(parse_size("1e9"), Err(SizeError::Unit { .. })));
        assert!(matches!(parse_size("1e400GiB"), Err(SizeError::Unit { unit, .. }) if unit == "e400GiB"), "no exponents: never an f64 infinity");
        assert!(matches!(parse_size("4XB"), Err(SizeError::Unit { .. })));
        assert!(matches!(parse_size("4GiBs"), Err(SizeError::Unit { .. })));
        assert!(matches!(parse_size("17179869184G"), Err(SizeError::Overflow { .. })), "2^64 bytes");
        assert!(matches!(parse_size("99999999999999999999999999999999999999999"), Err(SizeError::Overflow { .. })));
        assert!(matches!(parse_size("18446744073709551616"), Err(SizeError::Overflow { .. })));
        assert_eq!(parse_size("18446744073709551615"), Ok(u64::MAX));
        assert!(matches!(parse_size("0GiB"), Err(SizeError::Zero { .. })));
        assert!(matches!(parse_size("0.1B"), Err(SizeError::Zero { .. })), "rounds down to nothing");
    }

    #[test]
    fn layer_ranges_read_compactly() {
        assert_eq!(ranges(&[3, 4, 5, 9, 11, 12]), "3-5, 9, 11-12");
        assert_eq!(ranges(&[]), "");
    }
}
