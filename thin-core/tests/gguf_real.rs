//! The real SmolLM2-135M-Instruct Q4_1 GGUF against reference values computed with gguf-py
//! (`scripts/gguf_reference.py` -> `tests/fixtures/smollm2_gguf_ref.json`).
//!
//! Needs the model file: run `scripts/fetch-smollm2.sh` (or set THIN_SMOLLM2_GGUF).

use std::path::PathBuf;

use thin_core::arch::Family;
use thin_core::codec::decode_to_f32;
use thin_core::gguf::GgufFile;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn model_path() -> PathBuf {
    let p = match std::env::var_os("THIN_SMOLLM2_GGUF") {
        Some(p) => PathBuf::from(p),
        None => repo().join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    };
    assert!(
        p.is_file(),
        "SmolLM2 GGUF not found at {}: run scripts/fetch-smollm2.sh first (or set THIN_SMOLLM2_GGUF)",
        p.display()
    );
    p
}

fn reference() -> serde_json::Value {
    let p = repo().join("tests/fixtures/smollm2_gguf_ref.json");
    let s = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&s).expect("reference json")
}

fn close(a: f32, b: f64) -> bool {
    ((a as f64) - b).abs() <= 1e-6 * b.abs().max(1e-30)
}

#[test]
fn metadata_matches_reference() {
    let r = reference();
    let m = &r["metadata"];
    let f = GgufFile::open(&model_path()).expect("open");
    assert_eq!(f.version() as u64, m["gguf_version"].as_u64().unwrap());
    assert_eq!(f.tensor_infos().len() as u64, m["tensor_count"].as_u64().unwrap());
    let sm = f.source_model("SmolLM2-135M-Instruct.Q4_1.gguf").expect("source_model");
    let a = &sm.arch;
    assert_eq!(a.dims.family, Family::Llama);
    assert_eq!(a.dims.num_layers, m["block_count"].as_u64().unwrap());
    assert_eq!(a.dims.hidden_size, m["embedding_length"].as_u64().unwrap());
    assert_eq!(a.dims.intermediate_size, m["feed_forward_length"].as_u64().unwrap());
    assert_eq!(a.dims.num_heads, m["head_count"].as_u64().unwrap());
    assert_eq!(a.dims.num_kv_heads, m["head_count_kv"].as_u64().unwrap());
    assert_eq!(a.dims.head_dim, 64);
    assert_eq!(a.max_position_embeddings, m["context_length"].as_u64().unwrap());
    assert_eq!(a.dims.vocab_size, m["vocab_size"].as_u64().unwrap());
    assert_eq!(a.rope.theta, m["rope_freq_base"].as_f64().unwrap());
    assert!((a.rms_norm_eps - m["rms_eps"].as_f64().unwrap()).abs() < 1e-12);
    assert_eq!(a.dims.tie_word_embeddings, !m["has_output_weight"].as_bool().unwrap());
    assert_eq!(
        sm.tokenizer.bos_token_id,
        Some(m["bos_token_id"].as_u64().unwrap() as u32)
    );
    assert_eq!(
        sm.tokenizer.eos_token_ids,
        vec![m["eos_token_id"].as_u64().unwrap() as u32]
    );
    assert_eq!(sm.tokenizer.add_bos, m["add_bos_token"].as_bool().unwrap());
    let tmpl = sm.tokenizer.chat_template.as_deref().expect("chat template");
    assert!(tmpl.contains("<|im_start|>"));
    assert_eq!(sm.details["gguf_version"], "3");
    assert_eq!(
        sm.details["general.file_type"],
        m["file_type"].as_u64().unwrap().to_string()
    );
    for (ty, n) in m["tensor_type_counts"].as_object().unwrap() {
        assert_eq!(sm.source_config["tensor_types"][ty], *n, "{ty}");
    }
    let emb = sm.tensors.iter().find(|t| t.name == "token_embd.weight").unwrap();
    assert_eq!(emb.shape, vec![49152, 576]);
}

