//! `thin eval` end to end on the tiny llama fixture (converted here to f32 and bf16) over the
//! shipped eval text: a model against itself scores KLD 0, same-top 100% and PPL ratio 1; bf16
//! against f32 scores KLD > 0; saved logits give the same numbers as the archive they came from;
//! bad input is refused by name. The statistics themselves are checked against numpy in
//! `src/eval.rs` (`statistics_equal_numpy`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn utf8(p: &Path) -> &str {
    p.to_str().expect("utf8 path")
}

fn thin(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_thin")).args(args).env("RAYON_NUM_THREADS", "2").output().expect("run thin")
}

fn text() -> PathBuf {
    repo().join("eval/alice-ch1-4.txt")
}

fn convert(src: &Path, out: &Path, profile: &str) -> PathBuf {
    let o = thin(&["convert", utf8(src), "-o", utf8(out), "--profile", profile, "--quiet"]);
    assert!(o.status.success(), "convert {}: {}", src.display(), String::from_utf8_lossy(&o.stderr));
    out.to_path_buf()
}

fn tiny(dir: &Path, name: &str, profile: &str) -> PathBuf {
    convert(&repo().join("tests/fixtures/tiny").join(name), &dir.join(format!("{name}-{profile}.thin")), profile)
}

/// Windows of 16 tokens, the first 12 of the text (byte-level tokens: the tiny tokenizer).
const WINDOW: [&str; 4] = ["--ctx", "16", "--chunks", "12"];

