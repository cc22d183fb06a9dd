//! `thin plan` on the tiny fixtures: the residency plan from the archive's real tensors and the
//! CUDA layout of the engine compiled in, with no GPU (the budget is then unknown unless
//! `--gpu-mem` gives it).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn thin(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_thin")).args(args).env("RAYON_NUM_THREADS", "2").output().expect("run thin")
}

fn convert(name: &str, dir: &Path) -> PathBuf {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny").join(name);
    let out = dir.join(format!("{name}.thin"));
    let o = thin(&["convert", src.to_str().expect("utf8"), "-o", out.to_str().expect("utf8"), "--quiet"]);
    assert!(o.status.success(), "convert {name}: {}", String::from_utf8_lossy(&o.stderr));
    out
}

fn plan_json(archive: &Path, extra: &[&str]) -> (Output, Value) {
    let mut args = vec!["plan", archive.to_str().expect("utf8"), "--json"];
    args.extend_from_slice(extra);
    let o = thin(&args);
    let v = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&o.stderr)));
    (o, v)
}

// llama-tiny (tests/fixtures/tiny/llama-tiny/config.json), bf16, tied embeddings: vocab 256,
// hidden 64, 2 layers, 4 heads and 2 KV heads of 16, ffn 128, max positions 256. By hand:
//   embedding 256·64·2 = 32768; norms f32, 5 of 64·4 = 1280; always resident 34048.
//   a layer: q, o 64·64·2 = 8192 each, k, v 32·64·2 = 4096 each, gate, up, down 128·64·2 = 16384
//   each: 73728. Weights 34048 + 2·73728 = 181504.
//   KV at ctx 256: 2 layers · (K, V) · 256 · 32 · 2 = 65536; at ctx 64: 16384.
//   Two layers never stream (a ring of two takes what both resident take), so the smallest
//   budget that runs at all is the all-resident one.
#[test]
fn plan_json_of_llama_tiny() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let a = convert("llama-tiny", tmp.path());
    let (o, v) = plan_json(&a, &["--gpu-mem", "1GiB"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(v["arch"], "llama-tiny");
    assert_eq!((v["decision"].as_str(), v["fits"].as_bool(), v["ctx"].as_u64()), (Some("all_resident"), Some(true), Some(256)));
    assert_eq!(v["weight_bytes"], 181504);
    assert_eq!(v["always_resident_bytes"], 34048);
    assert_eq!(v["layer_bytes"], serde_json::json!([73728, 73728]));
    assert_eq!(v["role_bytes"]["ffn_gate"], 2 * 16384);
    assert_eq!(v["kv_bytes"], 65536);
    assert_eq!(v["budget"]["gpu_mem"], 1u64 << 30);
    assert_eq!((v["cublas_workspace_bytes"].as_u64(), v["module_and_graph_bytes"].as_u64()), (Some(32 << 20), Some(48 << 20)));
    assert_eq!((v["streamed_bytes_per_token"].as_u64(), v["ring_slots"].as_u64(), v["bound_tok_s"].is_null()), (Some(0), Some(0), true));
    assert_eq!((v["link"]["gb_s"].as_f64(), v["link"]["source"].as_str()), (Some(50.0), Some("assumed")));
    let act = v["activation_bytes"].as_u64().expect("activations");
    let all = 34048 + 65536 + act + (80 << 20) + 2 * 73728;
    assert_eq!((v["all_resident_bytes"].as_u64(), v["min_stream_bytes"].as_u64(), v["device_bytes"].as_u64()), (Some(all), Some(all), Some(all)));
    // Every tensor the schedule reads, with its pages: the tied embedding first.
    let tensors = v["tensors"].as_array().expect("tensors");
    assert_eq!(tensors.len(), 1 + 1 + 2 * 9);
    assert_eq!((tensors[0]["role"].as_str(), tensors[0]["placement"].as_str(), tensors[0]["page_count"].as_u64()), (Some("token_embd"), Some("resident"), Some(1)));

    // A shorter context: a smaller KV cache.
    let (_, v) = plan_json(&a, &["--gpu-mem", "1GiB", "--ctx", "64"]);
    assert_eq!((v["ctx"].as_u64(), v["kv_bytes"].as_u64()), (Some(64), Some(16384)));

    // Without --gpu-mem and without a GPU: the all-resident plan, the budget unknown.
    if v["budget"]["free"].is_null() {
        let (o, v) = plan_json(&a, &[]);
        assert!(o.status.success());
        assert_eq!((v["decision"].as_str(), v["budget"]["gpu_mem"].is_null()), (Some("budget_unknown"), true));
        let text = thin(&["plan", a.to_str().expect("utf8")]);
        let text = String::from_utf8_lossy(&text.stdout);
        assert!(text.contains("device budget is unknown") && text.contains(&format!("{}MiB", all.div_ceil(1 << 20))), "{text}");
    }

    // One byte short of it: refused, naming the smallest --gpu-mem that runs.
    let short = (all - 1).to_string();
    let (o, v) = plan_json(&a, &["--gpu-mem", &short]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(v["fits"], false);
    let want = format!("--gpu-mem {}MiB", all.div_ceil(1 << 20));
    assert!(v["error"].as_str().expect("error").contains(&want), "{}", v["error"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains(&want));
}

#[test]
fn plan_refuses_bad_sizes_and_contexts() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let a = convert("llama-tiny", tmp.path());
    let a = a.to_str().expect("utf8");
    for bad in ["", "-1G", "4Q", "1.5.5G", "99999999999999999999G", "0"] {
        let o = thin(&["plan", a, &format!("--gpu-mem={bad}")]);
        assert_eq!(o.status.code(), Some(2), "{bad:?}: {}", String::from_utf8_lossy(&o.stderr));
        assert!(String::from_utf8_lossy(&o.stderr).contains("--gpu-mem"), "{bad:?}");
    }
    let o = thin(&["plan", a, "--ctx", "257"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("more than the model's maximum of 256"), "{}", String::from_utf8_lossy(&o.stderr));
}

// smollm3-tiny, gemma3-tiny and olmoe-tiny through the library: the plan counts every tensor the
// CUDA schedule reads, so its weight bytes are the archive's tensors aligned to 256 each (OLMoE's:
// the router and every expert of the stacked expert tensors, all resident; a step reads top_k).
#[test]
fn plans_of_the_other_tiny_fixtures_count_every_weight() {
    let tmp = tempfile::tempdir().expect("tempdir");
    for name in ["smollm3-tiny", "gemma3-tiny", "olmoe-tiny"] {
        let a = thin_core::format::Archive::open(&convert(name, tmp.path())).expect("open");
        let m = a.manifest();
        let p = thin::residency_plan(&a, 32, thin::Budget { gpu_mem: Some(1 << 30), free: None }, thin::Link::default(), thin::Residency::Auto).expect("plan");
        let aligned: u64 = m.tensors.iter().map(|t| t.byte_len.div_ceil(256) * 256).sum();
        assert_eq!(p.weight_bytes, aligned, "{name}");
        assert_eq!(p.layer_bytes.len() as u64, m.arch.dims.num_layers, "{name}");
        let d = &m.arch.dims;
        // K and V bf16 of every layer at ctx 32.
        assert_eq!(p.kv_bytes, d.num_layers * 2 * 32 * d.num_kv_heads * d.head_dim * 2, "{name}");
    }
}

// gemma3-tiny (6 layers, bf16): below the all-resident budget `stream` keeps the first layers
// that fit and streams the rest through a ring of two, each streamed matrix with its pages;
// `all` refuses the same budget naming both limits; below the ring's need every mode refuses
// with the smallest --gpu-mem that runs.
#[test]
fn plan_streams_gemma3_tiny_under_a_limit() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let a = convert("gemma3-tiny", tmp.path());
    let (_, v) = plan_json(&a, &["--gpu-mem", "1GiB"]);
    let (all, min) = (v["all_resident_bytes"].as_u64().expect("all"), v["min_stream_bytes"].as_u64().expect("min"));
    let layer = v["layer_bytes"][0].as_u64().expect("a layer");
    assert!(v["layer_bytes"].as_array().expect("layers").iter().all(|b| b.as_u64() == Some(layer)), "equal layers");
    assert_eq!(min, all - 4 * layer, "every layer streamed: six layers' worth less the ring's two");
    // A byte short of all resident: three layers resident and the ring's two (five layers' worth)
    // fit, four resident would take six.
    let short = (all - 1).to_string();
    for r in ["stream", "auto"] {
        let (o, v) = plan_json(&a, &["--gpu-mem", &short, "--residency", r]);
        assert!(o.status.success(), "{r}: {}", String::from_utf8_lossy(&o.stderr));
        assert_eq!((v["decision"].as_str(), v["residency"].as_str(), v["fits"].as_bool()), (Some("stream"), Some(r), Some(true)));
        assert_eq!(v["resident_layers"], serde_json::json!([0, 1, 2]));
        assert_eq!(v["streamed_layers"], serde_json::json!([3, 4, 5]));
        assert_eq!((v["ring_slots"].as_u64(), v["ring_slot_bytes"].as_u64()), (Some(2), Some(layer)));
        assert_eq!((v["streamed_bytes_per_token"].as_u64(), v["pinned_host_bytes"].as_u64()), (Some(3 * layer), Some(3 * layer)));
        assert_eq!(v["device_bytes"].as_u64(), Some(all - layer));
        let ring = v["ring"].as_array().expect("ring");
        assert_eq!(ring.iter().map(|l| (l["layer"].as_u64(), l["slot"].as_u64(), l["host_offset"].as_u64())).collect::<Vec<_>>(), [(Some(3), Some(0), Some(0)), (Some(4), Some(1), Some(layer)), (Some(5), Some(0), Some(2 * layer))]);
        // Gemma's seven matrices a layer, each on its own pages of the archive.
        let pages: u64 = ring.iter().flat_map(|l| l["tensors"].as_array().expect("tensors")).map(|t| t["page_count"].as_u64().expect("pages")).sum();
        assert_eq!(ring[0]["tensors"].as_array().expect("tensors").len(), 7);
        assert_eq!(v["streamed_pages_per_token"].as_u64(), Some(pages));
        assert!(pages >= 21, "{pages}");
    }
    let (o, v) = plan_json(&a, &["--gpu-mem", &short, "--residency", "all"]);
    assert_eq!((o.status.code(), v["fits"].as_bool(), v["decision"].as_str()), (Some(1), Some(false), Some("all_resident")));
    let e = v["error"].as_str().expect("error");
    assert!(e.contains("--residency all") && e.contains(&format!("--gpu-mem {}MiB", all.div_ceil(1 << 20))) && e.contains(&format!("from --gpu-mem {}MiB", min.div_ceil(1 << 20))), "{e}");
    // Below the ring's need: refused in every mode, with the limit that runs.
    let below = (min - 1).to_string();
    for r in ["stream", "auto"] {
        let (o, v) = plan_json(&a, &["--gpu-mem", &below, "--residency", r]);
        assert_eq!((o.status.code(), v["fits"].as_bool(), v["device_bytes"].as_u64()), (Some(1), Some(false), Some(min)));
        assert!(v["error"].as_str().expect("error").contains(&format!("The smallest that runs: --gpu-mem {}MiB", min.div_ceil(1 << 20))), "{}", v["error"]);
    }
    let text = thin(&["plan", a.to_str().expect("utf8"), "--gpu-mem", &short]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("stream 3 of 6 layers") && text.contains("layers 3-5") && text.contains("pinned host memory"), "{text}");
}

// Flags are checked as clap parses them, before any archive is opened: a bad size or residency
// is exit 2 naming the flag, on every command that takes them (chat and serve share run's).
#[test]
fn gpu_mem_and_residency_refuse_hostile_values() {
    let cmds: [&[&str]; 4] = [&["run", "missing.thin", "--prompt", "x"], &["bench", "missing.thin"], &["plan", "missing.thin"], &["logits", "missing.thin", "--ids", "x.json", "--prompt-len", "1", "-o", "y.f32"]];
    for cmd in cmds {
        for bad in ["0", "0GiB", "-3", "1e400GiB", "4QB", "1.2.3G", "", "18446744073709551616", "17179869184GiB", "NaN", "inf"] {
            let mut args = cmd.to_vec();
            let flag = format!("--gpu-mem={bad}");
            args.push(&flag);
            let o = thin(&args);
            let err = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(2), "{cmd:?} {flag}: {err}");
            assert!(err.contains("--gpu-mem"), "{cmd:?} {flag}: {err}");
        }
        for bad in ["", "bogus", "ALL", "streaming"] {
            let mut args = cmd.to_vec();
            let flag = format!("--residency={bad}");
            args.push(&flag);
            let o = thin(&args);
            let err = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(2), "{cmd:?} {flag}: {err}");
            assert!(err.contains("--residency") && err.contains("all, stream, auto or hybrid"), "{cmd:?} {flag}: {err}");
        }
    }
    // plan's rates: a positive, finite number of GB/s.
    for flag in ["--link-gb-s", "--host-gb-s"] {
        for bad in ["0", "-1", "NaN", "inf", "", "50GB/s", "1e400"] {
            let arg = format!("{flag}={bad}");
            let o = thin(&["plan", "missing.thin", &arg]);
            let err = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(2), "{arg}: {err}");
            assert!(err.contains(flag) && err.contains("not a positive number of GB/s"), "{arg}: {err}");
        }
    }
}

