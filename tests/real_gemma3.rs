//! The real Gemma 3 270M GGUF (the base model, Q4_K_M with Q5_0/Q8_0/Q6_K tensors) through the real
//! path: its SentencePiece tokenizer gives llama.cpp's ids, it converts, `thin run` continues
//! a prompt as llama.cpp does, and the f32 archive's CPU engine continues four prompts as Hugging
//! Face transformers does.
//!
//! Needs the model file: run `scripts/fetch-gemma3.sh` (or set THIN_GEMMA3_GGUF).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use thin_core::arch::Family;
use thin_core::codec::decode_to_f32;
use thin_core::convert::{convert, ConvertOptions};
use thin_core::dtype::{DType, SourceDType};
use thin_core::engine::Engine;
use thin_core::format::Archive;
use thin_core::gguf::GgufFile;
use thin_core::names::{NameMatch, NameTable};
use thin_core::quant::Profile;
use thin_core::sampler::argmax;
use thin_core::source::SourceKind;
use thin_core::tokenizer::{ChatMessage, TextTokenizer, TokenizerError};

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
    // As an archive stores it: the SentencePiece vocabulary (tokens, scores, types) through the
    // manifest's JSON and back, every score bit for bit.
    let stored = serde_json::to_string(&model.tokenizer).expect("serialize");
    let info: thin_core::manifest::TokenizerInfo = serde_json::from_str(&stored).expect("deserialize");
    assert!(info.sentencepiece.is_some() && info.tokenizer_json.is_empty());
    assert!(info == model.tokenizer, "the stored tokenizer differs from the GGUF's");
    let tok = TextTokenizer::from_info(&info).expect("tokenizer");
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

fn thin(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_thin")).args(args).output().expect("run thin")
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
}

fn f32s(v: &serde_json::Value) -> Vec<f32> {
    v.as_array().expect("array").iter().map(|x| x.as_f64().expect("number") as f32).collect()
}

/// Random Q5_0 and Q5_1 blocks decode to gguf-py's values bit for bit (the file has Q5_0 tensors
/// only).
#[test]
fn q5_blocks_equal_gguf_py() {
    let reference = fixture("gemma3_gguf_ref.json");
    for b in reference["synthetic_blocks"].as_array().expect("blocks") {
        let dtype = match b["type_name"].as_str().expect("type") {
            "Q5_0" => SourceDType::Q5_0,
            "Q5_1" => SourceDType::Q5_1,
            other => panic!("unexpected block type {other}"),
        };
        let want = f32s(&b["values"]);
        let mut got = vec![0f32; want.len()];
        decode_to_f32(dtype, &hex(b["bytes_hex"].as_str().expect("hex")), &mut got).expect("decode");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{}[{i}]: {g} vs {w}", dtype.name());
        }
    }
}

/// The bf16 archive's values, read back from one tensor of every type of the file (Q8_0 embedding,
/// Q5_0, Q4_K, Q6_K, f32 norms), are gguf-py's dequantization rounded to bf16 (norms: f32, unchanged:
/// llama.cpp's converter already stored Gemma's `1 + w`).
fn assert_values_equal_gguf_py(archive: &Archive) {
    let reference = fixture("gemma3_gguf_ref.json");
    let names = NameTable::for_family(thin_generated::KNOWN_ARCHS, Family::Gemma3).expect("gemma3 names");
    let tensors = reference["tensors"].as_array().expect("tensors");
    assert_eq!(tensors.len(), 7);
    for r in tensors {
        let gguf_name = r["name"].as_str().expect("name");
        let NameMatch::Tensor { role, layer, .. } = names.resolve(SourceKind::Gguf, gguf_name).expect("name") else {
            panic!("{gguf_name} is a model tensor");
        };
        let entry = archive.manifest().tensor(role, layer).unwrap_or_else(|| panic!("{gguf_name} not in archive"));
        assert_eq!(entry.source_name, gguf_name);
        assert_eq!(entry.source_dtype.name(), r["type_name"].as_str().expect("type"), "{gguf_name}");
        let bytes = archive.tensor_bytes(entry).expect("bytes");
        let vals: Vec<f32> = match entry.dtype {
            DType::Bf16 => bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            DType::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            other => panic!("{gguf_name} stored as {other:?} by the bf16 profile"),
        };
        assert_eq!(vals.len() as u64, r["n_elements"].as_u64().expect("n"), "{gguf_name}");
        let stored = |v: f32| if entry.dtype == DType::Bf16 { half::bf16::from_f32(v).to_f32() } else { v };
        for (i, w) in f32s(&r["first"]).into_iter().enumerate() {
            assert_eq!(vals[i], stored(w), "{gguf_name}[{i}]");
        }
        let stride = r["stride"].as_u64().expect("stride") as usize;
        for (k, w) in f32s(&r["strided"]).into_iter().enumerate() {
            assert_eq!(vals[k * stride], stored(w), "{gguf_name}[{}]", k * stride);
        }
    }
}