fn eval_json(model: &Path, extra: &[&str]) -> Value {
    let text = text();
    let mut args = vec!["eval", utf8(model), "--text", utf8(&text), "--json"];
    args.extend_from_slice(&WINDOW);
    args.extend_from_slice(extra);
    let o = thin(&args);
    assert!(o.status.success(), "thin {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&o.stdout)))
}

fn eval_err(model: &Path, text: &Path, extra: &[&str]) -> String {
    let mut args = vec!["eval", utf8(model), "--text", utf8(text)];
    args.extend_from_slice(extra);
    let o = thin(&args);
    assert!(!o.status.success(), "thin {args:?} succeeded");
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn f(v: &Value, path: &[&str]) -> f64 {
    let mut x = v;
    for k in path {
        x = &x[*k];
    }
    x.as_f64().unwrap_or_else(|| panic!("{path:?} is not a number in {v}"))
}

#[test]
fn a_model_against_itself_and_against_its_bf16_conversion() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let f32 = tiny(tmp.path(), "llama-tiny", "f32");
    let bf16 = tiny(tmp.path(), "llama-tiny", "bf16");

    let alone = eval_json(&f32, &[]);
    for k in ["model", "ref", "ref_logits", "arch", "backend", "text", "text_tokens", "add_bos", "ctx", "windows", "seconds", "tok_s", "scored", "ppl", "chunks", "kld"] {
        assert!(alone.get(k).is_some(), "{k} missing: {alone}");
    }
    assert_eq!((alone["ctx"].as_u64(), alone["windows"].as_u64(), alone["scored"].as_u64()), (Some(16), Some(12), Some(12 * 7)));
    assert_eq!(alone["arch"], "llama-tiny");
    assert!(alone["kld"].is_null());
    let ppl = f(&alone, &["ppl", "value"]);
    // Random weights over 256 byte tokens: near-uniform, so PPL is of the order of the vocabulary.
    assert!(ppl > 50.0 && ppl < 2000.0, "{ppl}");
    assert_eq!(alone["chunks"].as_array().map(|c| c.len()), Some(12));
    assert_eq!(f(&alone["chunks"][11], &["ppl"]), ppl, "the last running value is the final one");

    let own = eval_json(&f32, &["--ref", utf8(&f32)]);
    let k = &own["kld"];
    assert_eq!(f(&own, &["ppl", "value"]), ppl);
    for (path, want) in [
        (&["kld", "mean"][..], 0.0),
        (&["kld", "max"], 0.0),
        (&["delta_p", "max"], 0.0),
        (&["delta_p", "min"], 0.0),
        (&["rms_delta_p", "value"], 0.0),
        (&["same_top_p", "value"], 1.0),
        (&["ppl_ratio", "value"], 1.0),
        (&["ln_ppl_ratio", "value"], 0.0),
        (&["ppl_diff", "value"], 0.0),
    ] {
        assert_eq!(f(k, path), want, "{path:?} against itself");
    }
    assert_eq!(f(k, &["ppl_q", "value"]), f(k, &["ppl_base", "value"]));

    let other = eval_json(&bf16, &["--ref", utf8(&f32)]);
    let k = &other["kld"];
    let kld = f(k, &["kld", "mean"]);
    assert!(kld > 0.0 && kld < 0.01, "bf16 vs f32 of a tiny random model: small but not 0: {kld}");
    assert!(f(k, &["kld", "max"]) >= f(k, &["kld", "p99"]) && f(k, &["kld", "p99"]) >= f(k, &["kld", "median"]));
    assert!(f(k, &["rms_delta_p", "value"]) > 0.0);
    assert_eq!(f(k, &["ppl_base", "value"]), ppl, "the reference's PPL is its own");
    assert!((f(k, &["ppl_ratio", "value"]) - f(&other, &["ppl", "value"]) / ppl).abs() < 1e-9);

    // Saved reference logits score exactly as the reference archive does.
    let saved = tmp.path().join("f32.logits");
    eval_json(&f32, &["--save-logits", utf8(&saved)]);
    let want_len = 128 + 4 * 12 * 16 + 4 * 12 * 7 * 256;
    assert_eq!(std::fs::metadata(&saved).expect("saved").len(), want_len as u64);
    let from_file = eval_json(&bf16, &["--ref-logits", utf8(&saved)]);
    assert_eq!(from_file["kld"], other["kld"]);
    assert_eq!(from_file["chunks"], other["chunks"]);
    // The file's windows and size come from the header: --chunks may read fewer, not more.
    let o = thin(&["eval", utf8(&bf16), "--text", utf8(&text()), "--ref-logits", utf8(&saved), "--chunks", "13"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("holds 12 windows"), "{}", String::from_utf8_lossy(&o.stderr));
    let o = thin(&["eval", utf8(&bf16), "--text", utf8(&text()), "--ref-logits", utf8(&saved), "--ctx", "32"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("windows of 16 tokens; --ctx asks for 32"), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn prints_llama_perplexity_layout() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let f32 = tiny(tmp.path(), "llama-tiny", "f32");
    let bf16 = tiny(tmp.path(), "llama-tiny", "bf16");
    let run = |extra: &[&str]| {
        let text = text();
        let mut args = vec!["eval", utf8(&bf16), "--text", utf8(&text)];
        args.extend_from_slice(&WINDOW);
        args.extend_from_slice(extra);
        let o = thin(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        (String::from_utf8(o.stdout).expect("utf8"), String::from_utf8(o.stderr).expect("utf8"))
    };
    let (out, err) = run(&[]);
    assert!(out.starts_with("[1]") && out.contains(",[12]"), "{out}");
    assert!(out.contains("\nFinal estimate: PPL = "), "{out}");
    assert!(err.contains("tok/s"), "{err}");
    let (out, _) = run(&["--ref", utf8(&f32)]);
    for line in [
        "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p",
        "====== Perplexity statistics ======",
        "Mean PPL(Q)                   : ",
        "Mean ln(PPL(Q)/PPL(base))     : ",
        "Mean PPL(Q)/PPL(base)         : ",
        "====== KL divergence statistics ======",
        "Mean    KLD: ",
        "99.0%   KLD: ",
        "Median  KLD: ",
        "====== Token probability statistics ======",
        "RMS Δp    : ",
        "Same top p: 100.000 ± 0.000 %",
    ] {
        assert!(out.contains(line), "{line:?} missing from\n{out}");
    }
    assert_eq!(out.lines().filter(|l| l.starts_with("  12 ")).count(), 1, "one line per window: {out}");
}

#[test]
fn bad_input_is_refused_by_name() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model = tiny(tmp.path(), "llama-tiny", "f32");
    let write = |name: &str, text: &str| {
        let p = tmp.path().join(name);
        std::fs::write(&p, text).expect("write");
        p
    };

    let empty = write("empty.txt", " \n\n");
    assert!(eval_err(&model, &empty, &[]).contains("is empty"));
    let missing = tmp.path().join("nope.txt");
    assert!(eval_err(&model, &missing, &[]).contains("nope.txt"));
    let binary = tmp.path().join("binary.txt");
    std::fs::write(&binary, [0xffu8, 0xfe, 0x00, 0x41]).expect("write");
    assert!(eval_err(&model, &binary, &[]).contains("binary.txt"));
    // 31 byte-level tokens: not two windows of 16.
    let short = write("short.txt", "Alice was beginning to get very");
    let e = eval_err(&model, &short, &["--ctx", "16"]);
    assert!(e.contains("tokenizes to 31 tokens") && e.contains("at least 32"), "{e}");
    let e = eval_err(&model, &text(), &["--ctx", "300"]);
    assert!(e.contains("--ctx 300 is more than the model's maximum of 256 positions"), "{e}");
    assert!(eval_err(&model, &text(), &["--ctx", "2"]).contains("too small"));
    assert!(eval_err(&model, &text(), &["--chunks", "0"]).contains("--chunks"));

    // A reference of another architecture (same 256-token vocabulary), and of another vocabulary.
    let smollm3 = tiny(tmp.path(), "smollm3-tiny", "f32");
    let e = eval_err(&model, &text(), &["--ctx", "16", "--ref", utf8(&smollm3)]);
    assert!(e.contains("another architecture") && e.contains("smollm3-tiny-f32.thin"), "{e}");
    let gguf = match std::env::var_os("THIN_SMOLLM2_GGUF") {
        Some(p) => PathBuf::from(p),
        None => repo().join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    };
    assert!(gguf.is_file(), "{} is missing: run scripts/fetch-smollm2.sh", gguf.display());
    let smollm2 = convert(&gguf, &tmp.path().join("smollm2.thin"), "bf16");
    let e = eval_err(&model, &text(), &["--ctx", "16", "--ref", utf8(&smollm2)]);
    assert!(e.contains("smollm2.thin has a vocabulary of 49152, the model 256"), "{e}");

    // Saved logits: another vocabulary, a truncated file, not a logits file, and refusing to
    // write over the file being read.
    let synthetic = repo().join("tests/fixtures/eval/synthetic-ref.logits");
    let e = eval_err(&model, &text(), &["--ref-logits", utf8(&synthetic)]);
    assert!(e.contains("vocabulary of 64; the model's is 256"), "{e}");
    let saved = tmp.path().join("f32.logits");
    eval_json(&model, &["--save-logits", utf8(&saved)]);
    let bytes = std::fs::read(&saved).expect("read");
    let cut = write("cut.logits", "");
    std::fs::write(&cut, &bytes[..bytes.len() - 1000]).expect("write");
    assert!(eval_err(&model, &text(), &["--ref-logits", utf8(&cut)]).contains("cut.logits is truncated"));
    assert!(eval_err(&model, &text(), &["--ref-logits", utf8(&text())]).contains("is not a thin logits file"));
    let e = eval_err(&model, &text(), &["--ref-logits", utf8(&saved), "--save-logits", utf8(&saved)]);
    assert!(e.contains("would overwrite"), "{e}");
    assert_eq!(std::fs::read(&saved).expect("read"), bytes, "the reference is untouched");
    // Another text than the saved logits were made from.
    let other = write("other.txt", &std::fs::read_to_string(text()).expect("text").replacen("ALICE", "ALISE", 1));
    let e = eval_err(&model, &other, &["--ref-logits", utf8(&saved), "--chunks", "12"]);
    assert!(e.contains("was written over other tokens"), "{e}");
    // --ref and --ref-logits together.
    assert!(eval_err(&model, &text(), &["--ref", utf8(&model), "--ref-logits", utf8(&saved)]).contains("cannot be used with"));
}
