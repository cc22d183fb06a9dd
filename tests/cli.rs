//! End-to-end tests of the `thin` binary on a tiny Llama directory written here.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use safetensors::tensor::{Dtype, TensorView};
use serde_json::Value;

const HIDDEN: usize = 64;
const LAYERS: usize = 2;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 16;
const INTER: usize = 128;
const VOCAB: usize = 32;

const TOKENIZER: &str = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[{"id":0,"content":"<s>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true},{"id":1,"content":"</s>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}],"normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,"model":{"type":"WordLevel","vocab":{"<s>":0,"</s>":1,"<unk>":2,"a":3,"b":4},"unk_token":"<unk>"}}"#;

fn thin(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_thin")).args(args).output().expect("run thin")
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes()).collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn write_model(dir: &Path) {
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "intermediate_size": INTER, "vocab_size": VOCAB, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 128, "rope_theta": 10000.0, "tie_word_embeddings": false,
        "bos_token_id": 0, "eos_token_id": 1, "hidden_act": "silu", "torch_dtype": "bfloat16",
    });
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config");
    std::fs::write(dir.join("tokenizer.json"), TOKENIZER).expect("tokenizer");
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"bos_token":"<s>","eos_token":"</s>","chat_template":"{{ messages }}"}"#,
    )
    .expect("tokenizer_config");

    let mut specs: Vec<(String, Vec<usize>, bool)> = vec![
        ("model.embed_tokens.weight".into(), vec![VOCAB, HIDDEN], true),
        ("model.norm.weight".into(), vec![HIDDEN], false),
        ("lm_head.weight".into(), vec![VOCAB, HIDDEN], true),
    ];
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}");
        specs.extend([
            (format!("{p}.input_layernorm.weight"), vec![HIDDEN], false),
            (format!("{p}.self_attn.q_proj.weight"), vec![HEADS * HEAD_DIM, HIDDEN], true),
            (format!("{p}.self_attn.k_proj.weight"), vec![KV_HEADS * HEAD_DIM, HIDDEN], true),
            (format!("{p}.self_attn.v_proj.weight"), vec![KV_HEADS * HEAD_DIM, HIDDEN], true),
            (format!("{p}.self_attn.o_proj.weight"), vec![HIDDEN, HEADS * HEAD_DIM], true),
            (format!("{p}.post_attention_layernorm.weight"), vec![HIDDEN], false),
            (format!("{p}.mlp.gate_proj.weight"), vec![INTER, HIDDEN], true),
            (format!("{p}.mlp.up_proj.weight"), vec![INTER, HIDDEN], true),
            // One f32 matrix: a mixed-dtype checkpoint.
            (format!("{p}.mlp.down_proj.weight"), vec![HIDDEN, INTER], l != 1),
        ]);
    }
    let data: Vec<(String, Vec<usize>, Dtype, Vec<u8>)> = specs
        .into_iter()
        .enumerate()
        .map(|(i, (name, shape, bf16))| {
            let v = values(shape.iter().product(), i as u64 + 1);
            if bf16 {
                (name, shape, Dtype::BF16, bf16_bytes(&v))
            } else {
                (name, shape, Dtype::F32, f32_bytes(&v))
            }
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> =
        data.iter().map(|(n, s, d, b)| (n.clone(), TensorView::new(*d, s.clone(), b).expect("view"))).collect();
    let bytes = safetensors::tensor::serialize(views, None).expect("serialize");
    std::fs::write(dir.join("model.safetensors"), bytes).expect("weights");
}

struct Fixture {
    _tmp: tempfile::TempDir,
    model: PathBuf,
    root: PathBuf,
}

fn fixture() -> Fixture {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model = tmp.path().join("tiny-llama");
    std::fs::create_dir(&model).expect("mkdir");
    write_model(&model);
    let root = tmp.path().to_path_buf();
    Fixture { _tmp: tmp, model, root }
}

fn convert(f: &Fixture, out: &str, extra: &[&str]) -> PathBuf {
    let out = f.root.join(out);
    let mut args = vec!["convert", f.model.to_str().expect("utf8"), "-o", out.to_str().expect("utf8"), "--quiet"];
    args.extend_from_slice(extra);
    let o = thin(&args);
    assert!(o.status.success(), "convert failed: {}", String::from_utf8_lossy(&o.stderr));
    out
}

fn inspect_json(path: &Path) -> Value {
    let o = thin(&["inspect", path.to_str().expect("utf8"), "--json"]);
    assert!(o.status.success(), "inspect failed: {}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).expect("inspect --json prints one JSON object")
}

#[test]
fn convert_is_deterministic() {
    let f = fixture();
    let a = convert(&f, "a.thin", &[]);
    let b = convert(&f, "b.thin", &[]);
    let (a, b) = (std::fs::read(a).expect("a"), std::fs::read(b).expect("b"));
    assert!(a == b, "two conversions of the same source differ");
}

#[test]
fn inspect_json_describes_the_model() {
    let f = fixture();
    let out = convert(&f, "m.thin", &[]);
    let j = inspect_json(&out);
    for key in ["header", "arch", "shape_fingerprint", "roles", "quantization", "tensors"] {
        assert!(j.get(key).is_some(), "inspect --json lacks `{key}`");
    }
    assert_eq!(j["arch"]["family"], "llama");
    assert_eq!(j["arch"]["hidden_size"], HIDDEN as u64);
    assert_eq!(j["arch"]["num_layers"], LAYERS as u64);
    assert_eq!(j["shape_fingerprint"].as_str().map(str::len), Some(64));
    assert_eq!(j["header"]["version"], 0);
    let tensors = j["tensors"].as_array().expect("tensors");
    assert_eq!(tensors.len(), 3 + 9 * LAYERS);
    assert_eq!(tensors[0]["name"], "token_embd");
    assert_eq!(j["roles"]["attn_q"]["count"], LAYERS as u64);
    assert_eq!(j["quantization"]["method"], "bf16");
    let t = |name: &str| tensors.iter().find(|t| t["name"] == name).unwrap_or_else(|| panic!("no {name}"));
    let q = t("blk.0.attn_q");
    assert_eq!(q["dtype"], "bf16");
    assert_eq!(q["shape"], serde_json::json!([HEADS * HEAD_DIM, HIDDEN]));
    assert_eq!(q["exact_storage_preserved"], true);
    assert_eq!(q["source_name"], "model.layers.0.self_attn.q_proj.weight");
    assert_eq!(q["bytes"], (HEADS * HEAD_DIM * HIDDEN * 2) as u64);
    let norm = t("blk.1.attn_norm");
    assert_eq!(norm["dtype"], "f32");
    let down = t("blk.1.ffn_down");
    assert_eq!(down["dtype"], "bf16");
    assert_eq!(down["source_dtype"], "F32");
    assert_eq!(down["exact_storage_preserved"], false);

    let f32_out = convert(&f, "f32.thin", &["--profile", "f32"]);
    let j = inspect_json(&f32_out);
    assert!(j["tensors"].as_array().expect("tensors").iter().all(|t| t["dtype"] == "f32"));
    assert_eq!(j["quantization"]["method"], "f32");

    let text = thin(&["inspect", out.to_str().expect("utf8")]);
    assert!(text.status.success());
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("llama") && text.contains("attn_q"), "{text}");
}

#[test]
fn verify_passes_then_names_the_corrupted_page_and_tensor() {
    let f = fixture();
    let out = convert(&f, "v.thin", &[]);
    let o = thin(&["verify", out.to_str().expect("utf8")]);
    assert!(o.status.success(), "verify failed: {}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("pages"));

    let j = inspect_json(&out);
    let tensors = j["tensors"].as_array().expect("tensors");
    let q = tensors.iter().find(|t| t["name"] == "blk.0.attn_q").expect("attn_q");
    let page = q["first_page"].as_u64().expect("first_page");
    let pages = j["pages"].as_array().expect("pages");
    let p = pages.iter().find(|p| p["page_id"].as_u64() == Some(page)).expect("page entry");
    let offset = p["offset"].as_u64().expect("offset") as usize;
    let mut bytes = std::fs::read(&out).expect("read");
    bytes[offset + 3] ^= 0x40;
    std::fs::write(&out, bytes).expect("write");

    let o = thin(&["verify", out.to_str().expect("utf8")]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.starts_with("error:"), "{err}");
    assert!(err.contains(&page.to_string()), "error does not name page {page}: {err}");
    assert!(err.contains("blk.0.attn_q"), "error does not name the tensor: {err}");
}

#[test]
fn missing_source_is_a_clear_error_and_writes_nothing() {
    let f = fixture();
    let missing = f.root.join("no-such-model");
    let out = f.root.join("never.thin");
    let o = thin(&["convert", missing.to_str().expect("utf8"), "-o", out.to_str().expect("utf8")]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.starts_with("error:") && err.contains("no-such-model"), "{err}");
    assert!(!out.exists());
    let leftovers: Vec<_> =
        std::fs::read_dir(&f.root).expect("ls").filter_map(Result::ok).map(|e| e.file_name()).collect();
    assert_eq!(leftovers.len(), 1, "only the model dir should exist: {leftovers:?}");
}

#[test]
fn source_with_unknown_tensor_fails_naming_it() {
    let f = fixture();
    let extra = vec![0u8; 8];
    let mut bytes = std::fs::read(f.model.join("model.safetensors")).expect("read");
    // Rewrite the file with one extra, unknown tensor.
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse");
    let mut views: Vec<(String, TensorView<'_>)> = st.tensors().into_iter().collect();
    views.push(("model.layers.0.mystery.weight".into(), TensorView::new(Dtype::F32, vec![2], &extra).expect("view")));
    let new = safetensors::tensor::serialize(views, None).expect("serialize");
    bytes.clear();
    std::fs::write(f.model.join("model.safetensors"), new).expect("write");
    let out = f.root.join("bad.thin");
    let o = thin(&["convert", f.model.to_str().expect("utf8"), "-o", out.to_str().expect("utf8"), "--quiet"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("model.layers.0.mystery.weight"));
    assert!(!out.exists());
}

/// A committed fixture directory (part of the repository: its absence is a failure, not a skip).
fn fixture_dir(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny").join(name);
    assert!(p.join("config.json").is_file(), "fixture {} is missing from the checkout", p.display());
    p
}

/// f32 values of one tensor of a fixture's model.safetensors.
fn source_f32(dir: &Path, name: &str) -> Vec<f32> {
    let bytes = std::fs::read(dir.join("model.safetensors")).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse");
    let t = st.tensor(name).expect("tensor");
    assert_eq!(t.dtype(), Dtype::F32, "{name}");
    t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn convert_dir(src: &Path, out: &Path, profile: &str) {
    let o = thin(&[
        "convert",
        src.to_str().expect("utf8"),
        "-o",
        out.to_str().expect("utf8"),
        "--quiet",
        "--profile",
        profile,
    ]);
    assert!(o.status.success(), "convert {}: {}", src.display(), String::from_utf8_lossy(&o.stderr));
    let v = thin(&["verify", out.to_str().expect("utf8")]);
    assert!(v.status.success(), "verify {}: {}", out.display(), String::from_utf8_lossy(&v.stderr));
}

#[test]
fn fixtures_of_every_family_convert_and_verify() {
    let tmp = tempfile::tempdir().expect("tempdir");
    for name in ["llama-tiny", "smollm3-tiny", "gemma3-tiny", "olmoe-tiny"] {
        let dir = fixture_dir(name);
        for profile in ["bf16", "f32"] {
            convert_dir(&dir, &tmp.path().join(format!("{name}.{profile}.thin")), profile);
        }
    }
}

#[test]
fn gemma_fixture_norms_are_stored_as_one_plus_w() {
    use thin_core::format::Archive;
    use thin_core::role::Role;
    let dir = fixture_dir("gemma3-tiny");
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("g.thin");
    convert_dir(&dir, &out, "f32");
    let a = Archive::open(&out).expect("open");
    for (role, hf) in [
        (Role::AttnNorm, "input_layernorm"),
        (Role::AttnPostNorm, "post_attention_layernorm"),
        (Role::FfnNorm, "pre_feedforward_layernorm"),
        (Role::FfnPostNorm, "post_feedforward_layernorm"),
        (Role::AttnQNorm, "self_attn.q_norm"),
        (Role::AttnKNorm, "self_attn.k_norm"),
    ] {
        let src = source_f32(&dir, &format!("model.layers.1.{hf}.weight"));
        let got = a.tensor_f32(role, Some(1)).expect("tensor");
        let want: Vec<f32> = src.iter().map(|w| 1.0 + w).collect();
        assert_eq!(got, &want[..], "{role:?}");
    }
    let q = a.tensor_f32(Role::AttnQ, Some(0)).expect("q");
    assert_eq!(q, &source_f32(&dir, "model.layers.0.self_attn.q_proj.weight")[..], "projections are not folded");
}

#[test]
fn olmoe_fixture_experts_are_stacked_in_order() {
    use thin_core::format::Archive;
    use thin_core::role::Role;
    let dir = fixture_dir("olmoe-tiny");
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("o.thin");
    convert_dir(&dir, &out, "f32");
    let a = Archive::open(&out).expect("open");
    let experts = a.manifest().arch.dims.num_experts;
    assert!(a.manifest().arch.moe.is_some());
    for (role, hf) in [(Role::MoeGate, "gate_proj"), (Role::MoeUp, "up_proj"), (Role::MoeDown, "down_proj")] {
        let want: Vec<f32> = (0..experts)
            .flat_map(|e| source_f32(&dir, &format!("model.layers.1.mlp.experts.{e}.{hf}.weight")))
            .collect();
        assert_eq!(a.tensor_f32(role, Some(1)).expect("stacked"), &want[..], "{role:?}");
        let entry = a.manifest().tensor(role, Some(1)).expect("entry");
        assert_eq!(entry.shape[0], experts);
        assert!(entry.exact_storage_preserved);
    }
}

/// The real SmolLM2 GGUF (Q4_1), when it has been downloaded: converts, verifies, and Q/K keep
/// their HF shapes.
#[test]
fn real_gguf_converts() {
    let p = match std::env::var_os("THIN_SMOLLM2_GGUF") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    };
    assert!(p.is_file(), "{} is missing: run scripts/fetch-smollm2.sh", p.display());
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("smol.thin");
    convert_dir(&p, &out, "bf16");
    let j = inspect_json(&out);
    let tensors = j["tensors"].as_array().expect("tensors");
    let q = tensors.iter().find(|t| t["name"] == "blk.0.attn_q").expect("attn_q");
    assert_eq!(q["shape"], serde_json::json!([576, 576]));
    assert_eq!(q["source_dtype"], "Q4_1");
    assert_eq!(q["exact_storage_preserved"], false);
}

/// A source whose chat template loops without end is refused by `convert` (the template is test
/// rendered, under its instruction limit), naming the limit, quickly, and nothing is written.
#[test]
fn a_runaway_chat_template_is_refused_at_convert() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let src = tmp.path().join("llama-tiny");
    std::fs::create_dir(&src).expect("mkdir");
    for e in std::fs::read_dir(fixture_dir("llama-tiny")).expect("ls").filter_map(Result::ok) {
        std::fs::copy(e.path(), src.join(e.file_name())).expect("copy");
    }
    let tc = src.join("tokenizer_config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&tc).expect("read")).expect("json");
    cfg["chat_template"] = Value::from("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}");
    std::fs::write(&tc, cfg.to_string()).expect("write");
    let out = tmp.path().join("x.thin");
    let t = std::time::Instant::now();
    let o = thin(&["convert", src.to_str().expect("utf8"), "-o", out.to_str().expect("utf8"), "--quiet"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("chat template") && err.contains("instruction limit"), "{err}");
    assert!(t.elapsed().as_secs_f64() < 10.0, "took {:?}", t.elapsed());
    assert!(!out.exists());
}

/// `convert` never writes over its own input: the GGUF file itself, a link to it, or a file of
/// the HF directory being read; the source stays as it was.
#[test]
fn convert_refuses_to_write_over_its_input() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let gguf = tmp.path().join("m.gguf");
    std::fs::write(&gguf, b"GGUF not really a model").expect("write");
    let link = tmp.path().join("link.thin");
    std::os::unix::fs::symlink(&gguf, &link).expect("symlink");
    for out in [&gguf, &link] {
        let o = thin(&["convert", gguf.to_str().expect("utf8"), "-o", out.to_str().expect("utf8"), "--quiet"]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(err.contains("would replace the model being read"), "{err}");
    }
    assert_eq!(std::fs::read(&gguf).expect("read"), b"GGUF not really a model");
    let src = tmp.path().join("hf");
    std::fs::create_dir(&src).expect("mkdir");
    std::fs::copy(fixture_dir("llama-tiny").join("config.json"), src.join("config.json")).expect("copy");
    let o = thin(&["convert", src.to_str().expect("utf8"), "-o", src.join("config.json").to_str().expect("utf8"), "--quiet"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("would replace the model being read"));
    assert!(std::fs::read_to_string(src.join("config.json")).expect("read").contains("llama"));
}

/// A convert killed mid-write (SIGTERM, as a shell's timeout or a service stop sends) removes its
/// temporary file and leaves no archive under the final name; a temporary left by a convert
/// that died without cleaning up (its process gone) is removed, and reported, by the next one.
#[test]
fn an_interrupted_convert_leaves_nothing_behind() {
    let gguf = match std::env::var_os("THIN_SMOLLM2_GGUF") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    };
    assert!(gguf.is_file(), "{} is missing: run scripts/fetch-smollm2.sh", gguf.display());
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("smol.thin");
    let ls = || -> Vec<String> { std::fs::read_dir(tmp.path()).expect("ls").filter_map(Result::ok).map(|e| e.file_name().to_string_lossy().into_owned()).collect() };
    // f32 writes 538 MB (about 2.6 s here): the signal lands while the temporary file grows.
    let mut child = Command::new(env!("CARGO_BIN_EXE_thin"))
        .args(["convert", gguf.to_str().expect("utf8"), "-o", out.to_str().expect("utf8"), "--profile", "f32", "--quiet"])
        .spawn()
        .expect("spawn");
    let tmp_name = format!("smol.thin.tmp-{}", child.id());
    let t = std::time::Instant::now();
    while !ls().contains(&tmp_name) && t.elapsed().as_secs() < 20 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(ls().contains(&tmp_name), "the temporary file never appeared: {:?}", ls());
    let killed = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("kill");
    assert!(killed.success());
    let status = child.wait().expect("wait");
    assert_eq!(status.code(), Some(130), "{status:?}");
    assert!(ls().is_empty(), "left behind: {:?}", ls());

    // A stale temporary of a process that no longer exists.
    let stale = tmp.path().join("smol.thin.tmp-4194303");
    std::fs::write(&stale, b"half an archive").expect("write");
    let o = thin(&["convert", fixture_dir("llama-tiny").to_str().expect("utf8"), "-o", out.to_str().expect("utf8"), "--quiet"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("left by a convert that was killed"));
    assert_eq!(ls(), ["smol.thin"]);
}

fn smollm2_gguf() -> PathBuf {
    let p = match std::env::var_os("THIN_SMOLLM2_GGUF") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    };
    assert!(p.is_file(), "{} is missing: run scripts/fetch-smollm2.sh", p.display());
    p
}

/// `--profile native` keeps the real SmolLM2's Q4_1 matrices and Q8_0 embedding byte for byte (Q
/// and K as whole rows of blocks moved back to Hugging Face's order); inspect shows the plan and
/// the bytes a decode token reads.
#[test]
fn native_profile_keeps_the_gguf_blocks() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("native.thin");
    convert_dir(&smollm2_gguf(), &out, "native");
    let j = inspect_json(&out);
    let tensors = j["tensors"].as_array().expect("tensors");
    let t = |name: &str| tensors.iter().find(|t| t["name"] == name).unwrap_or_else(|| panic!("{name}"));
    assert_eq!((t("blk.3.ffn_up")["dtype"].as_str(), t("blk.3.ffn_up")["exact_storage_preserved"].as_bool()), (Some("q4_1"), Some(true)));
    assert_eq!((t("blk.0.attn_q")["dtype"].as_str(), t("blk.0.attn_q")["exact_storage_preserved"].as_bool()), (Some("q4_1"), Some(true)));
    assert_eq!(t("token_embd")["dtype"], "q8_0");
    assert_eq!(t("blk.0.attn_norm")["dtype"], "f32");
    // 1536 rows of 576 values: 18 Q4_1 blocks of 20 bytes each.
    assert_eq!(t("blk.3.ffn_up")["bytes"], 1536 * 576 / 32 * 20);
    let plan = j["quantization"]["plan"].as_array().expect("plan");
    let row = plan.iter().find(|r| r["role"] == "ffn_up").expect("ffn_up row");
    assert_eq!((row["layers"].as_str(), row["method"].as_str(), row["tensors"].as_u64()), (Some("0-29"), Some("q4_1"), Some(30)));
    // Every matrix once, the tied embedding read whole as the LM head, plus one embedding row.
    let emb = t("token_embd")["bytes"].as_u64().expect("bytes");
    let all: u64 = tensors.iter().map(|t| t["bytes"].as_u64().expect("bytes")).sum();
    assert_eq!(j["quantization"]["bytes_per_token"].as_u64(), Some(all + emb / 49152));
    let text = thin(&["inspect", out.to_str().expect("utf8")]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("weight bytes read per decode token"), "{text}");
    assert!(text.lines().any(|l| l.contains("ffn_up") && l.contains("0-29") && l.contains("q4_1")), "{text}");
}

/// Quantizing the GGUF's Q4_1 blocks again needs --allow-requantize; the refusal names the tensor,
/// the rule and the flag, and writes nothing. A profile can be a user's file.
#[test]
fn requantizing_needs_the_flag_and_a_profile_can_be_a_file() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let out = tmp.path().join("fp8.thin");
    let gguf = smollm2_gguf();
    let o = thin(&["convert", gguf.to_str().expect("utf8"), "-o", out.to_str().expect("utf8"), "--profile", "fp8", "--quiet"]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("blk.0.ffn_gate") && err.contains("fp8 rule 1") && err.contains("--allow-requantize"), "{err}");
    assert!(!out.exists());
    // A user's profile: only layer 2's down projection in q8_0, from the tiny HF fixture.
    let prof = tmp.path().join("one-down.toml");
    std::fs::write(&prof, "description = \"one layer's down in q8_0\"\n[[rule]]\nroles = [\"ffn_down\"]\nlayers = \"-1..\"\nmethod = \"q8_0\"\n[[rule]]\nroles = [\"*\"]\nmethod = \"bf16\"\n").expect("write");
    let out = tmp.path().join("mine.thin");
    convert_dir(&fixture_dir("llama-tiny"), &out, prof.to_str().expect("utf8"));
    let j = inspect_json(&out);
    assert_eq!(j["quantization"]["method"], "one-down");
    let dtypes: Vec<(String, String)> = j["tensors"].as_array().expect("tensors").iter().map(|t| (t["name"].as_str().unwrap().to_string(), t["dtype"].as_str().unwrap().to_string())).collect();
    assert!(dtypes.contains(&("blk.1.ffn_down".into(), "q8_0".into())), "{dtypes:?}");
    assert!(dtypes.contains(&("blk.0.ffn_down".into(), "bf16".into())), "{dtypes:?}");
    // A broken profile file is a usage error naming the problem.
    std::fs::write(&prof, "description = \"x\"\n[[rule]]\nroles = [\"*\"]\nmethod = \"int3\"\n").expect("write");
    let o = thin(&["convert", fixture_dir("llama-tiny").to_str().expect("utf8"), "-o", out.to_str().expect("utf8"), "--profile", prof.to_str().expect("utf8")]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown method `int3`"));
}
