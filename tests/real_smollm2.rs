//! The real SmolLM2-135M-Instruct GGUF through the real path (`thin convert` → `.thin` → reader):
//! the archive's tensor values equal gguf-py's dequantization, recorded once in
//! `tests/fixtures/smollm2_gguf_ref.json` by `scripts/gguf_reference.py`.

use std::path::PathBuf;
use std::process::Command;

use thin_core::arch::Family;
use thin_core::format::Archive;
use thin_core::names::{NameMatch, NameTable};
use thin_core::role::Role;
use thin_core::source::SourceKind;

fn gguf_path() -> PathBuf {
    let p = match std::env::var_os("THIN_SMOLLM2_GGUF") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    };
    assert!(p.is_file(), "{} is missing: run scripts/fetch-smollm2.sh", p.display());
    p
}

fn reference() -> serde_json::Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/smollm2_gguf_ref.json");
    serde_json::from_str(&std::fs::read_to_string(p).expect("reference fixture")).expect("json")
}

/// The fixture's values are exact f32s; they are compared as f32 (serde_json's f64 parse may be one
/// f64 ulp off, which the cast to f32 removes).
fn f64s(v: &serde_json::Value) -> Vec<f64> {
    v.as_array().expect("array").iter().map(|x| x.as_f64().expect("number")).collect()
}

#[test]
fn archive_values_equal_gguf_py_dequantization() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("smollm2-f32.thin");
    let o = Command::new(env!("CARGO_BIN_EXE_thin"))
        .args(["convert", gguf_path().to_str().expect("utf8"), "-o", out.to_str().expect("utf8"), "--profile", "f32", "--quiet"])
        .output()
        .expect("run thin");
    assert!(o.status.success(), "convert failed: {}", String::from_utf8_lossy(&o.stderr));
    let archive = Archive::open(&out).expect("open");
    archive.verify().expect("verify");
    let reference = reference();
    let tensors = reference["tensors"].as_array().expect("tensors");
    assert!(tensors.len() >= 10);
    let names = NameTable::for_family(thin_generated::KNOWN_ARCHS, Family::Llama).expect("llama names");
    for r in tensors {
        let gguf_name = r["name"].as_str().expect("name");
        let (role, layer) = match names.resolve(SourceKind::Gguf, gguf_name).expect("name") {
            NameMatch::Tensor { role, layer, .. } => (role, layer),
            NameMatch::Ignored => panic!("{gguf_name} is a model tensor"),
        };
        let entry = archive.manifest().tensor(role, layer).unwrap_or_else(|| panic!("{gguf_name} not in archive"));
        let canonical = entry.name.as_str();
        assert_eq!(entry.source_name, gguf_name);
        let bytes = archive.tensor_bytes(entry).expect("bytes");
        let vals: Vec<f32> = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        assert_eq!(vals.len() as u64, r["n_elements"].as_u64().expect("n"), "{canonical}");
        let sum: f64 = vals.iter().map(|&v| v as f64).sum();
        let sum_sq: f64 = vals.iter().map(|&v| (v as f64) * (v as f64)).sum();
        let (want_sum, want_sq) = (r["sum"].as_f64().expect("sum"), r["sum_sq"].as_f64().expect("sum_sq"));
        assert!((sum - want_sum).abs() <= 1e-6 * want_sq.sqrt().max(1.0) * (vals.len() as f64).sqrt(), "{canonical}: sum {sum} vs {want_sum}");
        assert!((sum_sq - want_sq).abs() <= 1e-6 * want_sq.max(1.0), "{canonical}: sum_sq {sum_sq} vs {want_sq}");
        // Q and K rows were moved back to HF order (undoing llama.cpp's permutation), so only the
        // order-free sums apply to them; every other tensor matches value by value.
        if matches!(role, Role::AttnQ | Role::AttnK) {
            continue;
        }
        let first = f64s(&r["first"]);
        for (i, w) in first.iter().enumerate() {
            assert_eq!(vals[i], *w as f32, "{canonical}[{i}]");
        }
        let stride = r["stride"].as_u64().expect("stride") as usize;
        for (k, w) in f64s(&r["strided"]).iter().enumerate() {
            assert_eq!(vals[k * stride], *w as f32, "{canonical}[{}]", k * stride);
        }
    }
}

/// `thin run --chat` on the real bf16 archive (the README's main command): the answer streams as
/// JSON lines and generation ends at the model's EOS.
#[test]
fn thin_run_chat_answers_and_stops_at_eos() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("smollm2-bf16.thin");
    let thin = |args: &[&str]| Command::new(env!("CARGO_BIN_EXE_thin")).args(args).output().expect("run thin");
    let o = thin(&["convert", gguf_path().to_str().expect("utf8"), "-o", out.to_str().expect("utf8"), "--quiet"]);
    assert!(o.status.success(), "convert failed: {}", String::from_utf8_lossy(&o.stderr));
    let o = thin(&[
        "run",
        out.to_str().expect("utf8"),
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "64",
        "--format",
        "jsonl",
    ]);
    assert!(o.status.success(), "thin run failed: {}", String::from_utf8_lossy(&o.stderr));
    let lines: Vec<serde_json::Value> =
        String::from_utf8_lossy(&o.stdout).lines().map(|l| serde_json::from_str(l).expect("JSON line")).collect();
    let stats = lines.last().expect("stats");
    assert_eq!(stats["stop"], "eos", "{stats}");
    assert_eq!(stats["arch"], "smollm2-135m");
    let text: String = lines[1..lines.len() - 1].iter().map(|l| l["text"].as_str().expect("text")).collect();
    assert!(text.contains("Paris"), "{text:?}");
}
