//! Golden logits: each tiny HF fixture goes through the real path (HF dir → `convert` → `.thin` →
//! generated CPU engine reading the mmapped archive) and reproduces transformers' fp32 logits
//! (`tests/fixtures/make_tiny.py`): 16-token prefill, then 16 cached decode steps.

use std::path::PathBuf;

use thin_core::convert::{convert, ConvertOptions};
use thin_core::engine::Engine;
use thin_core::format::Archive;
use thin_core::quant::Profile;
use thin_core::sampler::argmax;

/// The issue allows 1e-3; measured here: at most 1.32e-5 (smollm3-tiny, decode step 10) with the
/// 16-lane matvec sums, so 5e-5 holds with room and still catches any real error.
const TOL: f32 = 5e-5;

struct Reference {
    prompt_ids: Vec<u32>,
    prefill_last: Vec<f32>,
    decode_ids: Vec<u32>,
    decode_logits: Vec<Vec<f32>>,
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny").join(name)
}

fn reference(name: &str) -> Reference {
    let text = std::fs::read_to_string(fixture(name).join("reference.json")).expect("reference.json");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    let ids = |k: &str| -> Vec<u32> { v[k].as_array().expect(k).iter().map(|x| x.as_u64().expect("id") as u32).collect() };
    let rows = |k: &str| -> Vec<Vec<f32>> {
        v[k].as_array()
            .expect(k)
            .iter()
            .map(|r| r.as_array().expect("row").iter().map(|x| x.as_f64().expect("logit") as f32).collect())
            .collect()
    };
    let prefill = rows("prefill_logits");
    Reference {
        prompt_ids: ids("prompt_ids"),
        prefill_last: prefill.last().expect("prefill rows").clone(),
        decode_ids: ids("decode_ids"),
        decode_logits: rows("decode_logits"),
    }
}

fn archive(name: &str, dir: &tempfile::TempDir) -> Archive {
    let out = dir.path().join(format!("{name}.thin"));
    convert(&fixture(name), &out, &ConvertOptions { profile: Profile::shipped("f32").expect("shipped"), allow_requantize: false, progress: false, archs: thin_generated::KNOWN_ARCHS }).expect("convert");
    Archive::open(&out).expect("open")
}

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: vocab");
    let max = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    eprintln!("{what}: max |Δlogit| = {max:.2e}");
    assert!(max <= TOL, "{what}: max |Δlogit| = {max} > {TOL}");
    assert_eq!(argmax(got), argmax(want), "{what}: argmax");
}

fn check<E: Engine>(name: &str, mut engine: E) {
    let r = reference(name);
    assert_eq!((r.prompt_ids.len(), r.decode_ids.len(), r.decode_logits.len()), (16, 16, 16), "{name}: fixture shape");
    let logits = engine.prefill(&r.prompt_ids).expect("prefill");
    assert_close(&format!("{name} prefill"), logits, &r.prefill_last);
    for (step, (&id, want)) in r.decode_ids.iter().zip(&r.decode_logits).enumerate() {
        let logits = engine.decode_step(id).expect("decode");
        assert_close(&format!("{name} decode step {step}"), logits, want);
    }
}

macro_rules! golden {
    ($test:ident, $module:ident, $fixture:literal) => {
        #[test]
        fn $test() {
            use thin_generated::$module as m;
            let tmp = tempfile::tempdir().expect("tempdir");
            let a = archive($fixture, &tmp);
            assert_eq!(a.manifest().shape_fingerprint, m::SHAPE_FINGERPRINT, "fixture and description disagree on shapes");
            check($fixture, m::Engine::new(a).expect("bind the weights"));
        }
    };
}

golden!(llama_tiny_matches_hf, llama_tiny, "llama-tiny");
golden!(smollm3_tiny_matches_hf, smollm3_tiny, "smollm3-tiny");
golden!(gemma3_tiny_matches_hf, gemma3_tiny, "gemma3-tiny");
golden!(olmoe_tiny_matches_hf, olmoe_tiny, "olmoe-tiny");
