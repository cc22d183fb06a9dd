//! The `thin` binary on hostile inputs (issue 24): what a file embeds for another library is
//! checked where it enters (convert, open), a library's panic is a typed error, any other panic
//! exits 70 with one line, never rc 101; declared counts that the tensors cannot back are refused
//! in milliseconds under a memory limit.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use thin_core::format::testkit::{rebuild, split};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn utf8(p: &Path) -> &str {
    p.to_str().expect("utf8 path")
}

fn thin(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_thin")).args(args).env("RAYON_NUM_THREADS", "2").output().expect("run thin")
}

/// `thin` under `prlimit --as=<bytes>` (address space; the binary maps its archive and reserves
/// thread stacks, so the limit is generous for a 2 MB archive and far below a runaway allocation).
fn thin_limited(args: &[&str], mem: u64) -> (Output, Duration) {
    let t = Instant::now();
    let o = Command::new("prlimit")
        .arg(format!("--as={mem}"))
        .arg(env!("CARGO_BIN_EXE_thin"))
        .args(args)
        .env("RAYON_NUM_THREADS", "2")
        .output()
        .expect("run prlimit thin");
    (o, t.elapsed())
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A typed error: rc 1, an `error: ` line, no panic text.
fn assert_typed_error(o: &Output, what: &str) -> String {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(1), "{what}: rc {:?}: {err}", o.status.code());
    assert!(err.lines().any(|l| l.starts_with("error: ")) && !err.contains("panicked") && !err.contains("internal error"), "{what}: {err}");
    err
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).expect("mkdir");
    for e in std::fs::read_dir(src).expect("read_dir") {
        let e = e.expect("entry");
        std::fs::copy(e.path(), dst.join(e.file_name())).expect("copy");
    }
}

fn convert_fixture(name: &str, out: &Path) {
    let src = repo().join("tests/fixtures/tiny").join(name);
    let o = thin(&["convert", utf8(&src), "-o", utf8(out), "--profile", "f32", "--quiet"]);
    assert!(o.status.success(), "convert {name}: {}", stderr(&o));
}

/// The tokenizer JSON with a `Strip` decoder whose `stop` runs past the one-character token
/// "a": `tokenizers` parses it and panics (subtract overflow / index out of bounds) when that
/// token is decoded.
fn strip_decoder(tokenizer_json: &str) -> String {
    let mut v: serde_json::Value = serde_json::from_str(tokenizer_json).expect("tokenizer json");
    v["decoder"] = serde_json::json!({"type": "Strip", "content": "a", "start": 0, "stop": 2});
    v.to_string()
}

/// Issue 24's reproducer: an archive whose embedded tokenizer JSON has a malformed decoder
/// section (manifest edited, header hash re-signed). Before: `verify` and `inspect` passed and
/// `run` died with rc 101 inside the tokenizer library. Now every command refuses it at open,
/// naming the part, and `convert` refuses such a tokenizer in a source directory.
#[test]
fn a_tokenizer_that_panics_its_library_is_refused_at_open_and_at_convert() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let good = tmp.path().join("good.thin");
    convert_fixture("llama-tiny", &good);
    let bytes = std::fs::read(&good).expect("read");
    let parts = split(&bytes);
    let mut m = parts.manifest.clone();
    let tj = m["tokenizer"]["tokenizer_json"].as_str().expect("tokenizer_json").to_string();
    m["tokenizer"]["tokenizer_json"] = serde_json::Value::String(strip_decoder(&tj));
    let bad = tmp.path().join("bad.thin");
    std::fs::write(&bad, rebuild(&bytes, &parts.header, &parts.pages, m.to_string().as_bytes())).expect("write");

    // (thin-core's tokenizer unit test shows the library itself panics on this JSON.)
    let want = "the embedded tokenizer.json crashed the tokenizers library while decoding 256 tokens";
    for args in [
        vec!["verify", utf8(&bad)],
        vec!["inspect", utf8(&bad)],
        vec!["run", utf8(&bad), "--prompt", "a", "--max-tokens", "1"],
        vec!["run", utf8(&bad), "--prompt-ids", "97", "--max-tokens", "1"],
    ] {
        let err = assert_typed_error(&thin(&args), &args.join(" "));
        assert!(err.contains(want) && err.contains("bad.thin"), "{args:?}: {err}");
    }
    assert!(thin(&["verify", utf8(&good)]).status.success());

    // The same tokenizer.json in an HF directory: convert refuses it and writes nothing.
    let dir = tmp.path().join("src");
    copy_dir(&repo().join("tests/fixtures/tiny/llama-tiny"), &dir);
    let tj = std::fs::read_to_string(dir.join("tokenizer.json")).expect("tokenizer.json");
    std::fs::write(dir.join("tokenizer.json"), strip_decoder(&tj)).expect("write");
    let out = tmp.path().join("from-src.thin");
    let err = assert_typed_error(&thin(&["convert", utf8(&dir), "-o", utf8(&out), "--quiet"]), "convert");
    assert!(err.contains(want), "{err}");
    assert!(std::fs::read_dir(tmp.path()).expect("ls").all(|e| !e.expect("e").file_name().to_string_lossy().starts_with("from-src")));
}

