//! `thin run` end to end on the tiny HF fixtures (`thin convert --profile f32` → `thin run`): JSON
//! lines parsed line by line, greedy ids equal transformers' (tests/fixtures/tiny/*/reference.json)
//! and the engine's own argmax, seeded sampling, `--chat`, engine selection errors, bad input.
//!
//! The binary needs the tiny arch features: the root package's dev-dependency on thin-generated
//! enables them, and cargo (resolver 2) builds the `thin` binary that integration tests run with
//! the dev-dependency features unified in. `engines_are_compiled_in` checks that this holds.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;
use thin_core::engine::Engine;
use thin_core::format::{Archive, ArchiveWriter};
use thin_core::sampler::argmax;
use thin_core::tokenizer::{ChatMessage, TextTokenizer};

const FAMILIES: [&str; 4] = ["llama-tiny", "smollm3-tiny", "gemma3-tiny", "olmoe-tiny"];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn thin(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_thin")).args(args).env("RAYON_NUM_THREADS", "2").output().expect("run thin")
}

fn utf8(p: &Path) -> &str {
    p.to_str().expect("utf8 path")
}

/// `thin convert tests/fixtures/tiny/<name> --profile f32` into `dir`.
fn convert(name: &str, dir: &Path) -> PathBuf {
    let src = repo().join("tests/fixtures/tiny").join(name);
    assert!(src.join("config.json").is_file(), "fixture {} is missing from the checkout", src.display());
    let out = dir.join(format!("{name}.thin"));
    let o = thin(&["convert", utf8(&src), "-o", utf8(&out), "--profile", "f32", "--quiet"]);
    assert!(o.status.success(), "convert {name}: {}", String::from_utf8_lossy(&o.stderr));
    out
}

struct Reference {
    prompt_ids: Vec<u32>,
    greedy_ids: Vec<u32>,
}

fn reference(name: &str) -> Reference {
    let p = repo().join("tests/fixtures/tiny").join(name).join("reference.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(p).expect("reference.json")).expect("json");
    let ids = |k: &str| -> Vec<u32> { v[k].as_array().expect(k).iter().map(|x| x.as_u64().expect("id") as u32).collect() };
    // decode_ids are transformers' argmax after the prefill and after each decode step (greedy).
    Reference { prompt_ids: ids("prompt_ids"), greedy_ids: ids("decode_ids") }
}

/// One `thin run --format jsonl`, every line parsed: prompt ids, (id, text) per token, stats.
struct Jsonl {
    prompt_ids: Vec<u32>,
    tokens: Vec<(u32, String)>,
    stats: Value,
}

impl Jsonl {
    fn ids(&self) -> Vec<u32> {
        self.tokens.iter().map(|t| t.0).collect()
    }
}

fn run_jsonl(archive: &Path, extra: &[&str]) -> Jsonl {
    let mut args = vec!["run", utf8(archive), "--format", "jsonl"];
    args.extend_from_slice(extra);
    let o = thin(&args);
    assert!(o.status.success(), "thin {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8(o.stdout).expect("stdout is utf8");
    let lines: Vec<Value> =
        text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l:?}: {e}"))).collect();
    assert!(lines.len() >= 2, "{text}");
    let ids = |v: &Value| -> Vec<u32> { v.as_array().expect("ids").iter().map(|x| x.as_u64().expect("id") as u32).collect() };
    let first = &lines[0];
    assert_eq!(first.as_object().map(|o| o.len()), Some(1), "first line is only prompt_ids: {first}");
    let prompt_ids = ids(&first["prompt_ids"]);
    let tokens = lines[1..lines.len() - 1]
        .iter()
        .map(|l| {
            assert_eq!(l.as_object().map(|o| o.len()), Some(2), "token line: {l}");
            (l["id"].as_u64().expect("id") as u32, l["text"].as_str().expect("text").to_string())
        })
        .collect::<Vec<_>>();
    let stats = lines[lines.len() - 1].clone();
    for k in ["prompt_tokens", "generated_tokens", "prompt_tok_s", "gen_tok_s", "stop"] {
        assert!(stats.get(k).is_some(), "stats lack {k}: {stats}");
    }
    assert_eq!(stats["prompt_tokens"].as_u64(), Some(prompt_ids.len() as u64));
    assert_eq!(stats["generated_tokens"].as_u64(), Some(tokens.len() as u64));
    Jsonl { prompt_ids, tokens, stats }
}

fn ids_arg(ids: &[u32]) -> String {
    ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",")
}

fn compiled() -> Vec<&'static str> {
    thin_generated::CPU_ENGINES.iter().map(|e| e.arch).collect()
}

