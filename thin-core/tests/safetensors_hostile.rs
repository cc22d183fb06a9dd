//! Every broken-safetensors class the importer must refuse, each on a file crafted here.

use std::path::Path;

use thin_core::arch::{Family, LayerAttention};
use thin_core::safetensors_dir::{parse_header, HfDir, SafetensorsError, SafetensorsFile};

fn file(header: &str, data_len: usize) -> Vec<u8> {
    let mut v = (header.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(header.as_bytes());
    v.resize(v.len() + data_len, 0);
    v
}

fn err(bytes: &[u8]) -> SafetensorsError {
    parse_header("t.safetensors", bytes).expect_err("must be refused")
}

#[test]
fn valid_header_parses() {
    let h = r#"{"__metadata__":{"format":"pt"},"a":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},"b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}}"#;
    let t = parse_header("t", &file(h, 16)).expect("valid");
    assert_eq!(t.len(), 2);
    assert_eq!(t[0].start, 8 + h.len() as u64);
    assert_eq!(t[1].shape, vec![1]);
}

#[test]
fn too_short() {
    assert!(matches!(err(&[1, 2, 3]), SafetensorsError::TooShort { .. }));
}

#[test]
fn header_length_huge() {
    let mut v = u64::MAX.to_le_bytes().to_vec();
    v.extend_from_slice(b"{}");
    assert!(matches!(err(&v), SafetensorsError::HeaderTooLarge { .. }));
    let mut v = 200_000_000u64.to_le_bytes().to_vec();
    v.extend_from_slice(b"{}");
    assert!(matches!(err(&v), SafetensorsError::HeaderTooLarge { .. }));
}

#[test]
fn header_length_past_end_of_file() {
    let mut v = 1000u64.to_le_bytes().to_vec();
    v.extend_from_slice(b"{}");
    assert!(matches!(err(&v), SafetensorsError::HeaderPastEnd { .. }));
}

#[test]
fn header_not_json() {
    assert!(matches!(err(&file("{not json", 0)), SafetensorsError::Header { .. }));
    assert!(matches!(err(&file("[1,2]", 0)), SafetensorsError::Header { .. }));
}

#[test]
fn duplicate_names() {
    let h = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
    let e = err(&file(h, 8));
    assert!(matches!(&e, SafetensorsError::DuplicateTensor { tensor, .. } if tensor == "a"), "{e}");
}

#[test]
fn overlapping_offsets() {
    let h = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
    let e = err(&file(h, 12));
    assert!(matches!(e, SafetensorsError::Overlap { .. }), "{e}");
}

#[test]
fn offsets_outside_file() {
    let h = r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
    let e = err(&file(h, 8));
    assert!(matches!(&e, SafetensorsError::OffsetsOutOfFile { tensor, .. } if tensor == "a"), "{e}");
    let h = r#"{"a":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}}"#;
    assert!(matches!(err(&file(h, 8)), SafetensorsError::OffsetsOutOfFile { .. }));
}

#[test]
fn size_mismatch() {
    let h = r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#;
    assert!(matches!(err(&file(h, 8)), SafetensorsError::SizeMismatch { expected: 12, got: 8, .. }));
}

#[test]
fn unsupported_dtype() {
    let h = r#"{"a":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}}"#;
    let e = err(&file(h, 8));
    assert!(matches!(&e, SafetensorsError::UnsupportedDtype { dtype, .. } if dtype == "I64"), "{e}");
}

#[test]
fn shape_product_overflow() {
    let h = r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}}"#;
    assert!(matches!(err(&file(h, 4)), SafetensorsError::ShapeOverflow { .. }));
    let h = r#"{"a":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,4]}}"#;
    assert!(matches!(err(&file(h, 4)), SafetensorsError::ShapeOverflow { .. }));
}

