//! The CUDA schedule thin-codegen derives from each plan: every feature a description can state is
//! either run by both backends or refused by the GPU with a typed error naming it (never skipped);
//! the schedule of each generated engine against a real converted archive (every weight it reads
//! exists with the shape the kernels assume, per-layer RoPE and windows as the converter recorded
//! them from the HF config); and the launch-order invariants the kernels rely on. Host-side only.

use std::path::{Path, PathBuf};

use thin_codegen::{cuda_schedule, lower, parse, validate, Unsupported};
use thin_core::arch::LayerAttention;
use thin_core::convert::{convert, ConvertOptions};
use thin_core::cuda::plan::{Arg, Buf, CudaArch, Grid, Launch, PlanError, RopeTable, Schedule, Step};
use thin_core::format::Archive;
use thin_core::quant::Profile;
use thin_core::role::Role;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The schedule of a description given as text (after `edit`), or the GPU's refusal.
fn schedule_of(file: &str, edit: impl Fn(String) -> String) -> Result<Schedule, Unsupported> {
    let text = edit(std::fs::read_to_string(root().join(file)).unwrap());
    let d = parse(file, &text).unwrap();
    validate(file, &d).unwrap();
    cuda_schedule(&d, &lower(&d))
}

fn kernels(s: &Schedule) -> Vec<&'static str> {
    s.decode.iter().map(|l| l.kernel).collect()
}

#[test]
fn pre_norm_layers_are_five_kernels_and_sandwich_layers_seven() {
    let llama = schedule_of("archs/tiny/llama-tiny.toml", |t| t).unwrap();
    let layer = ["norm_qkv", "attn_decode", "o_residual", "norm_gateup", "down_residual"];
    let want: Vec<&str> = std::iter::once("embed").chain(layer.iter().copied().cycle().take(2 * 5)).chain(["norm_lm_head", "argmax_step"]).collect();
    assert_eq!(kernels(&llama), want);
    assert_eq!(llama.epilogue, llama.decode[llama.decode.len() - 2..], "prefill ends with the decode step's tail");
    let gemma = schedule_of("archs/tiny/gemma3-tiny.toml", |t| t).unwrap();
    let layer = ["norm_qkv", "attn_decode", "o_proj", "norm_residual", "norm_gateup", "down_proj", "norm_residual"];
    assert_eq!(kernels(&gemma)[1..8], layer);
    assert_eq!(gemma.decode.len(), 1 + 6 * 7 + 2);
    let post: Vec<Arg> = gemma.decode.iter().filter(|l| l.kernel == "norm_residual").take(2).map(|l| l.args[1]).collect();
    assert_eq!(post, [Arg::Weight(Role::AttnPostNorm, Some(0)), Arg::Weight(Role::FfnPostNorm, Some(0))]);
}

/// A feature one backend honours and the other skips is impossible: every plan op is taken by a
/// kernel or the schedule is refused naming it, while the CPU engine runs the same plan.
#[test]
fn a_feature_the_kernels_lack_is_refused_by_name() {
    let cases: [(&str, fn(String) -> String, &str); 3] = [
        ("archs/tiny/gemma3-tiny.toml", |t| t.replace("[rope]", "softcap = 50.0\n\n[rope]"), "attention logit softcapping (50)"),
        ("archs/tiny/gemma3-tiny.toml", |t| format!("final_logit_softcap = 30.0\n{t}"), "final logit softcapping (30)"),
        ("archs/tiny/olmoe-tiny.toml", with_sandwich_norms, "mixture-of-experts layers with a post-feedforward norm"),
    ];
    for (file, edit, what) in cases {
        let text = edit(std::fs::read_to_string(root().join(file)).unwrap());
        // The CPU engine takes the description: it generates, and its plan has the op.
        let (_, plan, src) = thin_codegen::generate_one(file, &text).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert!(!plan.layers.is_empty() && src.contains("pub fn arch() -> Result<CudaArch, PlanError>"));
        let d = parse(file, &text).unwrap();
        assert_eq!(cuda_schedule(&d, &plan), Err(Unsupported(what.into())), "{file}");
        // The generated module refuses with the same words.
        assert!(src.contains(what), "{file}: the generated cuda::arch() does not name {what:?}");
    }
}