/// Any other panic, on the main thread or another, is one `internal error:` line and exit 70
/// (the switch that forces one exists in debug builds only).
#[cfg(debug_assertions)]
#[test]
fn a_panic_is_an_internal_error_with_exit_code_70() {
    for (which, at) in [("main", "src/main.rs"), ("thread", "src/main.rs")] {
        let o = Command::new(env!("CARGO_BIN_EXE_thin")).args(["verify", "nope.thin"]).env("THIN_TEST_PANIC", which).output().expect("run");
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(70), "{which}: {err}");
        assert!(err.starts_with(&format!("internal error: THIN_TEST_PANIC={which} at {at}:")), "{which}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
}

/// Address-space limit for the declared-count cases: the binary, its mapped input and a couple of
/// thread stacks fit; building a list for 2^31 layers (16+ GB) does not.
const MEM_LIMIT: u64 = 1 << 30;

/// Each case: `thin convert` (and `run` where the archive converts) under the memory limit,
/// a typed error naming the key within a second (the process starting included).
#[test]
fn declared_counts_past_the_tensors_are_refused_fast_in_bounded_memory() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let hf = |name: &str, case: &str, change: &dyn Fn(&mut serde_json::Value)| -> PathBuf {
        let dir = tmp.path().join(case);
        copy_dir(&repo().join("tests/fixtures/tiny").join(name), &dir);
        let p = dir.join("config.json");
        let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).expect("config")).expect("json");
        change(&mut v);
        std::fs::write(&p, v.to_string()).expect("write");
        dir
    };
    let big = |key: &'static str, v: u64| move |c: &mut serde_json::Value| c[key] = v.into();
    let mut cases: Vec<(String, PathBuf, &str)> = Vec::new();
    for name in ["llama-tiny", "smollm3-tiny", "gemma3-tiny"] {
        let dir = hf(name, &format!("{name}-layers"), &|c| {
            c["num_hidden_layers"] = (1u64 << 31).into();
            if let Some(o) = c.as_object_mut() {
                o.remove("layer_types");
                o.remove("no_rope_layers");
            }
        });
        cases.push((format!("{name} num_hidden_layers 2^31"), dir, "num_hidden_layers"));
    }
    for name in ["llama-tiny", "smollm3-tiny"] {
        let dir = hf(name, &format!("{name}-60000"), &|c| {
            c["num_hidden_layers"] = 60_000.into();
            if let Some(o) = c.as_object_mut() {
                o.remove("no_rope_layers");
            }
        });
        cases.push((format!("{name} num_hidden_layers 60000"), dir, "the config declares 60000 layers, but the source's tensors hold"));
    }
    cases.push(("olmoe-tiny num_experts 2^40".into(), hf("olmoe-tiny", "olmoe-experts", &big("num_experts", 1 << 40)), "(num_experts 1099511627776)"));
    cases.push(("llama-tiny vocab_size 2^40".into(), hf("llama-tiny", "llama-vocab", &big("vocab_size", 1 << 40)), "1099511627776"));
    cases.push(("llama-tiny intermediate_size 2^62".into(), hf("llama-tiny", "llama-inter", &big("intermediate_size", 1 << 62)), "4611686018427387904"));
    cases.push(("llama-tiny num_attention_heads 2^40".into(), hf("llama-tiny", "llama-heads", &big("num_attention_heads", 1 << 40)), "error"));
    let gguf = tmp.path().join("layers.gguf");
    std::fs::write(&gguf, gguf_declaring_layers(1 << 31)).expect("write gguf");
    cases.push(("GGUF block_count 2^31".into(), gguf, "llama.block_count declares 2147483648"));

    for (what, src, want) in &cases {
        let out = tmp.path().join("out.thin");
        let (o, took) = thin_limited(&["convert", utf8(src), "-o", utf8(&out), "--quiet"], MEM_LIMIT);
        let err = assert_typed_error(&o, what);
        assert!(err.contains(want), "{what}: {err}");
        assert!(took < Duration::from_secs(1), "{what}: {took:?}");
        assert!(!out.exists(), "{what}");
        eprintln!("{what}: refused in {:.0} ms: {}", took.as_secs_f64() * 1e3, err.trim());
    }

    // A context length of 2^62 is only a number: the archive converts, and `run` sizes its KV
    // cache by the engine's context, not by the declared one.
    let dir = hf("llama-tiny", "llama-ctx", &big("max_position_embeddings", 1 << 62));
    let out = tmp.path().join("ctx.thin");
    let (o, _) = thin_limited(&["convert", utf8(&dir), "-o", utf8(&out), "--quiet", "--profile", "f32"], MEM_LIMIT);
    if o.status.success() {
        let (o, took) = thin_limited(&["run", utf8(&out), "--prompt-ids", "1,2", "--max-tokens", "1"], MEM_LIMIT);
        assert!(o.status.code() == Some(0) || o.status.code() == Some(1), "run: {:?} {}", o.status.code(), stderr(&o));
        assert!(took < Duration::from_secs(2), "{took:?}");
    } else {
        assert_typed_error(&o, "context 2^62");
    }
}