#[test]
fn bad_fields() {
    let h = r#"{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#;
    assert!(matches!(err(&file(h, 4)), SafetensorsError::TensorField { field: "shape", .. }));
    let h = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}}"#;
    assert!(matches!(err(&file(h, 4)), SafetensorsError::TensorField { field: "data_offsets", .. }));
    let h = r#"{"a":{"shape":[1],"data_offsets":[0,4]}}"#;
    assert!(matches!(err(&file(h, 4)), SafetensorsError::TensorField { field: "dtype", .. }));
}

#[test]
fn tiny_file_on_disk_is_refused_before_mapping() {
    let d = tempfile::tempdir().expect("tempdir");
    let p = d.path().join("x.safetensors");
    std::fs::write(&p, b"abc").expect("write");
    assert!(matches!(SafetensorsFile::open(&p), Err(SafetensorsError::TooShort { .. })));
}

const TOKENIZER: &str = r#"{"version":"1.0","added_tokens":[{"id":0,"content":"<s>","special":true},{"id":1,"content":"</s>","special":true}],"post_processor":null,"model":{"type":"BPE","vocab":{"<s>":0,"</s>":1,"a":2},"merges":[]}}"#;

fn write_dir(dir: &Path, config: &str) {
    std::fs::write(dir.join("config.json"), config).expect("config");
    std::fs::write(dir.join("tokenizer.json"), TOKENIZER).expect("tok");
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"bos_token":"<s>","eos_token":{"content":"</s>"},"chat_template":[{"name":"default","template":"T"}]}"#,
    )
    .expect("tc");
}

#[test]
fn dir_without_config_or_weights() {
    let d = tempfile::tempdir().expect("tempdir");
    assert!(matches!(HfDir::open(d.path()), Err(SafetensorsError::MissingFile { .. })));
    write_dir(
        d.path(),
        r#"{"model_type":"llama","hidden_size":8,"num_hidden_layers":1,"num_attention_heads":2,"intermediate_size":16,"vocab_size":3}"#,
    );
    let e = HfDir::open(d.path()).expect_err("no weights");
    assert!(e.to_string().contains("model.safetensors"), "{e}");
    assert!(matches!(HfDir::open(&d.path().join("nope")), Err(SafetensorsError::NotADirectory { .. })));
}

