//! The real Gemma 3 270M GGUF (the base model, Q4_K_M with Q5_0/Q8_0/Q6_K tensors) through the real
//! path: its SentencePiece tokenizer gives llama.cpp's ids, it converts, and `thin run` continues
//! a prompt.
//!
//! Needs the model file: run `scripts/fetch-gemma3.sh` (or set THIN_GEMMA3_GGUF).

use std::path::PathBuf;

use thin_core::gguf::GgufFile;
use thin_core::tokenizer::TextTokenizer;

fn gguf_path() -> PathBuf {
    let p = match std::env::var_os("THIN_GEMMA3_GGUF") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".cache/models/gemma-3-270m-q4_k_m.gguf"),
    };
    assert!(p.is_file(), "{} is missing: run scripts/fetch-gemma3.sh", p.display());
    p
}

fn fixture(name: &str) -> serde_json::Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).expect("json")
}

/// Every string of `tests/fixtures/gemma_tokenizer_ref.json` (unicode, digits, whitespace runs,
/// byte fallback, special-token text, code) encodes to the ids llama.cpp's `llama-tokenize` gave
/// (`tests/fixtures/make_gemma_tokenizer_reference.py`), BOS included, and decodes back to itself. One difference is
/// deliberate: a text that begins with BOS's own text ("<bos>") keeps one BOS in thin (its encode
/// prepends BOS only when the ids do not already start with it, so a chat template's
/// `{{ bos_token }}` is not doubled), where llama-tokenize prepends a second one.
/// Gemma's `<bos>` (`tokenizer.ggml.bos_token_id`).
const BOS: u32 = 2;

#[test]
fn tokenizer_ids_equal_llama_cpp() {
    let gguf = GgufFile::open(&gguf_path()).expect("open");
    let model = gguf.source_model("gemma-3-270m-q4_k_m.gguf").expect("source model");
    assert_eq!((model.tokenizer.bos_token_id, model.tokenizer.add_bos), (Some(BOS), true));
    let tok = TextTokenizer::from_info(&model.tokenizer).expect("tokenizer");
    let reference = fixture("gemma_tokenizer_ref.json");
    let cases = reference.as_array().expect("array");
    assert!(cases.len() >= 200, "{} cases", cases.len());
    let mut mismatches = Vec::new();
    for c in cases {
        let text = c["text"].as_str().expect("text");
        let mut want: Vec<u32> = c["ids"].as_array().expect("ids").iter().map(|v| v.as_u64().expect("id") as u32).collect();
        if text.starts_with("<bos>") {
            assert_eq!(want[..2], [BOS, BOS], "{text:?}");
            want.remove(0);
        }
        let got = tok.encode(text).expect("encode");
        if got != want {
            mismatches.push(format!("{text:?}: thin {got:?}, llama.cpp {want:?}"));
        }
        let prepended = usize::from(!text.starts_with("<bos>"));
        let back = tok.decode(&got[prepended..]).expect("decode");
        // SentencePiece's space symbol decodes as a space, whether it came from one or not.
        if back != text.replace('▁', " ") {
            mismatches.push(format!("{text:?} decodes back as {back:?}"));
        }
    }
    assert!(mismatches.is_empty(), "{} mismatches in {} cases:\n{}", mismatches.len(), cases.len(), mismatches.join("\n"));
}