/// The description text of a dense Llama-family arch with OLMoE's whole-projection QK-norm.
pub fn with_whole_qk_norm(t: String) -> String {
    t.replace("qk_norm = \"none\"", "qk_norm = \"whole\"")
        + "attn_q_norm = { hf = \"model.layers.{l}.self_attn.q_norm.weight\", gguf = \"blk.{l}.attn_q_norm.weight\" }\n\
           attn_k_norm = { hf = \"model.layers.{l}.self_attn.k_norm.weight\", gguf = \"blk.{l}.attn_k_norm.weight\" }\n"
}

/// Whole-projection QK-norm (OLMoE's, here on a dense arch) runs on the GPU as its own kernel
/// between the QKV projection and attention, decode and prefill, over q then k; the attention
/// kernels then see no per-head norm. (tests/cuda_kernels.rs runs it against the CPU op.)
#[test]
fn whole_projection_qk_norm_is_a_kernel_before_attention() {
    let s = schedule_of("archs/tiny/llama-tiny.toml", with_whole_qk_norm).unwrap();
    let layer = ["norm_qkv", "qk_norm_whole", "attn_decode", "o_residual", "norm_gateup", "down_residual"];
    assert_eq!(kernels(&s)[1..7], layer);
    let norm = s.decode.iter().find(|l| l.kernel == "qk_norm_whole").unwrap();
    assert_eq!(norm.args, [Arg::Buf(Buf::Qkv), Arg::Weight(Role::AttnQNorm, Some(0)), Arg::Weight(Role::AttnKNorm, Some(0))]);
    assert_eq!(norm.grid, Grid::Fixed(1, 2, 1), "decode: a block for q, one for k");
    let attn = s.decode.iter().find(|l| l.kernel == "attn_decode").unwrap();
    assert_eq!((attn.args[1], attn.args[2]), (Arg::Null, Arg::Null), "no per-head norm in attention");
    // Prefill: after the q/k/v GEMMs, before RoPE and the cache write, over every prompt row.
    let names: Vec<&str> = s.prefill.iter().map(|st| match st { Step::Kernel(k) => k.kernel, Step::Gemm(_) => "gemm" }).collect();
    assert_eq!(names[1..7], ["rows_norm", "gemm", "gemm", "gemm", "qk_norm_whole", "qk_rope_kv"]);
    let Step::Kernel(p) = &s.prefill[5] else { unreachable!() };
    assert_eq!((p.grid, p.args[0]), (Grid::Rows, Arg::Buf(Buf::PQkv)));
    // Per-head QK-norm stays inside attention, and never as this kernel.
    let g = schedule_of("archs/tiny/gemma3-tiny.toml", |t| t).unwrap();
    assert!(!kernels(&g).contains(&"qk_norm_whole"));
}

/// OLMoE's description with Gemma's sandwich norms: a MoE output through a post-norm, which the
/// MoE kernels do not take (moe_down adds into the residual).
fn with_sandwich_norms(t: String) -> String {
    t.replace("placement = \"pre\"", "placement = \"sandwich\"")
        + "attn_post_norm = { hf = \"model.layers.{l}.post_self_attn_norm.weight\", gguf = \"blk.{l}.post_attention_norm.weight\" }\n\
           ffn_post_norm = { hf = \"model.layers.{l}.post_ffn_norm.weight\", gguf = \"blk.{l}.post_ffw_norm.weight\" }\n"
}