/// A GGUF v3 with llama metadata declaring `layers` blocks and one tensor, `blk.0.attn_norm.weight`
/// (F32 [4]).
fn gguf_declaring_layers(layers: u32) -> Vec<u8> {
    let s = |b: &mut Vec<u8>, v: &str| {
        b.extend_from_slice(&(v.len() as u64).to_le_bytes());
        b.extend_from_slice(v.as_bytes());
    };
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&1u64.to_le_bytes()); // tensors
    b.extend_from_slice(&5u64.to_le_bytes()); // metadata
    s(&mut b, "general.architecture");
    b.extend_from_slice(&8u32.to_le_bytes());
    s(&mut b, "llama");
    for (k, v) in [("llama.embedding_length", 4u32), ("llama.block_count", layers), ("llama.feed_forward_length", 8), ("llama.attention.head_count", 1)] {
        s(&mut b, k);
        b.extend_from_slice(&4u32.to_le_bytes());
        b.extend_from_slice(&v.to_le_bytes());
    }
    s(&mut b, "blk.0.attn_norm.weight");
    b.extend_from_slice(&1u32.to_le_bytes());
    b.extend_from_slice(&4u64.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes()); // F32
    b.extend_from_slice(&0u64.to_le_bytes());
    while !b.len().is_multiple_of(32) {
        b.push(0);
    }
    b.extend_from_slice(&[0u8; 16]);
    b
}

/// Issue 24 point 4: one flipped bit in a weight page. `run` (and `chat`, `serve`, `bench`)
/// refuse the archive before computing a token, naming the page, its tensor and both hashes;
/// `--no-verify` runs it and says so once.
#[test]
fn a_damaged_weight_page_is_refused_by_every_command_that_loads_it() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let a = tmp.path().join("llama-tiny.thin");
    convert_fixture("llama-tiny", &a);
    let run = ["run", utf8(&a), "--backend", "cpu", "--prompt-ids", "5,6,7", "--max-tokens", "2"];
    let clean = thin(&run);
    assert!(clean.status.success(), "{}", stderr(&clean));

    let archive = thin_core::format::Archive::open(&a).expect("open");
    let t = archive.manifest().tensors.iter().find(|t| t.name == "blk.1.ffn_down").expect("tensor").clone();
    let page = archive.pages()[t.first_page as usize].clone();
    drop(archive);
    let mut bytes = std::fs::read(&a).expect("read");
    let at = (page.offset + page.stored_size / 2) as usize;
    bytes[at] ^= 0x10;
    std::fs::write(&a, &bytes).expect("write");
    let expected = blake3::Hash::from(page.blake3).to_hex().to_string();
    let found = blake3::hash(&bytes[page.offset as usize..(page.offset + page.stored_size) as usize]).to_hex().to_string();
    let want = format!(
        "page {} of tensor blk.1.ffn_down is damaged: its bytes hash to blake3 {found}, the page table records {expected}; no token was computed from it",
        page.page_id
    );

    let o = thin(&run);
    let err = assert_typed_error(&o, "run");
    assert_eq!(err.trim_end(), format!("error: loading {}: {want} (`thin verify` checks the whole archive; --no-verify skips this check)", a.display()));
    assert!(o.stdout.is_empty(), "{}", String::from_utf8_lossy(&o.stdout));
    for args in [
        vec!["chat", utf8(&a), "--backend", "cpu"],
        vec!["serve", utf8(&a), "--backend", "cpu", "--port", "0"],
        vec!["bench", utf8(&a), "--backend", "cpu", "--ctx", "64", "--steps", "1", "--reps", "1"],
    ] {
        let o = Command::new(env!("CARGO_BIN_EXE_thin")).args(&args).stdin(std::process::Stdio::null()).output().expect("run thin");
        assert!(assert_typed_error(&o, args[0]).contains(&want), "{}: {}", args[0], stderr(&o));
    }

    // --no-verify: the damaged archive runs (the flipped bit changes one weight of one layer),
    // and the skipped check is said once.
    let o = thin(&[&run[..], &["--no-verify"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert_eq!(err.matches("--no-verify").count(), 1, "{err}");
    assert!(err.starts_with(&format!("--no-verify: the pages of {} are not checked against their blake3\n", a.display())), "{err}");
    // bench too: it runs, says so once, and records that the pages went unchecked.
    let b = ["bench", utf8(&a), "--backend", "cpu", "--ctx", "64", "--steps", "1", "--reps", "1", "--pp", "4", "--tg", "2", "--warmup", "0", "--json", "--no-verify"];
    let o = thin(&b);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stderr(&o).matches("--no-verify").count(), 1, "{}", stderr(&o));
    let rec: serde_json::Value = serde_json::from_slice(&o.stdout).expect("bench JSON");
    assert_eq!(rec["pages_verified"], false);
}
