//! The committed tiny HF fixtures (written by transformers 5.17, `rope_parameters` style) read into
//! the ArchConfig their generator script asked for.

use std::path::PathBuf;

use thin_core::arch::{Family, LayerAttention};
use thin_core::safetensors_dir::HfDir;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny").join(name)
}

#[test]
fn llama_tiny_reads_llama3_rope_scaling_from_rope_parameters() {
    let dir = HfDir::open(&fixture("llama-tiny")).expect("open");
    let a = dir.source_model().expect("model").arch;
    assert_eq!(a.dims.family, Family::Llama);
    assert_eq!((a.dims.hidden_size, a.dims.num_layers, a.dims.num_heads, a.dims.num_kv_heads, a.dims.head_dim), (64, 2, 4, 2, 16));
    assert_eq!(a.rope.theta, 10_000.0);
    let s = a.rope.scaling.expect("llama3 scaling");
    assert_eq!(s.rope_type, "llama3");
    assert_eq!((s.factor, s.low_freq_factor, s.high_freq_factor), (8.0, 1.0, 4.0));
    assert_eq!(s.original_max_position_embeddings, 32);
    assert!(a.dims.tie_word_embeddings);
}

#[test]
fn smollm3_tiny_skips_rope_on_every_fourth_layer() {
    let a = HfDir::open(&fixture("smollm3-tiny")).expect("open").source_model().expect("model").arch;
    assert_eq!(a.dims.family, Family::Smollm3);
    assert_eq!(a.no_rope_layers, vec![3]);
    assert_eq!(a.rope.theta, 50_000.0);
}

#[test]
fn gemma3_tiny_reads_per_layer_type_thetas_and_pattern() {
    let a = HfDir::open(&fixture("gemma3-tiny")).expect("open").source_model().expect("model").arch;
    assert_eq!(a.dims.family, Family::Gemma3);
    assert_eq!(a.rope.theta, 1_000_000.0);
    assert_eq!(a.rope.local_theta, Some(10_000.0));
    assert_eq!(a.sliding_window, Some(4));
    let mut want = vec![LayerAttention::SlidingWindow; 5];
    want.push(LayerAttention::Full);
    assert_eq!(a.layer_attention, want);
    assert_eq!(a.query_pre_attn_scalar, Some(32.0));
    assert_eq!(a.dims.head_dim, 32);
}

#[test]
fn olmoe_tiny_reads_experts() {
    let a = HfDir::open(&fixture("olmoe-tiny")).expect("open").source_model().expect("model").arch;
    assert_eq!(a.dims.family, Family::Olmoe);
    let m = a.moe.expect("moe");
    assert_eq!((a.dims.num_experts, a.dims.top_k, m.norm_topk_prob), (8, 2, false));
    assert!(!a.dims.tie_word_embeddings);
    assert_eq!(a.dims.intermediate_size, 32);
}