// The real decode and prefill schedules of every CUDA arch compiled into the tests can stage any
// set of layers through the ring: each layer's matrices are read in one run of steps, layers in
// order, so a ring of two (and even of one) never overwrites a slot in use.
#[test]
fn every_compiled_schedule_admits_the_ring() {
    let mut checked = Vec::new();
    for k in thin_generated::KNOWN_ARCHS {
        let Some(Ok(arch)) = thin_generated::cuda_arch(k.fingerprint) else { continue };
        let n = arch.dims.num_layers as u32;
        for streamed in [(0..n).collect::<Vec<u32>>(), (n / 2..n).collect(), vec![n - 1]] {
            for slots in [1, 2] {
                thin::check_ring_order(&arch, &streamed, slots).unwrap_or_else(|e| panic!("{}: {streamed:?} through {slots}: {e}", k.name));
            }
        }
        let decode: Vec<Vec<_>> = arch.schedule.decode.iter().map(|l| l.weights().collect()).collect();
        let uses = thin_core::cuda::plan::ring_uses(&decode, &(0..n).collect::<Vec<_>>(), 2).expect("uses");
        assert!(uses.windows(2).all(|w| w[0].last < w[1].first), "{}: layers read one after another", k.name);
        assert!(arch.schedule.epilogue.iter().flat_map(|l| l.weights()).all(|(r, l)| l.is_none() || r.is_norm()), "{}: the epilogue reads no layer's matrices", k.name);
        checked.push(k.name);
    }
    assert!(checked.contains(&"gemma3-tiny") && checked.contains(&"smollm2-135m"), "{checked:?}");
}