/// An OLMoE layer on the GPU: attention as the dense archs', then the mixture of experts as four
/// kernels: the router matvec (the FFN norm fused in), top-k and the weights on the device into
/// the route buffer, the chosen experts' gate/up rows, their down rows weighted into the
/// residual. The expert choice stays in device buffers (no launch or step hands it to the host:
/// the decode step is still one graph). Prefill runs the router and top-k over the prompt rows
/// (grid y), its attention projections as GEMMs, then groups the rows by expert on the device:
/// the grouped gate/up and down kernels over tiles of one expert's rows, the pairs' outputs
/// summed into the residual in slot order; no GEMM touches the experts.
#[test]
fn olmoe_layers_route_on_the_device() {
    let s = schedule_of("archs/tiny/olmoe-tiny.toml", |t| t).unwrap();
    let layer = ["norm_qkv", "qk_norm_whole", "attn_decode", "o_residual", "moe_router", "moe_topk", "moe_gateup", "moe_down"];
    let want: Vec<&str> = std::iter::once("embed").chain(layer.iter().copied().cycle().take(2 * layer.len())).chain(["norm_lm_head", "argmax_step"]).collect();
    assert_eq!(kernels(&s), want);
    let find = |list: &[Launch], k: &str| list.iter().find(|l| l.kernel == k).cloned().unwrap();
    let w = |r: Role| Arg::Weight(r, Some(1));
    let layer1: Vec<Launch> = s.decode.iter().filter(|l| l.args.iter().any(|a| *a == w(Role::FfnNorm) || *a == w(Role::MoeDown))).cloned().collect();
    let router = find(&layer1, "moe_router");
    assert_eq!(router.args, [Arg::Buf(Buf::X), w(Role::FfnNorm), w(Role::MoeRouter), Arg::Buf(Buf::MoeLogits)]);
    assert_eq!(router.grid, Grid::MatvecRows { weight: (Role::MoeRouter, Some(1)), in_features: 64, rows: 8, nr: 1 });
    let topk = find(&s.decode, "moe_topk");
    assert_eq!((topk.typed_by, topk.grid, topk.block), (None, Grid::Rows, 32), "one warp a row, for every weight type");
    assert_eq!(topk.args, [Arg::Buf(Buf::MoeLogits), Arg::I32(0), Arg::Buf(Buf::MoeRoute)], "olmoe-tiny: norm_topk_prob = false");
    let gateup = find(&layer1, "moe_gateup");
    assert_eq!(gateup.args, [Arg::Buf(Buf::X), w(Role::FfnNorm), w(Role::MoeGate), w(Role::MoeUp), Arg::Buf(Buf::MoeRoute), Arg::Buf(Buf::MoeAct)]);
    assert_eq!(gateup.grid, Grid::MatvecRows { weight: (Role::MoeGate, Some(1)), in_features: 64, rows: 2 * 32, nr: 2 }, "top_k x ffn outputs, gate and up rows");
    let down = find(&layer1, "moe_down");
    assert_eq!(down.args, [Arg::Buf(Buf::MoeAct), w(Role::MoeDown), Arg::Buf(Buf::MoeRoute), Arg::Buf(Buf::X)]);
    assert_eq!(down.grid, Grid::MatvecRows { weight: (Role::MoeDown, Some(1)), in_features: 32, rows: 64, nr: 2 }, "hidden outputs, one down row per chosen expert");
    // The renormalisation flag comes from the description.
    let renorm = schedule_of("archs/tiny/olmoe-tiny.toml", |t| t.replace("norm_topk_prob = false", "norm_topk_prob = true")).unwrap();
    assert_eq!(find(&renorm.decode, "moe_topk").args[1], Arg::I32(1));
    // Prefill: per layer the q, k, v, o GEMMs (no expert GEMM), the router and top-k over every
    // row, then the rows grouped by expert.
    let names: Vec<&str> = s.prefill.iter().map(|st| match st { Step::Kernel(k) => k.kernel, Step::Gemm(_) => "gemm" }).collect();
    let layer = ["rows_norm", "gemm", "gemm", "gemm", "qk_norm_whole", "qk_rope_kv", "attn_partial", "attn_combine_rows", "gemm"];
    let moe = ["moe_router", "moe_topk", "moe_group", "moe_gateup_grouped", "moe_down_grouped", "moe_combine"];
    let layer: Vec<&str> = layer.into_iter().chain(moe).collect();
    assert_eq!(names[1..1 + layer.len()], layer);
    assert_eq!(names.len(), 1 + 2 * layer.len());
    let prefill: Vec<Launch> = s.prefill.iter().filter_map(|st| if let Step::Kernel(k) = st { Some(k.clone()) } else { None }).collect();
    let w0 = |r: Role| Arg::Weight(r, Some(0));
    let group = find(&prefill, "moe_group");
    assert_eq!((group.typed_by, group.grid, group.block), (None, Grid::Fixed(1, 1, 1), 256), "one block, for every weight type");
    assert_eq!(group.args, [Arg::Buf(Buf::PMoeRoute), Arg::Elements { width: 2 }, Arg::Buf(Buf::PMoeGroups)], "rows x top_k pairs, counted at launch");
    let pgateup = find(&prefill, "moe_gateup_grouped");
    assert_eq!(pgateup.args, [Arg::Buf(Buf::PX), w0(Role::FfnNorm), w0(Role::MoeGate), w0(Role::MoeUp), Arg::Buf(Buf::PMoeGroups), Arg::Buf(Buf::PMoeAct)]);
    assert_eq!(pgateup.grid, Grid::ExpertTiles { weight: (Role::MoeGate, Some(0)), in_features: 64, rows: 32, nr: 2, experts: 8, top_k: 2 }, "ffn outputs of gate and up rows");
    let pdown = find(&prefill, "moe_down_grouped");
    assert_eq!(pdown.args, [Arg::Buf(Buf::PMoeAct), w0(Role::MoeDown), Arg::Buf(Buf::PMoeGroups), Arg::Buf(Buf::PMoeDown)]);
    assert_eq!(pdown.grid, Grid::ExpertTiles { weight: (Role::MoeDown, Some(0)), in_features: 32, rows: 64, nr: 1, experts: 8, top_k: 2 }, "hidden outputs, one down row");
    let combine = find(&prefill, "moe_combine");
    assert_eq!((combine.typed_by, combine.grid), (None, Grid::Rows));
    assert_eq!(combine.args, [Arg::Buf(Buf::PMoeDown), Arg::Buf(Buf::PMoeRoute), Arg::Buf(Buf::PX)]);
    assert!(prefill.iter().all(|l| l.kernel != "moe_gateup" && l.kernel != "moe_down"), "prefill reads experts grouped only");
    assert!(s.gemms().all(|g| !matches!(g.weight.0, Role::MoeRouter | Role::MoeGate | Role::MoeUp | Role::MoeDown)));
    // The generated module says the same.
    assert_eq!(thin_generated::olmoe_tiny::cuda::arch().unwrap().schedule, s);
}