#[test]
fn decode_matches_gguf_py() {
    let r = reference();
    let f = GgufFile::open(&model_path()).expect("open");
    for rt in r["tensors"].as_array().unwrap() {
        let name = rt["name"].as_str().unwrap();
        let t = f
            .tensor_infos()
            .iter()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(t.ggml_type as u64, rt["ggml_type"].as_u64().unwrap(), "{name}");
        let dims: Vec<u64> = rt["dims"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        assert_eq!(t.dims, dims, "{name}");
        let bytes = f.tensor_data(t);
        assert_eq!(bytes.len() as u64, rt["n_bytes"].as_u64().unwrap(), "{name}");
        assert_eq!(
            blake3::hash(bytes).to_hex().as_str(),
            rt["blake3"].as_str().unwrap(),
            "{name} raw bytes"
        );
        let n = rt["n_elements"].as_u64().unwrap() as usize;
        let mut out = vec![0f32; n];
        let t0 = std::time::Instant::now();
        decode_to_f32(t.dtype, bytes, &mut out).expect("decode");
        let dt = t0.elapsed().as_secs_f64();
        if n > 300_000 {
            eprintln!(
                "{name} {}: {:.2} GB/s of f32 output ({} elements in {:.2} ms, 1 thread)",
                t.dtype.name(),
                (n * 4) as f64 / dt / 1e9,
                n,
                dt * 1e3
            );
        }
        for (i, v) in rt["first"].as_array().unwrap().iter().enumerate() {
            let v = v.as_f64().unwrap();
            assert!(close(out[i], v), "{name}[{i}] = {} want {v}", out[i]);
        }
        let stride = rt["stride"].as_u64().unwrap() as usize;
        for (k, v) in rt["strided"].as_array().unwrap().iter().enumerate() {
            let v = v.as_f64().unwrap();
            assert!(
                close(out[k * stride], v),
                "{name}[{}] = {} want {v}",
                k * stride,
                out[k * stride]
            );
        }
        let sum: f64 = out.iter().map(|&x| x as f64).sum();
        let sq: f64 = out.iter().map(|&x| (x as f64) * (x as f64)).sum();
        let (rs, rq) = (rt["sum"].as_f64().unwrap(), rt["sum_sq"].as_f64().unwrap());
        assert!((sum - rs).abs() <= 1e-9 * rq.max(1.0), "{name} sum {sum} want {rs}");
        assert!((sq - rq).abs() <= 1e-9 * rq.max(1.0), "{name} sum_sq {sq} want {rq}");
    }
}

#[test]
fn tokenizer_loads_and_encodes() {
    let f = GgufFile::open(&model_path()).expect("open");
    let sm = f.source_model("x.gguf").expect("source_model");
    let tk: tokenizers::Tokenizer = sm.tokenizer.tokenizer_json.parse().expect("tokenizer.json");
    assert_eq!(tk.get_vocab_size(true), 49152);
    assert_eq!(tk.token_to_id("<|im_start|>"), Some(1));
    assert_eq!(tk.token_to_id("<|im_end|>"), Some(2));
    for text in [
        "Hello, world!",
        "The capital of France is Paris.",
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
    ] {
        let enc = tk.encode(text, false).expect("encode");
        assert!(!enc.get_ids().is_empty());
        let dec = tk.decode(enc.get_ids(), false).expect("decode");
        assert_eq!(dec, text);
        eprintln!("{text:?} -> {:?}", enc.get_ids());
    }
    // SmolLM2 was trained with digits split one by one; its vocab has no multi-digit merges, so
    // the plain ByteLevel pre-tokenizer of transformers' GGUF converter gives the same ids.
    let enc = tk.encode("12345", false).unwrap();
    assert_eq!(enc.get_ids().len(), 5, "{:?}", enc.get_ids());
    let enc = tk.encode("<|im_start|>user", false).unwrap();
    assert_eq!(enc.get_ids()[0], 1, "special token is one id");
}

/// Random blocks of every block format (incl. the K-quants SmolLM2 does not use), dequantized by
/// gguf-py: must match bit for bit. Needs only the fixture, not the model file.
#[test]
fn synthetic_blocks_match_gguf_py() {
    let r = reference();
    let blocks = r["synthetic_blocks"].as_array().expect("synthetic_blocks");
    assert_eq!(blocks.len(), 6);
    for b in blocks {
        let ty = b["ggml_type"].as_u64().unwrap() as u32;
        let dtype = thin_core::gguf::dtype_from_ggml(ty).expect("known type");
        let hex = b["bytes_hex"].as_str().unwrap();
        let bytes: Vec<u8> = (0..hex.len() / 2)
            .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
            .collect();
        let want: Vec<f64> = b["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        let mut out = vec![0f32; want.len()];
        decode_to_f32(dtype, &bytes, &mut out).expect("decode");
        for (i, (&o, &w)) in out.iter().zip(&want).enumerate() {
            // serde_json's float parsing may be off by an ulp of f64; rounding to f32 is exact.
            assert_eq!(o.to_bits(), (w as f32).to_bits(), "{} [{i}]: {o} vs {w}", dtype.name());
        }
    }
}
