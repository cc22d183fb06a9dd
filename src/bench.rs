//! `thin bench` (the reference decode method and a llama-bench style pp/tg table) and `thin logits`
//! (teacher-forced logits for fidelity checks against another engine).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use serde_json::json;
use thin_core::sampler::argmax;

fn mean_sd(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    let m = xs.iter().sum::<f64>() / n;
    let var = if xs.len() > 1 { xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0) } else { 0.0 };
    (m, var.sqrt())
}

/// The buffer the CPU memory-bandwidth probe streams: far larger than any L3.
const MEMORY_PROBE_BYTES: usize = 512 << 20;

pub struct BenchOptions {
    pub backend: thin::Backend,
    pub ctx: usize,
    pub warmup: usize,
    pub steps: usize,
    pub pp: usize,
    pub tg: usize,
    pub reps: usize,
    pub json: bool,
    pub profile: bool,
    pub timeline: bool,
    /// `--no-verify`: skip the page check at load (said once on stderr).
    pub no_verify: bool,
    /// `--gpu-mem`: the most device memory the engine may take.
    pub gpu_mem: Option<u64>,
    /// `--residency`.
    pub residency: thin::Residency,
}

/// Prompt ids for a pp run: deterministic, spread over the vocabulary, no special meaning.
fn synthetic_prompt(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i as u64 * 7919 + 13) % vocab as u64) as u32).collect()
}