#[test]
fn engines_are_compiled_in() {
    // The test build of thin-generated is the one the `thin` binary links (features unified).
    for f in FAMILIES {
        assert!(compiled().contains(&f), "{f} is not compiled in: {:?}", compiled());
    }
}

#[test]
fn greedy_ids_equal_transformers_on_every_family() {
    let tmp = tempfile::tempdir().expect("tempdir");
    for name in FAMILIES {
        let a = convert(name, tmp.path());
        let r = reference(name);
        let n = r.greedy_ids.len().to_string();
        let out = run_jsonl(&a, &["--prompt-ids", &ids_arg(&r.prompt_ids), "--max-tokens", &n]);
        assert_eq!(out.prompt_ids, r.prompt_ids, "{name}");
        assert_eq!(out.ids(), r.greedy_ids, "{name}: greedy ids vs transformers");
        assert_eq!(out.stats["stop"], "max_tokens", "{name}");
        assert_eq!(out.stats["arch"], name);
    }
}

#[test]
fn text_prompt_ids_are_the_tokenizers_and_ids_the_engines_argmax() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let a = convert("llama-tiny", tmp.path());
    let prompt = "The quick brown fox";
    let out = run_jsonl(&a, &["--prompt", prompt, "--max-tokens", "12"]);

    let archive = Archive::open(&a).expect("open");
    let tok = TextTokenizer::from_info(&archive.manifest().tokenizer).expect("tokenizer");
    let want_prompt = tok.encode(prompt).expect("encode");
    assert_eq!(out.prompt_ids, want_prompt);

    let mut engine = thin_generated::llama_tiny::Engine::new(archive).expect("bind the weights");
    let mut id = argmax(engine.prefill(&want_prompt).expect("prefill"));
    let mut want = Vec::new();
    loop {
        want.push(id);
        if tok.is_eos(id) || want.len() == 12 {
            break;
        }
        id = argmax(engine.decode_step(id).expect("decode"));
    }
    assert_eq!(out.ids(), want);
    let stop = if tok.is_eos(*want.last().expect("a token")) { "eos" } else { "max_tokens" };
    assert_eq!(out.stats["stop"], stop);

    // Text mode streams the same pieces; the stats go to stderr.
    let o = thin(&["run", utf8(&a), "--prompt", prompt, "--max-tokens", "12"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let pieces: String = out.tokens.iter().map(|t| t.1.as_str()).collect();
    assert_eq!(String::from_utf8_lossy(&o.stdout), pieces + "\n");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("prompt:") && err.contains("generation:") && err.contains("tok/s"), "{err}");
}

#[test]
fn seeded_sampling_is_reproducible() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let a = convert("olmoe-tiny", tmp.path());
    let ids = ids_arg(&reference("olmoe-tiny").prompt_ids);
    let sample = |seed: &str| {
        run_jsonl(&a, &["--prompt-ids", &ids, "--max-tokens", "24", "--temperature", "1.0", "--top-k", "40", "--top-p", "0.95", "--seed", seed])
            .ids()
    };
    let (a1, a2, b) = (sample("1"), sample("1"), sample("2"));
    assert_eq!(a1.len(), 24);
    assert_eq!(a1, a2, "same seed, same tokens");
    assert_ne!(a1, b, "different seeds gave the same 24 tokens");
    let greedy = run_jsonl(&a, &["--prompt-ids", &ids, "--max-tokens", "24", "--temperature", "0", "--seed", "5"]).ids();
    assert_eq!(greedy, run_jsonl(&a, &["--prompt-ids", &ids, "--max-tokens", "24"]).ids(), "temperature 0 is greedy");
}

#[test]
fn chat_renders_the_archives_template() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let a = convert("llama-tiny", tmp.path());
    let out = run_jsonl(&a, &["--chat", "--prompt", "hi there", "--max-tokens", "4"]);
    let archive = Archive::open(&a).expect("open");
    let tok = TextTokenizer::from_info(&archive.manifest().tokenizer).expect("tokenizer");
    let rendered = tok.render_chat(&[ChatMessage { role: "user".into(), content: "hi there".into() }]).expect("template");
    assert!(rendered.contains("<user>hi there"), "{rendered}");
    assert_eq!(out.prompt_ids, tok.encode(&rendered).expect("encode"));
    assert_eq!(out.tokens.len(), 4);
}

