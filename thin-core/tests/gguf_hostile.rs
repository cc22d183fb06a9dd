//! Hostile GGUF inputs: each malformed file gives its typed error, never a panic.

use thin_core::codec::{decode_to_f32, CodecError};
use thin_core::gguf::{GgufError, GgufFile, GgufValue};
use w::*;

fn open(g: &Gguf) -> Result<GgufFile, GgufError> {
    GgufFile::from_bytes(g.build())
}

fn err(g: &Gguf) -> GgufError {
    match open(g) {
        Ok(_) => panic!("expected an error"),
        Err(e) => e,
    }
}

#[test]
fn valid_file_opens_from_disk() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tiny.gguf");
    // Pad the data so the file is large enough to be memory-mapped.
    let mut g = valid();
    g.tensor("big.weight", &[2048], 0, &vec![0u8; 8192]);
    std::fs::write(&p, g.build()).unwrap();
    let f = GgufFile::open(&p).expect("open");
    assert_eq!(f.version(), 3);
    assert_eq!(
        f.metadata().get("general.name"),
        Some(&GgufValue::String("tiny".into()))
    );
    assert_eq!(f.tensor_infos().len(), 5);
    let sm = f.source_model("tiny.gguf").expect("source_model");
    assert_eq!(sm.arch.dims.hidden_size, 64);
    assert_eq!(sm.arch.dims.head_dim, 16);
    assert!(sm.arch.dims.tie_word_embeddings);
    let q = sm.tensors.iter().find(|t| t.name == "blk.0.attn_q.weight").unwrap();
    assert_eq!(q.shape, vec![2, 64], "reversed to row-major");
    assert_eq!(q.bytes.len(), 136);
    let mut out = vec![0f32; 128];
    decode_to_f32(q.dtype, q.bytes, &mut out).unwrap();
    assert_eq!(out[0], -16.0 * 0.25);
    assert_eq!(out[127], 15.0 * 1.0);
    assert_eq!(sm.source_config["tensor_types"]["F32"], 3);
    assert_eq!(sm.details["alignment"], "32");
    let tk: tokenizers::Tokenizer = sm.tokenizer.tokenizer_json.parse().unwrap();
    assert_eq!(tk.encode("hello", false).unwrap().get_ids()[0], 258);
}

#[test]
fn missing_file_is_io() {
    let e = GgufFile::open(std::path::Path::new("/nonexistent/x.gguf")).unwrap_err();
    assert!(matches!(e, GgufError::Io { .. }), "{e:?}");
}

#[test]
fn bad_magic() {
    let mut g = valid();
    g.magic = *b"GGUX";
    assert!(matches!(err(&g), GgufError::BadMagic { found } if &found == b"GGUX"));
    assert!(matches!(
        GgufFile::from_bytes(b"GG".to_vec()),
        Err(GgufError::BadMagic { .. })
    ));
    assert!(matches!(
        GgufFile::from_bytes(Vec::new()),
        Err(GgufError::BadMagic { .. })
    ));
}

#[test]
fn version_1_and_99() {
    for v in [1, 99, 0] {
        let mut g = valid();
        g.version = v;
        assert!(matches!(err(&g), GgufError::UnsupportedVersion(x) if x == v));
    }
    let mut g = valid();
    g.version = 2;
    assert_eq!(open(&g).unwrap().version(), 2);
}

#[test]
fn alignment_zero_and_non_power_of_two() {
    let mut g = Gguf::new();
    g.kv_u32("general.alignment", 0);
    assert!(matches!(err(&g), GgufError::BadAlignment(0)));
    let mut g = Gguf::new();
    g.kv_u32("general.alignment", 48);
    assert!(matches!(err(&g), GgufError::BadAlignment(48)));
    let mut g = Gguf::new();
    g.kv_str("general.alignment", "32");
    assert!(matches!(err(&g), GgufError::WrongKeyType { .. }));
    // Absent: default 32.
    let mut g = Gguf::new();
    g.tensor("a", &[8], 0, &[0u8; 32]);
    assert_eq!(open(&g).unwrap().alignment(), 32);
}

#[test]
fn absurd_tensor_count() {
    let mut g = valid();
    g.tensor_count = Some(u64::MAX);
    assert!(matches!(
        err(&g),
        GgufError::TooMany {
            what: "tensors",
            count: u64::MAX,
            ..
        }
    ));
    // Under the cap but more than the file could hold.
    g.tensor_count = Some(100_000);
    assert!(matches!(err(&g), GgufError::Truncated { .. }));
}