pub fn bench(file: &Path, opts: &BenchOptions) -> anyhow::Result<()> {
    let start = Instant::now();
    let integrity = if opts.no_verify {
        eprintln!("--no-verify: the pages of {} are not checked against their blake3", file.display());
        thin::Integrity::Trust
    } else {
        thin::Integrity::Verify
    };
    let mut session = thin::open_with(file, &thin::Options { backend: opts.backend, ctx: Some(opts.ctx), progress: !opts.json, timeline: opts.timeline, gpu_mem: opts.gpu_mem, residency: opts.residency }, integrity)
        .with_context(|| format!("opening {}", file.display()))?;
    let m = session.archive().manifest();
    let vocab = m.arch.dims.vocab_size as usize;
    // The quantization profile the archive was converted with (bf16, fp8, mxfp4, a file's stem).
    let profile = m.quantization.method.clone();
    let weight_bytes_per_token = m.weight_bytes_per_token();
    let (name, backend) = (session.arch(), session.backend());
    // The CPU engine's thread count (`--threads`); the GPU's host side runs on one.
    let threads = (backend == "cpu").then(thin_core::cpu::threads);
    let hello = session.prompt("Hello", false).context("encoding the prompt")?;
    // The residency plan the CUDA engine opened with, without its per-tensor list.
    let plan = session.residency().map(|p| {
        let mut v = serde_json::to_value(p).unwrap_or_default();
        if let Some(o) = v.as_object_mut() {
            o.remove("tensors");
        }
        v
    });
    let e = session.engine();
    // Cold start to first token: open + compile/cache + upload + capture + the first prefill.
    let mut next = argmax(e.prefill(&hello)?);
    let first_token_s = start.elapsed().as_secs_f64();

    // (a) the reference method: prefill "Hello", warm up, time greedy decode steps.
    for _ in 0..opts.warmup {
        next = e.greedy(next)?;
    }
    let t = Instant::now();
    for _ in 0..opts.steps {
        next = e.greedy(next)?;
    }
    let decode_tok_s = opts.steps as f64 / t.elapsed().as_secs_f64();
    // At the reference method's position (a short cache), before pp/tg reset it.
    let kernels = if opts.profile { Some(e.profile(50)?) } else { None };
    // The kernels' costs inside the step, from the same position on (stamped kernels: --timeline).
    let timeline = if opts.timeline { Some(e.timeline(50)?) } else { None };

    // (b) llama-bench style: pp (prompt of `pp` tokens from an empty cache) and tg (greedy tokens
    // after a one-token prompt), each repeated.
    let prompt = synthetic_prompt(opts.pp, vocab);
    // One untimed pass first, as llama-bench does: the first prefill pays cuBLAS's first-call setup.
    e.reset();
    std::hint::black_box(e.prefill(&prompt)?);
    let (mut pp, mut tg) = (Vec::new(), Vec::new());
    for _ in 0..opts.reps {
        e.reset();
        let t = Instant::now();
        std::hint::black_box(e.prefill(&prompt)?);
        pp.push(opts.pp as f64 / t.elapsed().as_secs_f64());
        e.reset();
        let mut n = argmax(e.prefill(&prompt[..1])?);
        let t = Instant::now();
        for _ in 0..opts.tg {
            n = e.greedy(n)?;
        }
        tg.push(opts.tg as f64 / t.elapsed().as_secs_f64());
    }
    let (pp_m, pp_sd) = mean_sd(&pp);
    let (tg_m, tg_sd) = mean_sd(&tg);
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    // peak_gib: what the driver says the engine added (its buffers, module, graph, cuBLAS
    // workspace), read after every timed run (nothing is freed before the engine drops);
    // held_gib: its own buffers alone.
    // On the CPU: the rate the decode reads its weights at, against what the machine streams on
    // the same threads, measured now (the same background load as the runs above).
    let decode_gb_s = weight_bytes_per_token as f64 * decode_tok_s / 1e9;
    let memory_gb_s = threads.map(|_| thin_core::cpu::read_bandwidth_gb_s(MEMORY_PROBE_BYTES, 5));
    let held = e.device_bytes().map(gib);
    let peak = e.measured_device_bytes().map(gib);
    // The profile's roofline: weight bytes read per token over the copy rate, measured after the
    // peak was read (its buffers are freed again).
    let copy = e.copy_rate_gb_s();
    let roofline = copy.map(|c| c * 1e9 / weight_bytes_per_token as f64);
    // Streaming: the host link measured now with the engine's own copies, and the decode rate
    // against the bound it sets (streamed bytes a token over that rate).
    let streamed_bytes = plan_u64(plan.as_ref(), "streamed_bytes_per_token");
    let link_gbps = if streamed_bytes > 0 { e.host_link_gb_s() } else { None };
    let link_bound = link_gbps.map(|g| g * 1e9 / streamed_bytes as f64);
    // Hybrid: the CPU engine's layers beside the streamed ones. The CPU's rate is the one the plan
    // measured at load; the link's is measured now. The step takes the longer of the two.
    let host_bytes = plan_u64(plan.as_ref(), "host_bytes_per_token");
    let host_gb_s = plan.as_ref().and_then(|p| p["host_rate"]["gb_s"].as_f64()).filter(|_| host_bytes > 0);
    let hybrid_bound = host_gb_s.map(|h| {
        let link_s = link_gbps.map_or(0.0, |g| streamed_bytes as f64 / (g * 1e9));
        1.0 / link_s.max(host_bytes as f64 / (h * 1e9))
    });
    let rec = json!({
        "model": name,
        "profile": profile,
        "engine": "thin",
        "backend": backend,
        "threads": threads,
        "decode_tok_s": (decode_tok_s * 100.0).round() / 100.0,
        "decode_method": format!("prefill \"Hello\" ({} ids), {} warm-up, {} timed greedy steps", hello.len(), opts.warmup, opts.steps),
        "prefill_tok_s": (pp_m * 100.0).round() / 100.0,
        "pp": {"n": opts.pp, "mean": pp_m, "sd": pp_sd, "reps": pp},
        "tg": {"n": opts.tg, "mean": tg_m, "sd": tg_sd, "reps": tg},
        "weight_bytes_per_token": weight_bytes_per_token,
        "decode_gb_s": (decode_gb_s * 100.0).round() / 100.0,
        "memory_gb_s": memory_gb_s.map(|g| (g * 100.0).round() / 100.0),
        "memory_method": memory_gb_s.map(|_| format!("best of 5 parallel reads of a {} MiB buffer", MEMORY_PROBE_BYTES >> 20)),
        "copy_gb_s": copy,
        "roofline_tok_s": roofline,
        "roofline_pct": roofline.map(|r| (1000.0 * decode_tok_s / r).round() / 10.0),
        "peak_gib": peak,
        "peak_method": "cuMemGetInfo used at the end minus used once the CUDA context existed",
        "held_gib": held,
        "cold_start_to_first_token_s": first_token_s,
        "pages_verified": !opts.no_verify,
        "load": e.load_stats(),
        "residency": plan.as_ref().and_then(|p| p.get("decision")).and_then(|d| d.as_str()).map(|d| if d == "stream" || d == "hybrid" { d } else { "all" }),
        "residency_flag": opts.residency.name(),
        "gpu_mem_limit": opts.gpu_mem,
        "streamed_bytes_per_token": streamed_bytes,
        "link_gbps": link_gbps,
        "link_bound_tok_s": link_bound,
        "link_bound_fraction": link_bound.map(|b| (1000.0 * decode_tok_s / b).round() / 1000.0),
        "host_bytes_per_token": host_bytes,
        "host_gb_s": host_gb_s,
        "hybrid_bound_tok_s": hybrid_bound,
        "hybrid_bound_fraction": hybrid_bound.map(|b| (1000.0 * decode_tok_s / b).round() / 1000.0),
        "plan": plan,
        "kernels": kernels,
        "timeline": timeline,
    });
    if opts.json {
        println!("{rec}");
    } else {
        let on = threads.map_or_else(String::new, |t| format!(", {t} CPU threads"));
        println!("{name} ({profile}){on}, reference method: {decode_tok_s:.1} tok/s decode");
        println!("| model | test | t/s |");
        println!("|---|---|---|");
        println!("| {} {} | pp{} | {:.1} ± {:.1} |", name, profile, opts.pp, pp_m, pp_sd);
        println!("| {} {} | tg{} | {:.1} ± {:.1} |", name, profile, opts.tg, tg_m, tg_sd);
        if let Some(mem) = memory_gb_s {
            println!("decode reads weights at {decode_gb_s:.1} GB/s, {:.0}% of the {mem:.1} GB/s this machine streams now", 100.0 * decode_gb_s / mem);
        }
        if let (Some(p), Some(h)) = (peak, held) {
            println!("device memory: peak {p:.3} GiB (driver count), buffers {h:.3} GiB; cold start to first token {first_token_s:.2} s");
        }
        if let (Some(g), Some(b)) = (link_gbps, link_bound) {
            println!("streaming {:.1} MiB a token over a {g:.1} GB/s host link: bound {b:.2} tok/s, decode at {:.0}% of it", streamed_bytes as f64 / (1u64 << 20) as f64, 100.0 * decode_tok_s / b);
        }
        if let Some(t) = &timeline {
            println!("in-step timeline over {} steps (start of the first kernel to start of the last: {:.1} µs)", t["steps"], t["first_to_last_start_us"].as_f64().unwrap_or(0.0));
            println!("| kernel | launches/step | µs/launch | µs/step |");
            println!("|---|---|---|---|");
            for r in t["kernels"].as_array().into_iter().flatten() {
                println!("| {} | {} | {:.2} | {:.1} |", r["kernel"].as_str().unwrap_or("?"), r["launches"], r["us_per_launch"].as_f64().unwrap_or(0.0), r["us_per_step"].as_f64().unwrap_or(0.0));
            }
        }
        if let Some(rows) = kernels.as_ref().and_then(|p| p.as_array()) {
            println!("| kernel | launches/step | µs/launch | µs/step | weight GB/s |");
            println!("|---|---|---|---|---|");
            for r in rows {
                let (n, us) = (r["launches"].as_u64().unwrap_or(0), r["us_per_launch"].as_f64().unwrap_or(0.0));
                let per_step = if r["kernel"] == "step" { us } else { us * n as f64 };
                println!("| {} | {} | {:.2} | {:.1} | {:.0} |", r["kernel"].as_str().unwrap_or("?"), n, us, per_step, r["weight_gb_s"].as_f64().unwrap_or(0.0));
            }
        }
    }
    Ok(())
}