/// Rewrites `src` with `arch` changed: an archive that claims other shapes. Its tensors are the
/// source's (layer 0's repeated when there are more layers): only engine selection reads it.
fn with_arch(src: &Path, out: &Path, change: impl FnOnce(&mut thin_core::arch::ArchConfig)) {
    let a = Archive::open(src).expect("open");
    let mut m = a.manifest().clone();
    change(&mut m.arch);
    m.shape_fingerprint = m.arch.shape_fingerprint();
    let mut w = ArchiveWriter::create(out).expect("create");
    for t in &a.manifest().tensors {
        w.add_tensor(t.clone(), a.tensor_bytes(t).expect("bytes")).expect("add");
    }
    for l in a.manifest().arch.dims.num_layers..m.arch.dims.num_layers {
        for t in a.manifest().tensors.iter().filter(|t| t.layer == Some(0)) {
            let mut e = t.clone();
            e.layer = Some(l as u32);
            e.name = e.role.tensor_name(e.layer);
            w.add_tensor(e, a.tensor_bytes(t).expect("bytes")).expect("add");
        }
    }
    w.finish(m).expect("finish");
}

fn run_fails(archive: &Path, extra: &[&str]) -> String {
    let mut args = vec!["run", utf8(archive)];
    args.extend_from_slice(extra);
    let o = thin(&args);
    assert_eq!(o.status.code(), Some(1), "thin {args:?} should fail: {}", String::from_utf8_lossy(&o.stdout));
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(err.lines().any(|l| l.starts_with("error: ")) && !err.contains("panicked"), "{err}");
    err
}

#[test]
fn arch_mismatch_names_both_archs_and_fingerprints() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let tiny = convert("llama-tiny", tmp.path());

    // An archive with llama3.2-1b's shapes, which this build has no engine for.
    let big = tmp.path().join("llama3.2-1b.thin");
    with_arch(&tiny, &big, |a| {
        (a.dims.vocab_size, a.dims.hidden_size, a.dims.num_layers, a.dims.num_heads, a.dims.num_kv_heads) = (128256, 2048, 16, 32, 8);
        (a.dims.head_dim, a.dims.intermediate_size, a.dims.tie_word_embeddings) = (64, 8192, true);
    });
    let known = thin_generated::KNOWN_ARCHS.iter().find(|k| k.name == "llama3.2-1b").expect("known");
    assert_eq!(Archive::open(&big).expect("open").manifest().shape_fingerprint, known.fingerprint, "dims of llama3.2-1b");
    assert!(!compiled().contains(&"llama3.2-1b"), "this test needs a build without llama3.2-1b");
    let err = run_fails(&big, &["--prompt", "hi"]);
    assert!(err.contains("the archive is llama3.2-1b") && err.contains("llama-tiny"), "{err}");
    assert!(err.contains("--features llama3.2-1b"), "{err}");

    // Llama-family shapes that no description has: both fingerprints are named.
    let odd = tmp.path().join("odd.thin");
    with_arch(&tiny, &odd, |a| a.dims.intermediate_size = 96);
    let odd_fp = Archive::open(&odd).expect("open").manifest().shape_fingerprint.clone();
    let err = run_fails(&odd, &["--prompt", "hi"]);
    assert!(err.contains(&odd_fp) && err.contains(thin_generated::llama_tiny::SHAPE_FINGERPRINT), "{err}");
}

