//! The CUDA decode plan of each generated engine against a real converted archive: every weight
//! the launches read exists with the shape the kernels assume, and the per-layer RoPE / window
//! choices equal what the converter recorded from the HF config. Host-side only: no GPU needed.

use std::path::PathBuf;

use thin_core::arch::LayerAttention;
use thin_core::convert::{convert, ConvertOptions};
use thin_core::cuda::plan::{decode_launches, prefill_steps, weights_used, CudaArch, Fusion, Layout, PlanError, RopeTable, Step};
use thin_core::format::Archive;
use thin_core::quant::Profile;
use thin_core::role::Role;

fn archive(name: &str, dir: &tempfile::TempDir) -> Archive {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny").join(name);
    let out = dir.path().join(format!("{name}.thin"));
    convert(&src, &out, &ConvertOptions { profile: Profile::Bf16, progress: false }).expect("convert");
    Archive::open(&out).expect("open")
}

fn expected_elems(a: &CudaArch, role: Role) -> usize {
    let (q, kv, h) = (a.heads * a.head_dim, a.kv_heads * a.head_dim, a.hidden);
    match role {
        Role::TokenEmbd | Role::LmHead => a.vocab * h,
        Role::AttnQ => q * h,
        Role::AttnK | Role::AttnV => kv * h,
        Role::AttnO => h * q,
        Role::FfnGate | Role::FfnUp | Role::FfnDown => a.ffn * h,
        Role::AttnQNorm | Role::AttnKNorm => a.head_dim,
        _ => h,
    }
}

fn check(name: &str, arch: CudaArch) -> Archive {
    let dir = tempfile::tempdir().unwrap();
    let ar = archive(name, &dir);
    let m = ar.manifest();
    assert_eq!(m.shape_fingerprint, arch.fingerprint, "{name}");
    assert_eq!(arch.layers.len() as u64, m.arch.num_layers);
    for (l, spec) in arch.layers.iter().enumerate() {
        assert_eq!(spec.rope.is_none(), m.arch.no_rope_layers.contains(&(l as u64)), "{name} layer {l} rope");
        let sliding = m.arch.layer_attention.get(l) == Some(&LayerAttention::SlidingWindow);
        assert_eq!(spec.window.is_some(), sliding, "{name} layer {l} window");
        if sliding {
            assert_eq!(spec.window.map(|w| w as u64), m.arch.sliding_window);
        }
    }
    let layout = Layout::new(&arch, 64, 16, 2).unwrap();
    let mut used = Vec::new();
    for fusion in [Fusion::Fused, Fusion::Unfused] {
        used.extend(weights_used(&decode_launches(&arch, &layout, 132, fusion).unwrap()));
    }
    for step in prefill_steps(&arch, &layout, 16).unwrap() {
        if let Step::Gemm(g) = step {
            used.push(g.weight);
        }
    }
    for (role, layer) in used {
        let t = m.tensor(role, layer).unwrap_or_else(|| panic!("{name}: the CUDA plan reads {role:?} {layer:?}, absent from the archive"));
        let n: u64 = t.shape.iter().product();
        assert_eq!(n as usize, expected_elems(&arch, role), "{name}: {role:?} {layer:?} shape {:?}", t.shape);
    }
    assert!(arch.kernels_bf16.contains(&format!("constexpr int HIDDEN = {};", arch.hidden)), "{name}: kernels rendered at the arch's shapes");
    assert!(arch.kernels_f32.contains("typedef float W;"));
    ar
}

#[test]
fn llama_plan_matches_its_archive() {
    check("llama-tiny", thin_generated::llama_tiny::cuda::arch());
}

#[test]
fn smollm3_plan_skips_rope_where_the_archive_says() {
    let a = thin_generated::smollm3_tiny::cuda::arch();
    assert_eq!(a.layers.iter().filter(|l| l.rope.is_none()).count(), 1, "4 layers, every 4th without RoPE");
    check("smollm3-tiny", a);
}

#[test]
fn gemma3_plan_has_windows_local_rope_and_sandwich_norms() {
    let a = thin_generated::gemma3_tiny::cuda::arch();
    assert!(a.sandwich && a.qk_norm, "post norms and per-head QK-norm");
    assert!(a.layers.iter().any(|l| l.rope == Some(RopeTable::Local)));
    assert!(a.kernels_bf16.contains("tanhf"), "GeGLU-tanh activation");
    check("gemma3-tiny", a);
}

#[test]
fn olmoe_is_refused_by_name() {
    let a = thin_generated::olmoe_tiny::cuda::arch();
    let layout = Layout::new(&a, 64, 32, 2).unwrap();
    assert!(matches!(decode_launches(&a, &layout, 132, Fusion::Fused), Err(PlanError::Unsupported { .. })));
}