#[test]
fn unsupported_model_type_and_bad_keys() {
    let d = tempfile::tempdir().expect("tempdir");
    write_dir(d.path(), r#"{"model_type":"mamba"}"#);
    assert!(matches!(HfDir::open(d.path()), Err(SafetensorsError::UnsupportedModel { .. })));
    write_dir(d.path(), r#"{"model_type":"llama","hidden_size":"big","num_hidden_layers":1,"num_attention_heads":2}"#);
    let e = HfDir::open(d.path()).expect_err("bad key");
    assert!(matches!(&e, SafetensorsError::Config { key, .. } if key == "hidden_size"), "{e}");
    write_dir(d.path(), r#"{"model_type":"llama","quantization_config":{"quant_method":"gptq"}}"#);
    assert!(matches!(HfDir::open(d.path()), Err(SafetensorsError::QuantizedCheckpoint { .. })));
}

#[test]
fn shard_index_hostile_names_and_mismatch() {
    let d = tempfile::tempdir().expect("tempdir");
    write_dir(
        d.path(),
        r#"{"model_type":"llama","hidden_size":8,"num_hidden_layers":1,"num_attention_heads":2,"intermediate_size":16,"vocab_size":3}"#,
    );
    std::fs::write(d.path().join("model.safetensors.index.json"), r#"{"weight_map":{"a":"../../etc/passwd"}}"#)
        .expect("index");
    assert!(matches!(HfDir::open(d.path()), Err(SafetensorsError::BadShardName { .. })));
    let h = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
    std::fs::write(d.path().join("s1.safetensors"), file(h, 4)).expect("s1");
    std::fs::write(d.path().join("s2.safetensors"), file(h, 4)).expect("s2");
    std::fs::write(
        d.path().join("model.safetensors.index.json"),
        r#"{"weight_map":{"a":"s1.safetensors","b":"s2.safetensors"}}"#,
    )
    .expect("index");
    assert!(matches!(HfDir::open(d.path()), Err(SafetensorsError::IndexMismatch { .. })));
    std::fs::write(d.path().join("model.safetensors.index.json"), r#"{"weight_map":{"a":"s1.safetensors"}}"#)
        .expect("index");
    let ok = HfDir::open(d.path()).expect("one shard");
    assert_eq!(ok.source_model().expect("model").tensors.len(), 1);
    let h2 = r#"{"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#;
    std::fs::write(d.path().join("s2.safetensors"), file(h2, 8)).expect("s2");
    std::fs::write(
        d.path().join("model.safetensors.index.json"),
        r#"{"weight_map":{"a":"s1.safetensors","b":"s2.safetensors"}}"#,
    )
    .expect("index");
    assert!(matches!(HfDir::open(d.path()), Err(SafetensorsError::DuplicateAcrossShards { .. })));
}

#[test]
fn configs_of_each_family() {
    let d = tempfile::tempdir().expect("tempdir");
    std::fs::write(d.path().join("model.safetensors"), file("{}", 0)).expect("weights");
    write_dir(
        d.path(),
        r#"{"model_type":"smollm3","hidden_size":8,"num_hidden_layers":4,"num_attention_heads":2,"num_key_value_heads":1,"intermediate_size":16,"vocab_size":3,"no_rope_layers":[1,1,0,1],"rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}}"#,
    );
    let h = HfDir::open(d.path()).expect("smollm3");
    assert_eq!(h.arch.dims.family, Family::Smollm3);
    assert_eq!(h.arch.no_rope_layers, vec![2]);
    assert_eq!(h.arch.dims.head_dim, 4);
    assert_eq!(h.arch.rope.scaling.as_ref().map(|s| s.factor), Some(8.0));
    assert_eq!(h.tokenizer.bos_token_id, Some(0));
    assert_eq!(h.tokenizer.eos_token_ids, vec![1]);
    assert_eq!(h.tokenizer.chat_template.as_deref(), Some("T"));
    write_dir(
        d.path(),
        r#"{"model_type":"smollm3","hidden_size":8,"num_hidden_layers":8,"num_attention_heads":2,"intermediate_size":16,"vocab_size":3}"#,
    );
    assert_eq!(HfDir::open(d.path()).expect("interval").arch.no_rope_layers, vec![3, 7]);

    write_dir(
        d.path(),
        r#"{"model_type":"gemma3","text_config":{"model_type":"gemma3_text","hidden_size":8,"num_hidden_layers":6,"num_attention_heads":2,"head_dim":16,"intermediate_size":16,"vocab_size":3,"sliding_window":512,"query_pre_attn_scalar":16,"rope_local_base_freq":10000.0,"rope_theta":1000000.0,"final_logit_softcapping":null}}"#,
    );
    let g = HfDir::open(d.path()).expect("gemma3");
    assert_eq!(g.arch.dims.family, Family::Gemma3);
    assert_eq!(g.arch.layer_attention(5), LayerAttention::Full);
    assert_eq!(g.arch.layer_attention(0), LayerAttention::SlidingWindow);
    assert_eq!(g.arch.sliding_window, Some(512));
    assert_eq!(g.arch.rope.local_theta, Some(10000.0));
    assert_eq!(g.arch.hidden_act, "gelu_pytorch_tanh");
    assert!(g.arch.dims.tie_word_embeddings);

    write_dir(
        d.path(),
        r#"{"model_type":"olmoe","hidden_size":8,"num_hidden_layers":1,"num_attention_heads":2,"intermediate_size":4,"vocab_size":3,"num_experts":4,"num_experts_per_tok":2,"norm_topk_prob":false}"#,
    );
    let o = HfDir::open(d.path()).expect("olmoe");
    assert_eq!((o.arch.dims.num_experts, o.arch.dims.top_k, o.arch.moe.is_some()), (4, 2, true));
    assert!(!o.arch.dims.tie_word_embeddings);
}