#[test]
fn math_constants_are_checked_at_open() {
    let tmp = tempfile::tempdir().expect("tempdir");
    type Change = fn(&mut thin_core::arch::ArchConfig);
    // Per fixture: one constant the converter recorded, changed; the shapes stay those of the engine.
    let cases: [(&str, Change, &str); 8] = [
        ("llama-tiny", |a| a.rope.theta = 100000.0, "rope theta: the archive has 100000, the engine 10000"),
        ("llama-tiny", |a| a.rms_norm_eps = 1e-5, "rms norm eps: the archive has 0.00001, the engine 0.000001"),
        // (An archive with no scaling recorded is not compared on it: see MathConstants::mismatches.)
        ("llama-tiny", |a| a.rope.scaling.as_mut().map_or((), |s| s.factor = 32.0), "rope scaling factor: the archive has 32, the engine 8"),
        ("smollm3-tiny", |a| a.no_rope_layers = vec![], "layers without rope: the archive has [], the engine [3]"),
        ("gemma3-tiny", |a| a.sliding_window = Some(8), "sliding window: the archive has 8, the engine 4"),
        ("gemma3-tiny", |a| a.rope.local_theta = Some(20000.0), "rope local theta: the archive has 20000, the engine 10000"),
        ("gemma3-tiny", |a| a.final_logit_softcap = Some(30.0), "final logit softcap: the archive has 30, the engine none"),
        ("olmoe-tiny", |a| a.attn_logit_softcap = Some(50.0), "attention logit softcap: the archive has 50, the engine none"),
    ];
    for name in FAMILIES {
        let a = convert(name, tmp.path());
        let archive = std::sync::Arc::new(Archive::open(&a).expect("open"));
        assert!(thin_generated::open_cpu(archive.clone()).is_ok(), "{name}: the converted fixture opens");
        thin_core::engine::check_known_math(archive.manifest(), thin_generated::KNOWN_ARCHS).expect(name);
    }
    for (i, (name, change, want)) in cases.into_iter().enumerate() {
        let bad = tmp.path().join(format!("{name}-{i}.thin"));
        with_arch(&tmp.path().join(format!("{name}.thin")), &bad, change);
        let archive = std::sync::Arc::new(Archive::open(&bad).expect("open"));
        let e = thin_generated::open_cpu(archive.clone()).err().unwrap_or_else(|| panic!("{want}: opened"));
        assert!(matches!(e, thin_core::engine::OpenError::MathConstants { .. }), "{e}");
        assert!(e.to_string().contains(want) && e.to_string().contains(name), "{e}");
        let e = thin_core::engine::check_known_math(archive.manifest(), thin_generated::KNOWN_ARCHS).expect_err(want);
        assert!(e.to_string().contains(want), "{e}");
    }
    // Through the CLI: the error line names the constant and both values.
    let err = run_fails(&tmp.path().join("llama-tiny-0.thin"), &["--prompt", "hi"]);
    assert!(err.contains("rope theta: the archive has 100000, the engine 10000"), "{err}");
}

#[test]
fn bad_input_is_a_clear_error() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let a = convert("llama-tiny", tmp.path());
    assert!(run_fails(&a, &["--prompt", ""]).contains("empty"));
    assert!(run_fails(&a, &["--prompt-ids", "1,999"]).contains("outside the vocabulary"));
    // Sampling flags are refused as clap parses them (a usage error: rc 2), with their range,
    // negative ones too (no `-- -1` advice).
    for (flag, value, range) in [
        ("--top-p", "0", "(0, 1]"),
        ("--top-p", "1.5", "(0, 1]"),
        ("--temperature", "-1", ">= 0"),
        ("--temperature", "nan", ">= 0"),
        ("--top-k", "-1", "whole number >= 0"),
    ] {
        let o = thin(&["run", utf8(&a), "--prompt", "x", flag, value]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{flag} {value}: {err}");
        assert!(err.starts_with("error: ") && err.contains(flag) && err.contains(range) && !err.contains("-- -"), "{flag} {value}: {err}");
    }
    // llama-tiny's context is 256 positions.
    let long = ids_arg(&vec![5u32; 300]);
    assert!(run_fails(&a, &["--prompt-ids", &long]).contains("max_seq 256"));
    let missing = tmp.path().join("nope.thin");
    assert!(run_fails(&missing, &["--prompt", "x"]).contains("nope.thin"));
    let not_an_archive = tmp.path().join("junk.thin");
    std::fs::write(&not_an_archive, b"not a thin archive").expect("write");
    assert!(run_fails(&not_an_archive, &["--prompt", "x"]).contains("junk.thin"));

    // Generation that reaches the end of the context stops there and says so.
    let near_full = ids_arg(&vec![5u32; 250]);
    let out = run_jsonl(&a, &["--prompt-ids", &near_full, "--max-tokens", "20"]);
    assert_eq!(out.stats["stop"], "max_seq");
    assert_eq!(out.tokens.len(), 7, "positions 250..256 plus the last sampled token");
}