/// A byte count of the plan (`streamed_bytes_per_token`, `host_bytes_per_token`): 0 when the
/// plan has none, or there is no plan (the CPU backend).
fn plan_u64(plan: Option<&serde_json::Value>, key: &str) -> u64 {
    plan.and_then(|p| p[key].as_u64()).unwrap_or(0)
}

/// Teacher-forced logits: prefill `ids[..prompt_len]`, then feed each following id; writes one
/// little-endian f32 row of `vocab` logits per position from `prompt_len - 1` to the end, from
/// the engine `opts` opens (the CUDA engine, placed as its `gpu_mem` and `residency` say, or the
/// CPU reference engine).
pub fn logits(file: &Path, ids_file: &Path, prompt_len: usize, out: &PathBuf, opts: &thin::Options) -> anyhow::Result<()> {
    let ids: Vec<u32> = serde_json::from_str(&std::fs::read_to_string(ids_file).with_context(|| format!("reading {}", ids_file.display()))?)
        .with_context(|| format!("{}: expected a JSON array of token ids", ids_file.display()))?;
    if prompt_len == 0 || prompt_len > ids.len() {
        bail!("--prompt-len {prompt_len} must be between 1 and the {} ids given", ids.len());
    }
    let mut session = thin::open(file, opts).with_context(|| format!("opening {}", file.display()))?;
    if let Some(p) = session.residency() {
        eprintln!("{}", p.one_line());
    }
    let e = session.engine();
    let tmp = out.with_extension("partial");
    let mut w = std::io::BufWriter::new(std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?);
    let mut put = |row: &[f32]| -> anyhow::Result<()> {
        for v in row {
            w.write_all(&v.to_le_bytes())?;
        }
        Ok(())
    };
    put(e.prefill(&ids[..prompt_len])?)?;
    for &t in &ids[prompt_len..] {
        put(e.decode_step(t)?)?;
    }
    drop(put);
    w.flush()?;
    drop(w);
    std::fs::rename(&tmp, out)?;
    eprintln!("wrote {} rows of logits to {}", ids.len() - prompt_len + 1, out.display());
    Ok(())
}