/// The text of `extern "C" __global__` kernel `name` in `src`, to its closing brace in column 0.
fn kernel_body<'a>(src: &'a str, name: &str) -> &'a str {
    let start = src
        .match_indices("extern \"C\" __global__")
        .map(|(i, _)| i)
        .find(|&i| src[i..].lines().next().is_some_and(|head| head.contains(&format!(" {name}("))))
        .unwrap_or_else(|| panic!("no kernel {name}"));
    let len = src[start..].find("\n}\n").unwrap_or_else(|| panic!("kernel {name} has no closing brace in column 0"));
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
/// and decode logits came out at cosine ~0). Every kernel a decode plan launches must call it,
/// directly or through the matvec core, which calls it before staging its input.
#[test]
fn every_decode_kernel_waits_for_its_predecessor() {
    let archs = [thin_generated::llama_tiny::cuda::arch(), thin_generated::smollm3_tiny::cuda::arch(), thin_generated::gemma3_tiny::cuda::arch()];
    for a in &archs {
        for fusion in [Fusion::Fused, Fusion::Unfused] {
            let layout = Layout::new(a, 64, 32, 2).unwrap();
            for src in [a.kernels_bf16, a.kernels_f32] {
                let core = &src[src.find("__device__ __forceinline__ void matvec(").expect("matvec core")..];
                let core = &core[..core.find("\n}\n").unwrap()];
                let wait = core.find("pdl_enter();").expect("the matvec core calls pdl_enter");
                assert!(wait < core.find("stage();").unwrap(), "the matvec core waits before staging its input");
                for l in decode_launches(a, &layout, 132, fusion).unwrap() {
                    let body = kernel_body(src, l.kernel);
                    assert!(
                        waits(src, body, 3),
                        "{}: kernel {} never calls pdl_enter()",
                        a.arch,
                        l.kernel
                    );
                }
            }
        }
    }
}

/// The persistent step is rendered exactly where the plan offers it, and its one launch carries
/// every layer's weights through the layer table instead.
#[test]
fn persistent_step_where_the_kernels_have_it() {
    let archs = [
        thin_generated::llama_tiny::cuda::arch(),
        thin_generated::smollm3_tiny::cuda::arch(),
        thin_generated::gemma3_tiny::cuda::arch(),
        thin_generated::olmoe_tiny::cuda::arch(),
    ];
    for a in &archs {
        let fits = thin_core::cuda::plan::persistent_fits(a);
        assert_eq!(fits, a.kernels_bf16.contains("decode_persistent("), "{}: plan and rendered kernels disagree", a.arch);
        assert_eq!(fits, a.kernels_f32.contains("decode_persistent("), "{}", a.arch);
        let layout = Layout::new(a, 64, 32, 2).unwrap();
        let got = decode_launches(a, &layout, 132, Fusion::Persistent);
        // Prefill's epilogue is planned on its own: the persistent step has no separate LM head
        // launch to borrow (its absence was an out-of-range slice in prefill).
        // (MoE has no CUDA plan at all yet.)
        match thin_core::cuda::plan::epilogue_launches(a, &layout, 132) {
            Ok(ep) => assert_eq!(ep.iter().map(|l| l.kernel).collect::<Vec<_>>(), ["norm_lm_head", "argmax_step"], "{}", a.arch),
            Err(e) => assert!(a.moe && matches!(e, PlanError::Unsupported { .. }), "{}: {e}", a.arch),
        }
        if !fits {
            match got.unwrap_err() {
                e @ PlanError::NoPersistent { .. } => assert!(e.to_string().contains("unset THIN_PERSISTENT"), "{e}"),
                e => assert!(a.moe && matches!(e, PlanError::Unsupported { .. }), "{}: {e}", a.arch),
            }
            continue;
        }
        let launches = got.unwrap();
        assert_eq!(launches.len(), 1);
        assert_eq!((launches[0].kernel, launches[0].grid, launches[0].block), ("decode_persistent", (132, 1, 1), 256));
        assert_eq!(layout.get(thin_core::cuda::plan::Buf::LayerTable).unwrap().1, a.layers.len() * thin_core::cuda::plan::LAYER_ARGS_BYTES);
        // 15 pointers then 2 i32: the kernel's struct LayerArgs (128 bytes, static_asserted there).
        for l in 0..a.layers.len() {
            let args = thin_core::cuda::plan::layer_args(a, l);
            let ptrs = args.iter().take_while(|x| !matches!(x, thin_core::cuda::plan::Arg::I32(_))).count();
            assert_eq!((args.len(), ptrs), (17, 15), "{} layer {l}", a.arch);
        }
        // Every weight the fused step reads is in the layer table or the launch.
        let fused = weights_used(&decode_launches(a, &layout, 132, Fusion::Fused).unwrap());
        let mut persistent = weights_used(&launches);
        for l in 0..a.layers.len() {
            for x in thin_core::cuda::plan::layer_args(a, l) {
                if let thin_core::cuda::plan::Arg::Weight(r, li) = x {
                    persistent.push((r, li));
                }
            }
        }
        for w in &fused {
            assert!(persistent.contains(w), "{}: {w:?} missing from the persistent step", a.arch);
        }
    }
    assert!(thin_core::cuda::plan::persistent_fits(&thin_generated::llama_tiny::cuda::arch()));
}
