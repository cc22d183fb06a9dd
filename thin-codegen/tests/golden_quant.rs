//! Every profile on the CPU engine against an independent decode of the same quantized weights:
//! each tiny HF fixture is converted with a profile; `tests/fixtures/dequantize_archive.py` reads
//! that archive with its own numpy reader and decoders (`thin_numpy.py`, written from the format's
//! documentation) and writes a Hugging Face directory of the decoded f32 matrices; that directory
//! is converted with `--profile f32`; and the generated CPU engine must give the same logits on both
//! archives (prefill, then 16 teacher-forced decode steps) within 1e-4, with the same argmax. The
//! engine on an f32 HF directory is itself held to transformers' logits by golden_hf.rs. Where
//! `reference-<profile>.json` exists (transformers' forward over the decoded weights, made by
//! `make_quant_reference.py` on a machine with torch), the quantized archive is compared with it too.

use std::path::{Path, PathBuf};
use std::process::Command;

use thin_core::convert::{convert, ConvertOptions};
use thin_core::engine::Engine;
use thin_core::format::Archive;
use thin_core::quant::Profile;
use thin_core::sampler::argmax;

/// The bound; measured margins are printed.
const TOL: f32 = 1e-4;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn fixture(name: &str) -> PathBuf {
    repo().join("tests/fixtures/tiny").join(name)
}

/// The shipped profiles that change values, and a test profile that puts the other codecs
/// (q8_0, q4_1, plain mxfp4) on some role.
const PROFILES: [&str; 5] = ["bf16", "bf16-f32edges", "fp8", "mxfp4", "blocks"];

fn profile(name: &str) -> Profile {
    match name {
        "blocks" => Profile::load(repo().join("tests/fixtures/profiles/blocks.toml").to_str().expect("utf8")).expect("test profile"),
        n => Profile::shipped(n).expect("shipped"),
    }
}

/// A venv with numpy (made once, kept under target/; the tests run in parallel threads, so the
/// first one makes it and the others wait for it).
fn numpy_python() -> PathBuf {
    static PYTHON: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PYTHON.get_or_init(make_numpy_venv).clone()
}

fn make_numpy_venv() -> PathBuf {
    const NUMPY: &str = "numpy==2.4.6";
    let venv = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("numpy-venv");
    let python = venv.join("bin/python");
    let marker = venv.join(NUMPY);
    if !marker.is_file() {
        let _ = std::fs::remove_dir_all(&venv);
        let o = Command::new("python3").args(["-m", "venv"]).arg(&venv).output().expect("python3 -m venv");
        assert!(o.status.success(), "venv: {}", String::from_utf8_lossy(&o.stderr));
        let o = Command::new(&python)
            .args(["-m", "pip", "install", "-q", "--disable-pip-version-check", NUMPY])
            .env("PIP_CACHE_DIR", repo().join(".cache/pip-http"))
            .output()
            .expect("pip");
        assert!(o.status.success(), "pip install {NUMPY}: {}", String::from_utf8_lossy(&o.stderr));
        std::fs::write(&marker, b"").expect("marker");
    }
    python
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("read")).expect("json")
}

fn rows(v: &serde_json::Value, k: &str) -> Vec<Vec<f32>> {
    v[k].as_array().expect(k).iter().map(|r| r.as_array().expect("row").iter().map(|x| x.as_f64().expect("logit") as f32).collect()).collect()
}

fn ids(v: &serde_json::Value, k: &str) -> Vec<u32> {
    v[k].as_array().expect(k).iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

/// Prefill logits then each teacher-forced decode step's.
fn logits<E: Engine>(mut e: E, prompt: &[u32], decode: &[u32]) -> Vec<Vec<f32>> {
    let mut out = vec![e.prefill(prompt).expect("prefill").to_vec()];
    for &id in decode {
        out.push(e.decode_step(id).expect("decode").to_vec());
    }
    out
}

/// Largest |a - b| over all rows; every row's argmax must agree.
fn compare(what: &str, a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len(), "{what}: rows");
    let mut d = 0.0f32;
    for (step, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.len(), y.len(), "{what}: vocab");
        d = x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(d, f32::max);
        assert_eq!(argmax(x), argmax(y), "{what}: argmax of row {step}");
    }
    assert!(d <= TOL, "{what}: max |Δlogit| {d} > {TOL}");
    d
}

fn check<E: Engine>(name: &str, engine: impl Fn(Archive) -> E) {
    let python = numpy_python();
    let tmp = tempfile::tempdir().expect("tempdir");
    let r = json(&fixture(name).join("reference.json"));
    let (prompt, decode) = (ids(&r, "prompt_ids"), ids(&r, "decode_ids"));
    let opts = |p: Profile| ConvertOptions { profile: p, allow_requantize: false, progress: false, archs: thin_generated::KNOWN_ARCHS };
    for p in PROFILES {
        let q = tmp.path().join(format!("{name}.{p}.thin"));
        convert(&fixture(name), &q, &opts(profile(p))).expect("convert");
        let methods: Vec<&str> = {
            let a = Archive::open(&q).expect("open");
            let mut m: Vec<&str> = a.manifest().quantization.plan.iter().map(|t| t.method.name()).collect();
            m.sort_unstable();
            m.dedup();
            m
        };
        let dir = tmp.path().join(format!("{name}.{p}.decoded"));
        let o = Command::new(&python)
            .arg(repo().join("tests/fixtures/dequantize_archive.py"))
            .args([&q, &fixture(name), &dir])
            .output()
            .expect("python");
        assert!(o.status.success(), "dequantize_archive.py {p}: {}", String::from_utf8_lossy(&o.stderr));
        let f = tmp.path().join(format!("{name}.{p}.decoded.thin"));
        convert(&dir, &f, &opts(Profile::shipped("f32").expect("f32"))).expect("convert the decoded weights");
        let got = logits(engine(Archive::open(&q).expect("open")), &prompt, &decode);
        let want = logits(engine(Archive::open(&f).expect("open")), &prompt, &decode);
        let d = compare(&format!("{name} {p} vs its numpy decode"), &got, &want);
        eprintln!("{name} {p} ({}): max |Δlogit| vs the numpy-decoded weights {d:.2e}", methods.join(", "));
        let hf = fixture(name).join(format!("reference-{p}.json"));
        if hf.is_file() {
            let h = json(&hf);
            let mut want = vec![rows(&h, "prefill_logits").pop().expect("prefill rows")];
            want.extend(rows(&h, "decode_logits"));
            let d = compare(&format!("{name} {p} vs transformers"), &got, &want);
            eprintln!("{name} {p}: max |Δlogit| vs transformers on the same weights {d:.2e}");
        }
    }
}

macro_rules! golden_quant {
    ($test:ident, $module:ident, $fixture:literal) => {
        #[test]
        fn $test() {
            use thin_generated::$module as m;
            check($fixture, |a| m::Engine::new(a).expect("bind the weights"));
        }
    };
}

golden_quant!(llama_tiny_profiles_match_their_decoded_weights, llama_tiny, "llama-tiny");
golden_quant!(smollm3_tiny_profiles_match_their_decoded_weights, smollm3_tiny, "smollm3-tiny");
golden_quant!(gemma3_tiny_profiles_match_their_decoded_weights, gemma3_tiny, "gemma3-tiny");
golden_quant!(olmoe_tiny_profiles_match_their_decoded_weights, olmoe_tiny, "olmoe-tiny");
