//! Declared counts that the tensors cannot back (issue 24, point 1): a GGUF `block_count`,
//! `expert_count` or `vocab_size`, a config.json `num_hidden_layers` or `num_experts` far beyond
//! the tensors present is a typed error naming the key, in milliseconds, before anything is sized
//! by it.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use thin_core::gguf::{GgufError, GgufFile};
use thin_core::safetensors_dir::{HfDir, SafetensorsError, MAX_LAYERS};
use w::*;

/// Generous for a debug build on a loaded 2-core machine; the work is a few thousand steps.
const FAST: Duration = Duration::from_secs(1);

fn set(g: &mut Gguf, key: &str, ty: u32, payload: Vec<u8>) {
    g.kvs.retain(|(k, _, _)| k != &s(key));
    g.kv(key, ty, payload);
}

fn source_err(g: &Gguf) -> (GgufError, Duration) {
    let t = Instant::now();
    let f = GgufFile::from_bytes(g.build()).expect("the file parses");
    let e = f.source_model("x.gguf").expect_err("refused");
    (e, t.elapsed())
}

#[test]
fn gguf_block_count_past_the_layers_present() {
    let mut g = valid();
    set(&mut g, "llama.block_count", T_U32, (1u32 << 31).to_le_bytes().to_vec());
    let (e, took) = source_err(&g);
    match &e {
        GgufError::Unbacked { key, declared, present, .. } => assert_eq!((key.as_str(), *declared, *present), ("llama.block_count", 1 << 31, 1)),
        other => panic!("{other}"),
    }
    assert!(e.to_string().contains("llama.block_count declares 2147483648, but the file's tensors hold 1 layers"), "{e}");
    assert!(took < FAST, "{took:?}");
    // One more than present is refused too; the present count opens.
    set(&mut g, "llama.block_count", T_U32, 2u32.to_le_bytes().to_vec());
    assert!(matches!(source_err(&g).0, GgufError::Unbacked { declared: 2, present: 1, .. }));
    set(&mut g, "llama.block_count", T_U64, u64::MAX.to_le_bytes().to_vec());
    assert!(matches!(source_err(&g).0, GgufError::Unbacked { declared: u64::MAX, .. }));
}

#[test]
fn gguf_vocab_size_that_disagrees_with_the_token_list() {
    let mut g = valid();
    let tokens = gpt2_tokens().len() as u64;
    set(&mut g, "llama.vocab_size", T_U64, (1u64 << 40).to_le_bytes().to_vec());
    let (e, took) = source_err(&g);
    assert!(matches!(&e, GgufError::BadValue { key, .. } if key == "llama.vocab_size"), "{e}");
    assert!(e.to_string().contains(&format!("1099511627776, but tokenizer.ggml.tokens lists {tokens} tokens")), "{e}");
    assert!(took < FAST, "{took:?}");
    set(&mut g, "llama.vocab_size", T_U64, tokens.to_le_bytes().to_vec());
    GgufFile::from_bytes(g.build()).expect("parses").source_model("x.gguf").expect("an agreeing vocab_size is fine");
}

/// An OLMoE GGUF: valid()'s llama keys renamed, plus experts stacked 2 deep.
fn olmoe(experts: u64, used: u32) -> Gguf {
    let mut g = valid();
    for (k, _, _) in &mut g.kvs {
        let key = String::from_utf8_lossy(&k[8..]).into_owned();
        if let Some(rest) = key.strip_prefix("llama.") {
            *k = s(&format!("olmoe.{rest}"));
        }
    }
    set(&mut g, "general.architecture", T_STRING, s("olmoe"));
    set(&mut g, "olmoe.expert_count", T_U64, experts.to_le_bytes().to_vec());
    set(&mut g, "olmoe.expert_used_count", T_U32, used.to_le_bytes().to_vec());
    let bytes = vec![0u8; 4 * 2 * 2 * 2]; // F32 [2, 2, 2]
    g.tensor("blk.0.ffn_gate_exps.weight", &[2, 2, 2], 0, &bytes);
    g
}

#[test]
fn gguf_expert_count_past_the_stacked_experts() {
    let (e, took) = source_err(&olmoe(1 << 40, 1));
    match &e {
        GgufError::Unbacked { key, declared, present, .. } => assert_eq!((key.as_str(), *declared, *present), ("olmoe.expert_count", 1 << 40, 2)),
        other => panic!("{other}"),
    }
    assert!(took < FAST, "{took:?}");
    assert!(matches!(source_err(&olmoe(2, 3)).0, GgufError::BadValue { key, .. } if key == "olmoe.expert_used_count"));
    let m = GgufFile::from_bytes(olmoe(2, 1).build()).expect("parses");
    let dims = m.source_model("x.gguf").expect("2 experts, 1 used").arch.dims;
    assert_eq!((dims.num_experts, dims.top_k), (2, 1));
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny").join(name)
}

/// A copy of a tiny HF fixture with `change` applied to its config.json.
fn hf_with(name: &str, tmp: &Path, change: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let dir = tmp.join(name);
    std::fs::create_dir_all(&dir).expect("mkdir");
    for e in std::fs::read_dir(fixture(name)).expect("fixture") {
        let e = e.expect("entry");
        std::fs::copy(e.path(), dir.join(e.file_name())).expect("copy");
    }
    let p = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).expect("config")).expect("json");
    change(&mut v);
    std::fs::write(&p, v.to_string()).expect("write");
    dir
}

fn hf_err(dir: &Path) -> (SafetensorsError, Duration) {
    let t = Instant::now();
    let e = HfDir::open(dir).expect_err("refused");
    (e, t.elapsed())
}

/// config.json's per-layer lists are built from the count before any tensor is read: a count past
/// [`MAX_LAYERS`] is refused first (the converter then checks the count against the layers present:
/// tests/hostile.rs at the root runs it).
#[test]
fn config_layer_counts_past_the_cap() {
    let tmp = tempfile::tempdir().expect("tempdir");
    for name in ["llama-tiny", "smollm3-tiny", "gemma3-tiny", "olmoe-tiny"] {
        let dir = hf_with(name, tmp.path(), |c| {
            c["num_hidden_layers"] = (1u64 << 31).into();
            if let Some(o) = c.as_object_mut() {
                o.remove("layer_types");
                o.remove("no_rope_layers");
            }
        });
        let (e, took) = hf_err(&dir);
        let msg = e.to_string();
        assert!(matches!(&e, SafetensorsError::Config { key, .. } if key == "num_hidden_layers"), "{name}: {msg}");
        assert!(msg.contains(&format!("2147483648 is more than {MAX_LAYERS}")), "{name}: {msg}");
        assert!(took < FAST, "{name}: {took:?}");
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = hf_with("olmoe-tiny", tmp.path(), |c| c["num_experts_per_tok"] = 1000.into());
    assert!(matches!(hf_err(&dir).0, SafetensorsError::Config { key, .. } if key == "num_experts_per_tok"));
}

// The synthetic GGUF writer lives in tests/common/gguf_writer.rs.
#[allow(dead_code)]
#[path = "common/gguf_writer.rs"]
mod w;