/// `thin run --backend cpu` on the bf16 archive continues two prompts exactly as llama.cpp does
/// greedily on the GGUF (`tests/fixtures/make_gemma_greedy_reference.py`), and stops at
/// `--max-tokens`.
fn assert_greedy_runs_equal_llama_cpp(archive: &Path) {
    for r in fixture("gemma3_greedy_ref.json").as_array().expect("array") {
        let (prompt, max_tokens) = (r["prompt"].as_str().expect("prompt"), r["max_tokens"].as_u64().expect("n"));
        let o = thin(&[
            "run",
            archive.to_str().expect("utf8"),
            "--backend",
            "cpu",
            "--prompt",
            prompt,
            "--max-tokens",
            &max_tokens.to_string(),
            "--format",
            "jsonl",
        ]);
        assert!(o.status.success(), "thin run failed: {}", String::from_utf8_lossy(&o.stderr));
        let lines: Vec<serde_json::Value> =
            String::from_utf8_lossy(&o.stdout).lines().map(|l| serde_json::from_str(l).expect("JSON line")).collect();
        let stats = lines.last().expect("stats");
        assert_eq!((stats["arch"].as_str(), stats["stop"].as_str()), (Some("gemma3-270m"), Some("max_tokens")), "{stats}");
        assert_eq!(stats["generated_tokens"], max_tokens, "{stats}");
        let text: String = lines[1..lines.len() - 1].iter().map(|l| l["text"].as_str().expect("text")).collect();
        assert_eq!(text, r["text"].as_str().expect("text"), "{prompt:?}");
    }
}

/// `thin convert --profile bf16` of the real GGUF, then its values and its greedy runs (one archive
/// for both: the conversion takes most of the time).
#[test]
fn bf16_archive_holds_gguf_py_values_and_runs_like_llama_cpp() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("gemma3-270m-bf16.thin");
    let o = thin(&["convert", gguf_path().to_str().expect("utf8"), "-o", out.to_str().expect("utf8"), "--profile", "bf16", "--quiet"]);
    assert!(o.status.success(), "convert failed: {}", String::from_utf8_lossy(&o.stderr));
    let archive = Archive::open(&out).expect("open");
    let q = archive.manifest().quantization.plan.iter().find(|p| p.name == "blk.0.attn_q").expect("attn_q planned");
    assert!(q.rule.ends_with("Q5_0 blocks dequantized"), "{}", q.rule);
    assert_values_equal_gguf_py(&archive);
    assert_greedy_runs_equal_llama_cpp(&out);
    // The base model's GGUF carries no chat template: --chat says so.
    let o = thin(&["run", out.to_str().expect("utf8"), "--backend", "cpu", "--chat", "--prompt", "Hi"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("the archive has no chat template (needed for --chat)"), "{err}");
}

/// `tests/fixtures/gemma3_hf_greedy.json` (`tests/fixtures/make_gemma_hf_greedy.py`): what
/// transformers does with the same GGUF, dequantized, in fp32 with eager attention.
fn hf_reference() -> serde_json::Value {
    fixture("gemma3_hf_greedy.json")
}