/// moe_down loads its first rows (chosen by the route) and residual rows before its PDL wait:
/// the route is written by moe_topk two launches back, the residual earlier still, and the launch
/// just before it (moe_gateup) writes neither. moe_gateup's rows come from the launch just
/// before it, so it waits first (the matvec core's EARLY = false).
#[test]
fn moe_down_reads_only_what_two_launches_back_wrote() {
    let s = schedule_of("archs/olmoe-1b-7b.toml", |t| t).unwrap();
    // The kernels as generated (the staleness test keeps them codegen's).
    let src = std::fs::read_to_string(root().join("generated/olmoe_1b_7b/kernels/decode.cu")).unwrap();
    let mut seen = 0;
    for w in s.decode.windows(3) {
        if w[2].kernel == "moe_down" {
            assert_eq!((w[0].kernel, w[1].kernel), ("moe_topk", "moe_gateup"));
            assert!(!w[1].args.contains(&Arg::Buf(Buf::X)) || w[1].args[0] == Arg::Buf(Buf::X), "moe_gateup only reads X");
            assert_eq!(w[1].args.last(), Some(&Arg::Buf(Buf::MoeAct)), "moe_gateup writes only its activations");
            seen += 1;
        }
    }
    assert_eq!(seen, 16);
    let at = |body: &str, what: &str| body.find(what).unwrap_or_else(|| panic!("{what} not in the kernel"));
    let body = kernel_body(&src, "moe_gateup_bf16");
    assert!(body.contains("matvec<HIDDEN, TOP_K * FFN, 2, false>"), "moe_gateup leaves the wait to itself");
    assert!(at(body, "pdl_enter()") < at(body, "load_route("), "moe_gateup waits before it reads the route");
    let down = kernel_body(&src, "moe_down_bf16");
    assert!(at(down, "load_route(") < at(down, "pdl_enter()"), "moe_down reads the route before its wait");
    assert!(at(down, "load_row<FFN, TOP_K>") < at(down, "pdl_enter()"), "moe_down loads its first rows early");
    assert!(src.contains("constexpr int EXPERTS = 64;") && src.contains("constexpr int TOP_K = 8;"));
}