#[test]
fn absurd_kv_count() {
    let mut g = valid();
    g.kv_count = Some(u64::MAX);
    assert!(matches!(
        err(&g),
        GgufError::TooMany {
            what: "metadata keys",
            ..
        }
    ));
    g.kv_count = Some(60_000);
    assert!(matches!(err(&g), GgufError::Truncated { .. }));
}

#[test]
fn huge_string_length() {
    let mut g = Gguf::new();
    let mut p = u64::MAX.to_le_bytes().to_vec();
    p.extend_from_slice(b"abc");
    g.kv("general.name", T_STRING, p);
    assert!(matches!(
        err(&g),
        GgufError::TooMany {
            what: "string bytes",
            ..
        }
    ));
    // Under the cap, past the end of the file.
    let mut g = Gguf::new();
    let mut p = 1_000_000u64.to_le_bytes().to_vec();
    p.extend_from_slice(b"abc");
    g.kv("general.name", T_STRING, p);
    assert!(matches!(err(&g), GgufError::Truncated { .. }));
    // Huge key length.
    let mut g = Gguf::new();
    g.kvs.push((u64::MAX.to_le_bytes().to_vec(), T_U32, vec![0; 4]));
    assert!(matches!(err(&g), GgufError::TooMany { .. }));
    // Invalid UTF-8.
    let mut g = Gguf::new();
    g.kv("general.name", T_STRING, vec![2, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFE]);
    assert!(matches!(err(&g), GgufError::BadString { .. }));
}

#[test]
fn huge_array_length_and_deep_nesting() {
    let mut g = Gguf::new();
    let mut p = T_U32.to_le_bytes().to_vec();
    p.extend_from_slice(&u64::MAX.to_le_bytes());
    g.kv("a", T_ARRAY, p);
    assert!(matches!(
        err(&g),
        GgufError::TooMany {
            what: "array elements",
            ..
        }
    ));
    let mut g = Gguf::new();
    let mut p = T_U32.to_le_bytes().to_vec();
    p.extend_from_slice(&1_000_000u64.to_le_bytes());
    g.kv("a", T_ARRAY, p);
    assert!(matches!(err(&g), GgufError::Truncated { .. }));
    let mut p = Vec::new();
    for _ in 0..10 {
        p.extend_from_slice(&T_ARRAY.to_le_bytes());
        p.extend_from_slice(&1u64.to_le_bytes());
    }
    let mut g = Gguf::new();
    g.kv("deep", T_ARRAY, p);
    assert!(matches!(err(&g), GgufError::ArrayTooDeep { .. }));
    let mut g = Gguf::new();
    g.kv("k", 77, vec![]);
    assert!(matches!(err(&g), GgufError::UnknownValueType { value_type: 77, .. }));
}

#[test]
fn total_array_elements_capped() {
    // Three arrays of 3M u8 each: each is under the per-array cap, together over the file cap.
    let mut g = Gguf::new();
    for k in ["a", "b", "c"] {
        let mut p = 0u32.to_le_bytes().to_vec();
        p.extend_from_slice(&3_000_000u64.to_le_bytes());
        p.extend(std::iter::repeat(7u8).take(3_000_000));
        g.kv(k, T_ARRAY, p);
    }
    assert!(matches!(
        err(&g),
        GgufError::TooMany {
            what: "array elements in the file",
            ..
        }
    ));
}

#[test]
fn nine_dims() {
    let mut g = Gguf::new();
    g.tensor("a", &[1; 9], 0, &[0u8; 4]);
    assert!(matches!(err(&g), GgufError::TooManyDims { n_dims: 9, .. }));
}

#[test]
fn dims_overflow() {
    let mut g = Gguf::new();
    g.tensor("a", &[1 << 32, 1 << 32, 2], 0, &[0u8; 4]);
    assert!(matches!(err(&g), GgufError::DimOverflow { tensor } if tensor == "a"));
    let mut g = Gguf::new();
    g.tensor("a", &[u64::MAX], 0, &[0u8; 4]);
    assert!(matches!(err(&g), GgufError::DimOverflow { .. }));
    // Element count fits but the byte length does not.
    let mut g = Gguf::new();
    g.tensor("a", &[1 << 31, 1 << 31], 0, &[0u8; 4]);
    assert!(matches!(err(&g), GgufError::DimOverflow { .. }));
}

