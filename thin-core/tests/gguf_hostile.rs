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
    assert_eq!(sm.arch.hidden_size, 64);
    assert_eq!(sm.arch.head_dim, 16);
    assert!(sm.arch.tie_word_embeddings);
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
    for ty in [6u32, 10, 999] {
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
            kv.2 = s("llama");
        }
    }
    assert!(
        matches!(open(&g).unwrap().source_model("x").unwrap_err(), GgufError::UnsupportedTokenizer(m) if m == "llama")
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

// ---- a small GGUF writer for synthetic test files ----
#[allow(dead_code)]
mod w {
    pub const T_U32: u32 = 4;
    pub const T_I32: u32 = 5;
    pub const T_F32: u32 = 6;
    pub const T_BOOL: u32 = 7;
    pub const T_STRING: u32 = 8;
    pub const T_ARRAY: u32 = 9;
    pub const T_U64: u32 = 10;

    pub fn s(v: &str) -> Vec<u8> {
        let mut b = (v.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(v.as_bytes());
        b
    }

    pub fn f16(v: f32) -> [u8; 2] {
        half::f16::from_f32(v).to_bits().to_le_bytes()
    }

    #[derive(Clone)]
    pub struct Tensor {
        pub name: String,
        pub dims: Vec<u64>,
        pub ty: u32,
        pub offset: u64,
    }

    #[derive(Clone)]
    pub struct Gguf {
        pub magic: [u8; 4],
        pub version: u32,
        pub tensor_count: Option<u64>,
        pub kv_count: Option<u64>,
        pub kvs: Vec<(Vec<u8>, u32, Vec<u8>)>,
        pub tensors: Vec<Tensor>,
        pub alignment: u64,
        pub data: Vec<u8>,
    }

    impl Gguf {
        pub fn new() -> Gguf {
            Gguf {
                magic: *b"GGUF",
                version: 3,
                tensor_count: None,
                kv_count: None,
                kvs: Vec::new(),
                tensors: Vec::new(),
                alignment: 32,
                data: Vec::new(),
            }
        }
        pub fn kv(&mut self, key: &str, ty: u32, payload: Vec<u8>) -> &mut Self {
            self.kvs.push((s(key), ty, payload));
            self
        }
        pub fn kv_str(&mut self, key: &str, v: &str) -> &mut Self {
            self.kv(key, T_STRING, s(v))
        }
        pub fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
            self.kv(key, T_U32, v.to_le_bytes().to_vec())
        }
        pub fn kv_f32(&mut self, key: &str, v: f32) -> &mut Self {
            self.kv(key, T_F32, v.to_le_bytes().to_vec())
        }
        pub fn kv_str_array(&mut self, key: &str, vs: &[&str]) -> &mut Self {
            let mut p = T_STRING.to_le_bytes().to_vec();
            p.extend_from_slice(&(vs.len() as u64).to_le_bytes());
            for v in vs {
                p.extend(s(v));
            }
            self.kv(key, T_ARRAY, p)
        }
        pub fn kv_i32_array(&mut self, key: &str, vs: &[i32]) -> &mut Self {
            let mut p = T_I32.to_le_bytes().to_vec();
            p.extend_from_slice(&(vs.len() as u64).to_le_bytes());
            for v in vs {
                p.extend_from_slice(&v.to_le_bytes());
            }
            self.kv(key, T_ARRAY, p)
        }
        /// Appends a tensor whose data goes at the next aligned offset of the data section.
        pub fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, bytes: &[u8]) -> &mut Self {
            let a = self.alignment.max(1) as usize;
            while self.data.len() % a != 0 {
                self.data.push(0);
            }
            let offset = self.data.len() as u64;
            self.data.extend_from_slice(bytes);
            self.tensors.push(Tensor {
                name: name.into(),
                dims: dims.to_vec(),
                ty,
                offset,
            });
            self
        }
        pub fn build(&self) -> Vec<u8> {
            let mut b = self.magic.to_vec();
            b.extend_from_slice(&self.version.to_le_bytes());
            b.extend_from_slice(&self.tensor_count.unwrap_or(self.tensors.len() as u64).to_le_bytes());
            b.extend_from_slice(&self.kv_count.unwrap_or(self.kvs.len() as u64).to_le_bytes());
            for (k, ty, p) in &self.kvs {
                b.extend_from_slice(k);
                b.extend_from_slice(&ty.to_le_bytes());
                b.extend_from_slice(p);
            }
            for t in &self.tensors {
                b.extend(s(&t.name));
                b.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
                for d in &t.dims {
                    b.extend_from_slice(&d.to_le_bytes());
                }
                b.extend_from_slice(&t.ty.to_le_bytes());
                b.extend_from_slice(&t.offset.to_le_bytes());
            }
            let a = self.alignment.max(1) as usize;
            while b.len() % a != 0 {
                b.push(0);
            }
            b.extend_from_slice(&self.data);
            b
        }
    }

    /// Byte-level BPE vocab: the 256 GPT-2 byte symbols, a few merges and one control token.
    pub fn gpt2_tokens() -> Vec<String> {
        let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
            .chain(0xA1..=0xAC)
            .chain(0xAE..=0xFF)
            .collect();
        let mut cs = bs.clone();
        let mut n = 0;
        for b in 0..256u32 {
            if !bs.contains(&b) {
                bs.push(b);
                cs.push(256 + n);
                n += 1;
            }
        }
        let mut toks: Vec<String> = cs
            .iter()
            .map(|&c| char::from_u32(c).map(String::from).unwrap_or_default())
            .collect();
        toks.extend(["he", "ll", "hell", "<|endoftext|>"].iter().map(|s| s.to_string()));
        toks
    }

    /// A valid small llama GGUF with a gpt2 tokenizer and Q8_0, Q4_K and F32 tensors.
    pub fn valid() -> Gguf {
        let toks = gpt2_tokens();
        let tok_refs: Vec<&str> = toks.iter().map(|s| s.as_str()).collect();
        let mut types = vec![1i32; toks.len()];
        let last = types.len() - 1;
        types[last] = 3;
        let mut g = Gguf::new();
        g.kv_str("general.architecture", "llama")
            .kv_str("general.name", "tiny")
            .kv_u32("general.alignment", 32)
            .kv_u32("general.file_type", 7)
            .kv_u32("llama.context_length", 128)
            .kv_u32("llama.embedding_length", 64)
            .kv_u32("llama.block_count", 1)
            .kv_u32("llama.feed_forward_length", 256)
            .kv_u32("llama.attention.head_count", 4)
            .kv_u32("llama.attention.head_count_kv", 2)
            .kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
            .kv_f32("llama.rope.freq_base", 10000.0)
            .kv_str("tokenizer.ggml.model", "gpt2")
            .kv_str_array("tokenizer.ggml.tokens", &tok_refs)
            .kv_i32_array("tokenizer.ggml.token_type", &types)
            .kv_str_array("tokenizer.ggml.merges", &["h e", "l l", "he ll"])
            .kv_u32("tokenizer.ggml.bos_token_id", last as u32)
            .kv_u32("tokenizer.ggml.eos_token_id", last as u32)
            .kv("tokenizer.ggml.add_bos_token", T_BOOL, vec![0])
            .kv_str(
                "tokenizer.chat_template",
                "{% for m in messages %}{{ m.content }}{% endfor %}",
            );
        // Q8_0 [2, 64]: 4 blocks.
        let mut q8 = Vec::new();
        for blk in 0..4 {
            q8.extend_from_slice(&f16(0.25 * (blk + 1) as f32));
            for i in 0..32 {
                q8.push((i as i8 - 16) as u8);
            }
        }
        g.tensor("blk.0.attn_q.weight", &[64, 2], 8, &q8);
        // Q4_K [1, 256]: one block.
        let mut q4k = f16(0.5).to_vec();
        q4k.extend_from_slice(&f16(0.125));
        q4k.extend((0..12u8).map(|i| i * 5 + 1));
        q4k.extend((0..128u32).map(|i| (i * 37 % 256) as u8));
        g.tensor("blk.0.ffn_up.weight", &[256, 1], 12, &q4k);
        // F32 [64].
        let f: Vec<u8> = (0..64).flat_map(|i| (1.0f32 + i as f32 / 64.0).to_le_bytes()).collect();
        g.tensor("blk.0.attn_norm.weight", &[64], 0, &f);
        g.tensor("output_norm.weight", &[64], 0, &f);
        g
    }
}