#[test]
fn layers_without_rope_and_sliding_windows_reach_attention() {
    let s = schedule_of("archs/tiny/smollm3-tiny.toml", |t| t).unwrap();
    let attn: Vec<&Launch> = s.decode.iter().filter(|l| l.kernel == "attn_decode").collect();
    // Every 4th layer has no RoPE: no table, flag 0.
    assert_eq!(attn.iter().map(|l| l.args[8]).collect::<Vec<_>>(), [Arg::I32(1), Arg::I32(1), Arg::I32(1), Arg::I32(0)]);
    assert_eq!((attn[3].args[3], attn[3].args[4]), (Arg::Null, Arg::Null));
    let g = schedule_of("archs/tiny/gemma3-tiny.toml", |t| t).unwrap();
    let attn: Vec<&Launch> = g.decode.iter().filter(|l| l.kernel == "attn_decode").collect();
    assert_eq!(attn.iter().map(|l| l.args[9]).collect::<Vec<_>>(), [4, 4, 4, 4, 4, 0].map(Arg::I32), "five sliding layers (window 4), one global");
    assert_eq!(attn[0].args[3], Arg::Buf(Buf::Cos(RopeTable::Local)));
    assert_eq!(attn[5].args[3], Arg::Buf(Buf::Cos(RopeTable::Global)));
    assert_eq!(attn[0].args[1], Arg::Weight(Role::AttnQNorm, Some(0)), "per-head QK-norm weights");
}

#[test]
fn prefill_is_gemms_around_row_kernels() {
    let s = schedule_of("archs/tiny/llama-tiny.toml", |t| t).unwrap();
    let gemms: Vec<_> = s.prefill.iter().filter_map(|s| if let Step::Gemm(g) = s { Some(g) } else { None }).collect();
    assert_eq!(gemms.len(), 2 * 7, "q, k, v, o, gate, up, down per layer");
    let qkv = 4 * 16 + 2 * 2 * 16;
    assert_eq!((gemms[1].out_col, gemms[1].ldc, gemms[1].n, gemms[1].k), (64, qkv, 32, 64), "k lands after q in the qkv rows");
    assert!(gemms.iter().filter(|g| g.accumulate).all(|g| g.out == Buf::PX), "only the residual GEMMs accumulate");
    assert_eq!(gemms.iter().filter(|g| g.accumulate).count(), 4);
    let attn = s.prefill.iter().find_map(|s| if let Step::Kernel(k) = s { (k.kernel == "attn_partial").then_some(k) } else { None }).unwrap();
    assert_eq!((attn.grid, attn.args[5]), (Grid::HeadRowsZ { heads: 4 }, Arg::Ctx), "a block per head and prompt row, one split over the cache");
}

#[test]
fn residual_adds_follow_a_kernel_that_leaves_the_residual_alone() {
    // o_residual and down_residual read their residual rows before their PDL wait (the matvec
    // template's `res`): the kernel just before them must not write X.
    const LEAVE_X: &[&str] = &["attn_decode", "norm_gateup"];
    for file in ["archs/smollm2-135m.toml", "archs/llama3.2-1b.toml", "archs/smollm3-3b.toml"] {
        let s = schedule_of(file, |t| t).unwrap();
        let mut seen = 0;
        for w in s.decode.windows(2) {
            if matches!(w[1].kernel, "o_residual" | "down_residual") {
                assert!(LEAVE_X.contains(&w[0].kernel), "{file}: {} comes right after {}", w[1].kernel, w[0].kernel);
                seen += 1;
            }
        }
        assert_eq!(seen, 2 * s.decode.iter().filter(|l| l.kernel == "attn_decode").count(), "{file}");
    }
}