#[test]
fn partial_block() {
    let mut g = Gguf::new();
    g.tensor("a", &[31, 2], 8, &[0u8; 68]);
    assert!(matches!(err(&g), GgufError::PartialBlock { .. }));
}

#[test]
fn data_past_eof() {
    let mut g = Gguf::new();
    g.tensor("a", &[64], 0, &[0u8; 100]);
    assert!(matches!(err(&g), GgufError::DataOutOfBounds { tensor, .. } if tensor == "a"));
    let mut g = Gguf::new();
    g.tensor("a", &[8], 0, &[0u8; 32]);
    g.tensors[0].offset = u64::MAX - 31;
    assert!(matches!(err(&g), GgufError::DataOutOfBounds { .. }));
    // Misaligned offset.
    let mut g = Gguf::new();
    g.tensor("a", &[8], 0, &[0u8; 64]);
    g.tensors[0].offset = 4;
    assert!(matches!(err(&g), GgufError::MisalignedTensor { .. }));
}

#[test]
fn overlapping_tensors() {
    let mut g = Gguf::new();
    g.tensor("a", &[16], 0, &[0u8; 64]);
    g.tensor("b", &[16], 0, &[0u8; 64]);
    g.tensors[1].offset = 32;
    assert!(matches!(err(&g), GgufError::TensorOverlap { first, second } if first == "a" && second == "b"));
}

#[test]
fn unknown_type() {
    for ty in [4u32, 10, 999] {
        let mut g = Gguf::new();
        g.tensor("a", &[32], ty, &[0u8; 64]);
        assert!(matches!(err(&g), GgufError::UnknownType { ggml_type, .. } if ggml_type == ty));
    }
}

#[test]
fn duplicate_tensor_name_and_key() {
    let mut g = Gguf::new();
    g.tensor("a", &[8], 0, &[0u8; 32]);
    g.tensor("a", &[8], 0, &[0u8; 32]);
    assert!(matches!(err(&g), GgufError::DuplicateTensor(n) if n == "a"));
    let mut g = Gguf::new();
    g.kv_u32("x", 1).kv_u32("x", 2);
    assert!(matches!(err(&g), GgufError::DuplicateKey(k) if k == "x"));
}

#[test]
fn nan_scale_in_q8_0_block() {
    let mut q8 = vec![0u8; 68];
    q8[34..36].copy_from_slice(&f16(f32::NAN));
    let mut g = valid();
    g.tensor("bad.weight", &[64], 8, &q8);
    let f = open(&g).expect("parses: scales are only checked on decode");
    let t = f.tensor_infos().iter().find(|t| t.name == "bad.weight").unwrap();
    let mut out = vec![0f32; 64];
    let e = decode_to_f32(t.dtype, f.tensor_data(t), &mut out).unwrap_err();
    assert!(
        matches!(
            e,
            CodecError::NonFinite {
                dtype: "Q8_0",
                block: 1
            }
        ),
        "{e:?}"
    );
    let ge: GgufError = e.into();
    assert!(matches!(ge, GgufError::Codec(CodecError::NonFinite { .. })));
}

#[test]
fn metadata_errors() {
    let mut g = valid();
    g.kvs.retain(|(k, _, _)| k != &s("llama.block_count"));
    let f = open(&g).unwrap();
    assert!(matches!(f.source_model("x").unwrap_err(), GgufError::MissingKey(k) if k == "llama.block_count"));
    let mut g = valid();
    g.kvs[0] = (s("general.architecture"), T_STRING, s("mamba"));
    assert!(matches!(open(&g).unwrap().source_model("x").unwrap_err(), GgufError::UnsupportedArch(a) if a == "mamba"));
    let mut g = valid();
    for kv in g.kvs.iter_mut() {
        if kv.0 == s("tokenizer.ggml.model") {
            kv.2 = s("bert");
        }
    }
    assert!(
        matches!(open(&g).unwrap().source_model("x").unwrap_err(), GgufError::UnsupportedTokenizer(m) if m == "bert")
    );
    let mut g = valid();
    for kv in g.kvs.iter_mut() {
        if kv.0 == s("llama.block_count") {
            *kv = (kv.0.clone(), T_STRING, s("one"));
        }
    }
    assert!(matches!(
        open(&g).unwrap().source_model("x").unwrap_err(),
        GgufError::WrongKeyType { .. }
    ));
}

// The synthetic GGUF writer lives in tests/common/gguf_writer.rs.
#[allow(dead_code)]
#[path = "common/gguf_writer.rs"]
mod w;