/// One archive of two storage types (`--profile bf16-f32edges`: the embedding and the first and
/// last layers' matrices f32, the rest bf16) runs on the CPU engine, each tensor read as stored;
/// its logits sit between the f32 archive's and the all-bf16 one's.
#[test]
fn an_archive_of_f32_and_bf16_tensors_runs() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let src = repo().join("tests/fixtures/tiny/smollm3-tiny");
    let logits = |profile: &str| -> Vec<f32> {
        let a = tmp.path().join(format!("{profile}.thin"));
        let o = thin(&["convert", utf8(&src), "-o", utf8(&a), "--profile", profile, "--quiet"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let archive = Archive::open(&a).expect("open");
        let m = archive.manifest();
        if profile == "bf16-f32edges" {
            let dtype = |r, l| m.tensor(r, l).expect("tensor").dtype;
            use thin_core::{dtype::DType, role::Role};
            assert_eq!((dtype(Role::TokenEmbd, None), dtype(Role::AttnQ, Some(0)), dtype(Role::AttnQ, Some(3))), (DType::F32, DType::F32, DType::F32));
            assert_eq!((dtype(Role::AttnQ, Some(1)), dtype(Role::FfnDown, Some(2))), (DType::Bf16, DType::Bf16));
        }
        let mut e = thin_generated::smollm3_tiny::Engine::new(archive).expect("bind the weights");
        let mut out = e.prefill(&[1, 7, 42, 255, 3]).expect("prefill").to_vec();
        for t in [9u32, 100, 2] {
            out.extend_from_slice(e.decode_step(t).expect("decode"));
        }
        out
    };
    let (f32, bf16, mixed) = (logits("f32"), logits("bf16"), logits("bf16-f32edges"));
    let dist = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
    let (d_bf16, d_mixed) = (dist(&bf16, &f32), dist(&mixed, &f32));
    assert!(d_mixed > 0.0 && d_mixed < d_bf16, "max |Δ| from the f32 archive: mixed {d_mixed}, bf16 {d_bf16}");
}

/// `--residency hybrid` computes some layers on the CPU engine one at a time
/// (`thin_core::engine::HostLayers`): each tiny family's engine run layer by layer (the prompt
/// through `layer_prompt`, then a decode step through `layer_step`), from the embedding, leaves
/// the residual stream bit for bit where the whole engine's own prefill and decode step leave it.
/// Bad layer indices and row shapes are typed errors.
#[test]
fn host_layers_equal_the_whole_engine() {
    use thin_core::engine::{EngineError, HostLayers, Weights};
    use thin_core::role::Role;
    let tmp = tempfile::tempdir().expect("tempdir");
    let prompt = [1u32, 7, 42, 200, 3];
    let next = 9u32;
    macro_rules! check {
        ($m:ident, $math:ident, $name:expr) => {{
            let path = convert($name, tmp.path());
            let open = || Archive::open(&path).expect("open");
            let mut whole = thin_generated::$m::Engine::new(open()).expect("bind");
            whole.prefill(&prompt).expect("prefill");
            let after_prompt = whole.residual().to_vec();
            whole.decode_step(next).expect("decode");
            let after_step = whole.residual().to_vec();

            let archive = open();
            let hidden = archive.manifest().arch.dims.hidden_size as usize;
            let table = archive.at(archive.find(Role::TokenEmbd, None).expect("embedding"));
            let scale = thin_generated::$math.embedding_scale as f32;
            let embed = |t: u32, out: &mut [f32]| thin_core::cpu::embedding(table, t as usize, hidden, scale, out);
            let mut layers = thin_generated::$m::Engine::new(open()).expect("bind");
            let n = HostLayers::num_layers(&layers);
            let mut rows = vec![0f32; prompt.len() * hidden];
            for (t, row) in prompt.iter().zip(rows.chunks_exact_mut(hidden)) {
                embed(*t, row);
            }
            for l in 0..n {
                layers.layer_prompt(l, &mut rows, 0).expect("a prompt layer");
            }
            let last = &rows[(prompt.len() - 1) * hidden..];
            assert!(last.iter().zip(&after_prompt).all(|(a, b)| a.to_bits() == b.to_bits()), "{}: the prompt's last row differs", $name);
            let mut x = vec![0f32; hidden];
            embed(next, &mut x);
            for l in 0..n {
                layers.layer_step(l, &mut x, prompt.len()).expect("a decode layer");
            }
            assert!(x.iter().zip(&after_step).all(|(a, b)| a.to_bits() == b.to_bits()), "{}: the decode step's residual differs", $name);
            assert!(matches!(layers.layer_step(n, &mut x, 0), Err(EngineError::NoSuchLayer { layer, layers }) if layer == n && layers == n));
            assert!(matches!(layers.layer_step(0, &mut x[..hidden - 1], 0), Err(EngineError::RowShape { .. })));
            assert!(matches!(layers.layer_prompt(0, &mut rows[..hidden + 1], 0), Err(EngineError::RowShape { .. })));
            assert!(matches!(layers.layer_step(0, &mut x, layers.max_seq()), Err(EngineError::ContextFull { .. })));
            n
        }};
    }
    let counted = [
        check!(llama_tiny, LLAMA_TINY_MATH, "llama-tiny"),
        check!(smollm3_tiny, SMOLLM3_TINY_MATH, "smollm3-tiny"),
        check!(gemma3_tiny, GEMMA3_TINY_MATH, "gemma3-tiny"),
        check!(olmoe_tiny, OLMOE_TINY_MATH, "olmoe-tiny"),
    ];
    assert!(counted.iter().all(|&n| n >= 2), "{counted:?}");
}