fn archive(name: &str, dir: &tempfile::TempDir) -> Archive {
    let src = root().join("tests/fixtures/tiny").join(name);
    let out = dir.path().join(format!("{name}.thin"));
    convert(&src, &out, &ConvertOptions { profile: Profile::shipped("bf16").expect("shipped"), allow_requantize: false, progress: false, archs: thin_generated::KNOWN_ARCHS }).expect("convert");
    Archive::open(&out).expect("open")
}

fn expected_elems(a: &CudaArch, role: Role) -> usize {
    let (q, kv, h) = ((a.dims.num_heads as usize) * (a.dims.head_dim as usize), (a.dims.num_kv_heads as usize) * (a.dims.head_dim as usize), (a.dims.hidden_size as usize));
    let whole = a.schedule.decode.iter().any(|l| l.kernel == "qk_norm_whole");
    match role {
        Role::TokenEmbd | Role::LmHead => (a.dims.vocab_size as usize) * h,
        Role::AttnQ => q * h,
        Role::AttnK | Role::AttnV => kv * h,
        Role::AttnO => h * q,
        Role::FfnGate | Role::FfnUp | Role::FfnDown => (a.dims.intermediate_size as usize) * h,
        Role::AttnQNorm if whole => q,
        Role::AttnKNorm if whole => kv,
        Role::AttnQNorm | Role::AttnKNorm => a.dims.head_dim as usize,
        Role::MoeRouter => (a.dims.num_experts as usize) * h,
        Role::MoeGate | Role::MoeUp | Role::MoeDown => (a.dims.num_experts as usize) * (a.dims.intermediate_size as usize) * h,
        _ => h,
    }
}

fn check(name: &str, arch: Result<CudaArch, PlanError>) {
    let arch = arch.unwrap_or_else(|e| panic!("{name}: {e}"));
    let dir = tempfile::tempdir().unwrap();
    let ar = archive(name, &dir);
    let m = ar.manifest();
    assert_eq!(m.shape_fingerprint, arch.fingerprint, "{name}");
    let attn: Vec<&Launch> = arch.schedule.decode.iter().filter(|l| l.kernel == "attn_decode").collect();
    assert_eq!(attn.len() as u64, m.arch.dims.num_layers);
    for (l, la) in attn.iter().enumerate() {
        assert_eq!(la.args[8] == Arg::I32(0), m.arch.no_rope_layers.contains(&(l as u64)), "{name} layer {l} rope");
        let sliding = m.arch.layer_attention.get(l) == Some(&LayerAttention::SlidingWindow);
        let want = if sliding { m.arch.sliding_window.unwrap() as i32 } else { 0 };
        assert_eq!(la.args[9], Arg::I32(want), "{name} layer {l} window");
        assert_eq!(la.args[6], Arg::Buf(Buf::KCache(l)), "{name} layer {l} cache");
    }
    for (role, layer) in arch.schedule.weights() {
        let t = m.tensor(role, layer).unwrap_or_else(|| panic!("{name}: the schedule reads {role:?} {layer:?}, absent from the archive"));
        let n: u64 = t.shape.iter().product();
        assert_eq!(n as usize, expected_elems(&arch, role), "{name}: {role:?} {layer:?} shape {:?}", t.shape);
    }
    assert!(arch.kernels.contains(&format!("constexpr int HIDDEN = {};", arch.dims.hidden_size)), "{name}: kernels rendered at the arch's shapes");
    for t in thin_core::cuda::plan::WEIGHT_TYPES {
        assert!(arch.kernels.contains(&format!("#ifdef THIN_WEIGHTS_{}\n", t.name())), "{name}: a traits block for {}", t.name());
    }
}

#[test]
fn llama_schedule_matches_its_archive() {
    check("llama-tiny", thin_generated::llama_tiny::cuda::arch());
}