// llama-tiny under --residency hybrid (numbers as in plan_json_of_llama_tiny: layers of 73728
// bytes, KV 32768 a layer at ctx 256). With one byte less than all resident, one layer leaves the
// device: streaming it would need a ring slot as large as the layer (no saving), so it goes to the
// CPU, and its 32768 bytes of KV with it. With the link at 1 GB/s and the CPU at 2, the bound is
// the CPU's 2e9 / 73728 = 27126.6 tok/s.
#[test]
fn plan_hybrid_of_llama_tiny() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let a = convert("llama-tiny", tmp.path());
    let (_, all) = plan_json(&a, &["--gpu-mem", "1GiB"]);
    let all_bytes = all["all_resident_bytes"].as_u64().expect("all resident");
    let budget = format!("{}", all_bytes - 1);
    let (o, v) = plan_json(&a, &["--gpu-mem", &budget, "--residency", "hybrid", "--link-gb-s", "1", "--host-gb-s", "2"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!((v["decision"].as_str(), v["residency"].as_str()), (Some("hybrid"), Some("hybrid")));
    assert_eq!((v["resident_layers"].clone(), v["host_layers"].clone(), v["streamed_layers"].clone()), (serde_json::json!([0]), serde_json::json!([1]), serde_json::json!([])));
    assert_eq!((v["host_bytes_per_token"].as_u64(), v["kv_bytes"].as_u64(), v["host_kv_bytes"].as_u64()), (Some(73728), Some(32768), Some(2 * 32768)));
    assert_eq!(v["device_bytes"].as_u64(), Some(all_bytes - 73728 - 32768));
    assert_eq!((v["host_rate"]["gb_s"].as_f64(), v["host_rate"]["source"].as_str()), (Some(2.0), Some("given")));
    assert!((v["bound_tok_s"].as_f64().expect("bound") - 2e9 / 73728.0).abs() < 1e-6, "{}", v["bound_tok_s"]);
    let placed: Vec<&str> = v["tensors"].as_array().expect("tensors").iter().filter(|t| t["layer"] == 1).map(|t| t["placement"].as_str().expect("placement")).collect();
    assert!(placed.contains(&"host") && placed.contains(&"resident"), "layer 1's matrices on the host, its norms resident: {placed:?}");
    // The table says the same; the CPU rate measured here when none is given.
    let o = thin(&["plan", a.to_str().expect("utf8"), "--gpu-mem", &budget, "--residency", "hybrid"]);
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && table.contains("1 of 2 layers on the CPU (layers 1;") && table.contains("measured"), "{table}");
    // Below every layer on the CPU: refused with that smallest budget.
    let least = all_bytes - 2 * 73728 - 2 * 32768;
    let (o, v) = plan_json(&a, &["--gpu-mem", &format!("{}", least - 1), "--residency", "hybrid", "--host-gb-s", "2"]);
    assert!(!o.status.success() && v["fits"] == false, "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(v["min_stream_bytes"].as_u64(), Some(least));
    assert!(String::from_utf8_lossy(&o.stderr).contains("every layer on the CPU"), "{}", String::from_utf8_lossy(&o.stderr));
}
