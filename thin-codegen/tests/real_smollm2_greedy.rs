//! Real text: the real SmolLM2-135M-Instruct GGUF → `convert` (f32, exact dequantization) → the
//! generated `smollm2-135m` CPU engine. Prompt ids equal HF's tokenizer's and greedy continuations
//! equal what transformers produced from the same GGUF (`tests/fixtures/hf_gguf_reference.py`).

use std::path::PathBuf;

use thin_core::convert::{convert, ConvertOptions};
use thin_core::engine::Engine;
use thin_core::format::Archive;
use thin_core::quant::Profile;
use thin_core::sampler::argmax;
use thin_core::tokenizer::{ChatMessage, TextTokenizer};

/// On the chat prompt the first 14 tokens agree, then at step 14 (inside "212°F") HF's `generate`
/// emitted id 34 where we pick id 33. HF's own teacher-forced forward over the same ids
/// (`tests/fixtures/hf_gguf_margin.py`, output in `tests/fixtures/smollm2_chat_margin.jsonl`) ranks
/// 33 first too, at 32.01272 vs 31.91169 in fp32 and in fp64 — the logits we compute at that step.
/// So the divergence is between HF's `generate` and HF's forward, not between HF and us. The test
/// holds exact agreement before that step and fails if the divergence moves or disappears.
const KNOWN_DIVERGENCE: Option<(usize, usize)> = Some((3, 14));

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn greedy_continuations_equal_transformers() {
    let gguf = match std::env::var_os("THIN_SMOLLM2_GGUF") {
        Some(p) => PathBuf::from(p),
        None => repo().join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    };
    assert!(gguf.is_file(), "{} is missing: run scripts/fetch-smollm2.sh", gguf.display());
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("smollm2-f32.thin");
    convert(&gguf, &out, &ConvertOptions { profile: Profile::shipped("f32").expect("shipped"), allow_requantize: false, progress: false, archs: thin_generated::KNOWN_ARCHS }).expect("convert");
    let archive = Archive::open(&out).expect("open");
    use thin_generated::smollm2_135m as m;
    assert_eq!(archive.manifest().shape_fingerprint, m::SHAPE_FINGERPRINT);
    let tok = TextTokenizer::from_info(&archive.manifest().tokenizer).expect("tokenizer");
    let mut engine = m::Engine::new(archive).expect("bind the weights");

    let text = std::fs::read_to_string(repo().join("tests/fixtures/smollm2_hf_greedy.json")).expect("fixture");
    let reference: serde_json::Value = serde_json::from_str(&text).expect("json");
    let cases = reference["cases"].as_array().expect("cases");
    assert!(cases.len() >= 4);
    for (index, case) in cases.iter().enumerate() {
        let ids = |k: &str| -> Vec<u32> { case[k].as_array().expect(k).iter().map(|x| x.as_u64().expect("id") as u32).collect() };
        let prompt = case["prompt"].as_str().expect("prompt");
        let rendered = if case["chat"].as_bool().expect("chat") {
            tok.render_chat(&[ChatMessage { role: "user".into(), content: prompt.into() }]).expect("template")
        } else {
            prompt.to_string()
        };
        assert_eq!(rendered, case["rendered"].as_str().expect("rendered"), "chat template rendering");
        let prompt_ids = tok.encode(&rendered).expect("encode");
        assert_eq!(prompt_ids, ids("prompt_ids"), "prompt ids of {prompt:?}");

        let want = ids("greedy_ids");
        engine.reset();
        let mut logits = engine.prefill(&prompt_ids).expect("prefill").to_vec();
        let mut got = Vec::new();
        while got.len() < want.len() {
            let next = argmax(&logits);
            if std::env::var_os("THIN_DEBUG_MARGIN").is_some() {
                let mut v: Vec<(f32, usize)> = logits.iter().enumerate().map(|(i, &x)| (x, i)).collect();
                v.sort_by(|a, b| b.0.total_cmp(&a.0));
                eprintln!("step {} top {:?}", got.len(), &v[..3]);
            }
            got.push(next);
            if tok.is_eos(next) {
                break;
            }
            logits.copy_from_slice(engine.decode_step(next).expect("decode"));
        }
        match KNOWN_DIVERGENCE {
            Some((i, step)) if i == index => {
                assert_eq!(got[..step], want[..step], "greedy prefix of {prompt:?}");
                assert_ne!(got[step], want[step], "the known divergence of {prompt:?} is gone: update KNOWN_DIVERGENCE");
            }
            _ => assert_eq!(got, want, "greedy continuation of {prompt:?}: ours {:?} vs HF {:?}", tok.decode(&got), case["greedy_text"]),
        }
    }
}