#[test]
fn smollm3_schedule_skips_rope_where_the_archive_says() {
    check("smollm3-tiny", thin_generated::smollm3_tiny::cuda::arch());
}

/// Every expert tensor the MoE kernels read is in the archive, stacked `[experts, rows, cols]` by
/// the converter from HF's one tensor per expert: expert e's rows are the kernels' rows
/// `e * rows ..` of one matrix (the leading dims are rows in every weight layout).
#[test]
fn olmoe_schedule_matches_its_archive() {
    check("olmoe-tiny", thin_generated::olmoe_tiny::cuda::arch());
    let dir = tempfile::tempdir().unwrap();
    let ar = archive("olmoe-tiny", &dir);
    let m = ar.manifest();
    assert_eq!(m.tensor(Role::MoeGate, Some(0)).unwrap().shape, [8, 32, 64]);
    assert_eq!(m.tensor(Role::MoeDown, Some(1)).unwrap().shape, [8, 64, 32]);
    assert_eq!(m.tensor(Role::MoeRouter, Some(1)).unwrap().shape, [8, 64]);
}

#[test]
fn gemma3_schedule_has_windows_local_rope_and_sandwich_norms() {
    let a = thin_generated::gemma3_tiny::cuda::arch().unwrap();
    assert!(a.kernels.contains("tanhf"), "GeGLU-tanh activation");
    check("gemma3-tiny", Ok(a));
}

/// The text of `extern "C" __global__` kernel `name` in `src`, to its closing brace in column 0.
fn kernel_body<'a>(src: &'a str, name: &str) -> &'a str {
    let start = src
        .match_indices("extern \"C\" __global__")
        .map(|(i, _)| i)
        .find(|&i| src[i..].lines().next().is_some_and(|head| head.contains(&format!(" {name}("))))
        .unwrap_or_else(|| panic!("no kernel {name}"));
    let len = src[start..].find("\n}\n").or_else(|| src[start..].trim_end().ends_with("\n}").then(|| src[start..].trim_end().len() - 2)).unwrap_or_else(|| panic!("kernel {name} has no closing brace in column 0"));
    &src[start..start + len]
}

/// Whether `text` calls pdl_enter(), directly or through device functions up to `depth` deep
/// (the matvec core and attn_decode_block call it).
fn waits(src: &str, text: &str, depth: usize) -> bool {
    if text.contains("pdl_enter();") {
        return true;
    }
    depth > 0
        && src.match_indices("__device__ __forceinline__ void ").any(|(i, m)| {
            let rest = &src[i + m.len()..];
            let name = &rest[..rest.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(0)];
            let def = &rest[..rest.find("\n}\n").unwrap_or(rest.len())];
            !name.is_empty() && (text.contains(&format!(" {name}(")) || text.contains(&format!(" {name}<"))) && waits(src, def, depth - 1)
        })
}

/// Programmatic dependent launch lets a decode kernel start while the previous one runs; only its
/// `pdl_enter()` (griddepcontrol.wait) orders it after that kernel's writes. A kernel of the
/// decode graph without it reads stale activations (the 68ebf5d attempt: attn_decode had none,
/// and decode logits came out at cosine ~0). Every kernel a schedule launches must call it,
/// directly or through the matvec core, which calls it before staging its input.
#[test]
fn every_scheduled_kernel_waits_for_its_predecessor() {
    let archs = [thin_generated::llama_tiny::cuda::arch(), thin_generated::smollm3_tiny::cuda::arch(), thin_generated::gemma3_tiny::cuda::arch(), thin_generated::olmoe_tiny::cuda::arch()];
    for a in archs.into_iter().map(Result::unwrap) {
        let src = a.kernels;
        let core = &src[src.find("__device__ __forceinline__ void matvec(").expect("matvec core")..];
        let core = &core[..core.find("\n}\n").unwrap()];
        let wait = core.find("pdl_enter();").expect("the matvec core calls pdl_enter");
        assert!(wait < core.find("stage();").unwrap(), "the matvec core waits before staging its input");
        for l in a.schedule.launches() {
            // Every instance: one per weight type for a typed launch.
            let names: Vec<String> = match l.typed_by {
                Some(_) => thin_core::cuda::plan::WEIGHT_TYPES.iter().map(|t| thin_core::cuda::plan::instance(l.kernel, *t)).collect(),
                None => vec![l.kernel.to_string()],
            };
            for k in names {
                assert!(waits(src, kernel_body(src, &k), 3), "{}: kernel {k} never calls pdl_enter()", a.arch);
            }
        }
    }
}