fn u32s(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().expect("array").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

/// The f32 archive (every block dequantized exactly, as transformers dequantizes it) through the
/// generated `gemma3-270m` CPU engine: on each of the four prompts the prompt ids equal HF's
/// tokenizer's and the greedy continuation (32 tokens) equals transformers' `generate`, token for
/// token, with no divergence to excuse. At every step our two best tokens are HF's and their logits
/// are within 1e-3 of HF's fp64 teacher-forced ones (measured: at most 2.5e-5 from fp64 and 4.4e-5
/// from `generate`'s fp32, on logits near 20); HF's narrowest fp64 margins between its top two are
/// 0.0154 ("Once upon a time…", step 5) and 0.0246 ("Paris…", step 1), far above that.
#[test]
fn f32_greedy_continuations_equal_transformers() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("gemma3-270m-f32.thin");
    let options = ConvertOptions {
        profile: Profile::shipped("f32").expect("shipped"),
        allow_requantize: false,
        progress: false,
        archs: thin_generated::KNOWN_ARCHS,
    };
    convert(&gguf_path(), &out, &options).expect("convert");
    let archive = Archive::open(&out).expect("open");
    use thin_generated::gemma3_270m as m;
    assert_eq!(archive.manifest().shape_fingerprint, m::SHAPE_FINGERPRINT);
    let tok = TextTokenizer::from_info(&archive.manifest().tokenizer).expect("tokenizer");
    let mut engine = m::Engine::new(archive).expect("bind the weights");

    let reference = hf_reference();
    let cases = reference["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 4);
    for case in cases {
        let prompt = case["prompt"].as_str().expect("prompt");
        let prompt_ids = tok.encode(prompt).expect("encode");
        assert_eq!(prompt_ids, u32s(&case["prompt_ids"]), "prompt ids of {prompt:?}");
        let want = u32s(&case["greedy_ids"]);
        assert_eq!(want.len(), 32, "{prompt:?}: HF stopped early");
        engine.reset();
        let mut logits = engine.prefill(&prompt_ids).expect("prefill").to_vec();
        let mut got = Vec::new();
        while got.len() < want.len() {
            let next = argmax(&logits);
            let step = got.len();
            let hf = &case["top2"][step]["forced_fp64"];
            let second = (0..logits.len()).filter(|&i| i != next as usize).max_by(|&a, &b| logits[a].total_cmp(&logits[b])).expect("vocab");
            let ours = [(next as usize, logits[next as usize]), (second, logits[second])];
            if std::env::var_os("THIN_DEBUG_MARGIN").is_some() {
                eprintln!("{prompt:?} step {step} top {ours:?} HF {}", case["top2"][step]);
            }
            for (k, &(id, logit)) in ours.iter().enumerate() {
                let (hf_id, hf_logit) = (hf["ids"][k].as_u64().expect("id") as usize, hf["logits"][k].as_f64().expect("logit"));
                assert!(id == hf_id && (f64::from(logit) - hf_logit).abs() < 1e-3, "{prompt:?} step {step}: our top two {ours:?}, HF's {hf}");
            }
            got.push(next);
            if tok.is_eos(next) {
                break;
            }
            logits.copy_from_slice(engine.decode_step(next).expect("decode"));
        }
        assert_eq!(got, want, "greedy continuation of {prompt:?}: ours {:?} vs HF {:?}", tok.decode(&got), case["greedy_text"]);
    }
}

/// The base model's GGUF carries no `tokenizer.chat_template`, and transformers' tokenizer built
/// from it has none either: its `apply_chat_template` refuses each of the fixture's conversations
/// (one user turn; system + user; user / assistant / user). thin's tokenizer, as the GGUF gives it
/// to an archive, has no template either and its renderer refuses the same conversations
/// (`thin run --chat` on the converted archive says so: the bf16 test above).
#[test]
fn chat_template_absent_as_in_transformers() {
    let reference = hf_reference();
    let chat = &reference["chat"];
    assert_eq!(chat["gguf_has_chat_template"], false);
    assert!(chat["hf_chat_template"].is_null(), "{}", chat["hf_chat_template"]);
    let gguf = GgufFile::open(&gguf_path()).expect("open");
    let model = gguf.source_model("gemma-3-270m-q4_k_m.gguf").expect("source model");
    assert_eq!(model.tokenizer.chat_template, None);
    let tok = TextTokenizer::from_info(&model.tokenizer).expect("tokenizer");
    let conversations = chat["conversations"].as_array().expect("conversations");
    assert_eq!(conversations.len(), 3);
    for c in conversations {
        let error = c["error"].as_str().expect("HF refused");
        assert!(error.contains("chat_template"), "{error}");
        assert!(c.get("rendered").is_none());
        let messages: Vec<ChatMessage> = c["messages"]
            .as_array()
            .expect("messages")
            .iter()
            .map(|m| ChatMessage { role: m["role"].as_str().expect("role").into(), content: m["content"].as_str().expect("content").into() })
            .collect();
        assert!(matches!(tok.render_chat(&messages), Err(TokenizerError::NoChatTemplate)));
    }
}