/// `--residency hybrid` replaces a layer's launches and prefill steps (`Schedule::layers`) with
/// the CPU engine's layer, so each range must be that layer alone: its launches and steps read
/// only that layer's weights and KV cache, the ranges follow one another in layer order with the
/// prologue before and the epilogue after, and nothing outside them reads a layer's weight or
/// cache. (The residual X / PX is the state that crosses; the device tests compare the outputs.)
#[test]
fn each_layers_steps_read_only_that_layer() {
    fn reads(args: &[Arg]) -> (Vec<Option<u32>>, Vec<usize>) {
        let weights = args.iter().filter_map(|a| match *a {
            Arg::Weight(_, l) => Some(l),
            _ => None,
        });
        let caches = args.iter().filter_map(|a| match *a {
            Arg::Buf(b) => b.kv_layer(),
            _ => None,
        });
        (weights.collect(), caches.collect())
    }
    fn step_reads(s: &Step) -> (Vec<Option<u32>>, Vec<usize>) {
        match s {
            Step::Kernel(l) => reads(&l.args),
            Step::Gemm(g) => (vec![g.weight.1], [g.input, g.out].into_iter().filter_map(Buf::kv_layer).collect()),
        }
    }
    for file in ["archs/smollm2-135m.toml", "archs/llama3.2-1b.toml", "archs/smollm3-3b.toml", "archs/gemma3-270m.toml", "archs/olmoe-1b-7b.toml", "archs/tiny/gemma3-tiny.toml"] {
        let s = schedule_of(file, |t| t).unwrap();
        let n = s.layers.len();
        assert!(n >= 2, "{file}: {n} layers");
        let (first, last) = (s.layers[0].clone(), s.layers[n - 1].clone());
        assert_eq!(last.decode.end, s.decode.len() - s.epilogue.len(), "{file}: the epilogue follows the last layer");
        assert_eq!(last.prefill.end, s.prefill.len(), "{file}: prefill ends with the last layer");
        for (l, r) in s.layers.iter().enumerate() {
            assert!(!r.decode.is_empty() && !r.prefill.is_empty(), "{file}: layer {l} has launches and steps");
            if l > 0 {
                assert_eq!((r.decode.start, r.prefill.start), (s.layers[l - 1].decode.end, s.layers[l - 1].prefill.end), "{file}: layer {l} follows layer {}", l - 1);
            }
            for i in r.decode.clone() {
                let (w, c) = reads(&s.decode[i].args);
                assert!(w.iter().all(|&x| x == Some(l as u32)) && c.iter().all(|&x| x == l), "{file}: decode launch {i} ({}) of layer {l} reads {w:?} {c:?}", s.decode[i].kernel);
            }
            for i in r.prefill.clone() {
                let (w, c) = step_reads(&s.prefill[i]);
                assert!(w.iter().all(|&x| x == Some(l as u32)) && c.iter().all(|&x| x == l), "{file}: prefill step {i} of layer {l} reads {w:?} {c:?}");
            }
        }
        let outside_decode = (0..first.decode.start).chain(last.decode.end..s.decode.len());
        for i in outside_decode {
            let (w, c) = reads(&s.decode[i].args);
            assert!(w.iter().all(|x| x.is_none()) && c.is_empty(), "{file}: decode launch {i} ({}) outside the layers reads {w:?} {c:?}", s.decode[i].kernel);
        }
        for i in 0..first.prefill.start {
            let (w, c) = step_reads(&s.prefill[i]);
            assert!(w.iter().all(|x| x.is_none()) && c.is_empty(), "{file}: prefill step {i} before the layers reads {w:?} {c:?}");
        }
    }
}
