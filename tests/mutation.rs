//! Structure-aware mutation of what `thin` reads, through the entry points the CLI uses (issue 24,
//! point 6): manifest fields of a runnable archive (re-signed) through `Archive::open`, `verify`,
//! the manifest's JSON (what `inspect` prints) and `thin::open` + one generated token (`run
//! --max-tokens 1`); config.json fields through `convert`. In-process with panics caught and each
//! case timed, then a sample through the real binary under `prlimit` and `timeout`: rc is 0 or 1,
//! never 101, 70, a signal or a timeout. thin-core's format_mutation.rs and gguf_mutation.rs mutate
//! the format's own manifest and GGUF metadata values the same way; the counts and classes of all
//! three are printed.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use json_mutate::{mutate, Rng, Tally};
use thin_core::convert::{convert, ConvertOptions};
use thin_core::format::testkit::{rebuild, split};
use thin_core::format::Archive;
use thin_core::quant::Profile;

const SEED: u64 = 0x7417_6d75_7461_7465;
/// Per case, in-process (a debug build on a loaded 2-core machine; cases take milliseconds).
const CASE_BUDGET: Duration = Duration::from_secs(5);
/// Per CLI case (`timeout`) and its address space (`prlimit --as`).
const CLI_TIMEOUT_S: u64 = 30;
const CLI_MEM: u64 = 2 << 30;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn fixture(name: &str) -> PathBuf {
    repo().join("tests/fixtures/tiny").join(name)
}

fn opts() -> ConvertOptions {
    ConvertOptions { profile: Profile::load("f32").expect("f32 profile"), allow_requantize: false, progress: false, archs: thin_generated::KNOWN_ARCHS }
}

fn case_dir() -> tempfile::TempDir {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        if let Ok(d) = tempfile::tempdir_in(shm) {
            return d;
        }
    }
    tempfile::tempdir().expect("tempdir")
}

/// What `thin run --prompt hi --max-tokens 1` and `--prompt-ids` do, through the library.
fn run_one(path: &Path) -> Result<(), String> {
    let mut s = thin::open(path, &thin::Options { backend: thin::Backend::Cpu, ..Default::default() }).map_err(|e| e.to_string())?;
    let gen = thin::GenerateOptions { max_tokens: 1, ..Default::default() };
    let prompt = s.prompt("hi", false).map_err(|e| e.to_string())?;
    let tok = s.tokenizer().clone();
    let mut stream = tok.stream();
    s.generate(&prompt, &gen, |id| Ok(stream.push(id).map(|_| thin::Flow::Continue)?)).map_err(|e| e.to_string())?;
    s.generate(&[1, 2], &gen, |_| Ok(thin::Flow::Continue)).map_err(|e| e.to_string())?;
    Ok(())
}

/// Outcome of one in-process case.
#[derive(Default)]
struct Counts {
    cases: u64,
    ok: u64,
    panics: Vec<String>,
    slow: Vec<String>,
}

impl Counts {
    fn case(&mut self, label: String, f: impl FnOnce() -> bool) {
        self.cases += 1;
        let t = Instant::now();
        match catch_unwind(AssertUnwindSafe(f)) {
            Ok(ok) => self.ok += ok as u64,
            Err(p) => self.panics.push(format!("{label}: {}", thin_core::tokenizer::panic_message(&*p))),
        }
        if t.elapsed() > CASE_BUDGET {
            self.slow.push(format!("{label}: {:?}", t.elapsed()));
        }
    }
}

/// A mutated manifest of `base`, re-signed; its class.
fn mutated_archive(base: &[u8], case: u64) -> (Vec<u8>, json_mutate::Class, u64) {
    let parts = split(base);
    let seed = SEED ^ case.wrapping_mul(0x1000_0000_01B3);
    let mut rng = Rng(seed);
    let mut m = parts.manifest.clone();
    // A third of the cases go into what other libraries parse: half of them inside the embedded
    // tokenizer.json, the others anywhere in the tokenizer section (chat template, ids).
    let target = match case % 6 {
        0 => m.pointer_mut("/tokenizer/tokenizer_json").expect("tokenizer_json"),
        3 => m.pointer_mut("/tokenizer").expect("tokenizer"),
        _ => &mut m,
    };
    let class = mutate(target, &mut rng);
    (rebuild(base, &parts.header, &parts.pages, &serde_json::to_vec(&m).expect("json")), class, seed)
}

/// llama-tiny's directory with a mutated config.json.
fn mutated_config(dir: &Path, case: u64) -> (json_mutate::Class, u64) {
    let seed = SEED ^ 0xc0f1 ^ case.wrapping_mul(0x1000_0000_01B3);
    let mut rng = Rng(seed);
    let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture("llama-tiny").join("config.json")).expect("config")).expect("json");
    let class = mutate(&mut c, &mut rng);
    std::fs::write(dir.join("config.json"), c.to_string()).expect("write config");
    (class, seed)
}

fn fresh_source(dir: &Path) {
    std::fs::create_dir_all(dir).expect("mkdir");
    for e in std::fs::read_dir(fixture("llama-tiny")).expect("fixture") {
        let e = e.expect("entry");
        if e.file_name() != "config.json" {
            let to = dir.join(e.file_name());
            if !to.exists() {
                std::fs::copy(e.path(), to).expect("copy");
            }
        }
    }
}

#[test]
fn structure_aware_mutations_never_panic_hang_or_blow_up() {
    let cases: u64 = std::env::var("THIN_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(4_000);
    let config_cases = cases / 5;
    let work = case_dir();
    let base_path = work.path().join("base.thin");
    convert(&fixture("llama-tiny"), &base_path, &opts()).expect("convert llama-tiny");
    let base = std::fs::read(&base_path).expect("read");
    run_one(&base_path).expect("the base archive runs");

    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let t0 = Instant::now();
    let (mut archives, mut configs) = (Counts::default(), Counts::default());
    let (mut tally, mut config_tally) = (Tally::default(), Tally::default());
    let (mut opened, mut ran) = (0u64, 0u64);
    let case_path = work.path().join("case.thin");
    for case in 0..cases {
        let (bytes, class, seed) = mutated_archive(&base, case);
        tally.add(class);
        std::fs::write(&case_path, bytes).expect("write case");
        archives.case(format!("archive case {case} seed {seed:#x} ({class:?})"), || {
            let Ok(a) = Archive::open(&case_path) else { return false };
            opened += 1;
            let _ = serde_json::to_string_pretty(a.manifest());
            let verified = a.verify().is_ok();
            if run_one(&case_path).is_ok() {
                ran += 1;
            }
            verified
        });
    }
    let src = work.path().join("src");
    fresh_source(&src);
    let out = work.path().join("out.thin");
    for case in 0..config_cases {
        let (class, seed) = mutated_config(&src, case);
        config_tally.add(class);
        configs.case(format!("config case {case} seed {seed:#x} ({class:?})"), || {
            let r = convert(&src, &out, &opts());
            let _ = std::fs::remove_file(&out);
            r.map_err(|e| e.to_string()).is_ok()
        });
    }
    std::panic::set_hook(prev);
    eprintln!(
        "in-process, {:.1} s: {} archive cases ({opened} opened, {} verified, {ran} ran a token), classes: {}; {} config.json cases through convert ({} converted), classes: {}; panics {}, over {CASE_BUDGET:?} {}",
        t0.elapsed().as_secs_f64(),
        archives.cases,
        archives.ok,
        tally.line(),
        configs.cases,
        configs.ok,
        config_tally.line(),
        archives.panics.len() + configs.panics.len(),
        archives.slow.len() + configs.slow.len(),
    );
    let panics: Vec<_> = archives.panics.iter().chain(&configs.panics).take(20).collect();
    assert!(panics.is_empty(), "{panics:#?}");
    let slow: Vec<_> = archives.slow.iter().chain(&configs.slow).take(20).collect();
    assert!(slow.is_empty(), "{slow:#?}");
    assert!(opened > 0 && opened < cases && configs.ok > 0 && configs.ok < configs.cases, "mutations both pass and fail");

    // The real binary on a sample: rc 0 or 1 only (never 101 or 70, never killed, never timed out).
    let sample: u64 = std::env::var("THIN_FUZZ_CLI_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(200);
    let t0 = Instant::now();
    let mut rcs: std::collections::BTreeMap<String, u64> = Default::default();
    let mut bad = Vec::new();
    for case in 0..sample {
        let k = case % 4;
        let (args, label): (Vec<String>, String) = if k == 3 {
            let (class, seed) = mutated_config(&src, 1_000_000 + case);
            let a = vec!["convert".into(), src.display().to_string(), "-o".into(), out.display().to_string(), "--quiet".into(), "--profile".into(), "f32".into()];
            (a, format!("convert, config seed {seed:#x} ({class:?})"))
        } else {
            let (bytes, class, seed) = mutated_archive(&base, 1_000_000 + case);
            std::fs::write(&case_path, bytes).expect("write case");
            let p = case_path.display().to_string();
            let a: Vec<String> = match k {
                0 => vec!["inspect".into(), p],
                1 => vec!["verify".into(), p],
                _ => ["run", &p, "--prompt", "hi", "--max-tokens", "1"].map(String::from).to_vec(),
            };
            let label = format!("{}, manifest seed {seed:#x} ({class:?})", a[0]);
            (a, label)
        };
        let o = Command::new("timeout")
            .arg(CLI_TIMEOUT_S.to_string())
            .arg("prlimit")
            .arg(format!("--as={CLI_MEM}"))
            .arg(env!("CARGO_BIN_EXE_thin"))
            .args(&args)
            .env("RAYON_NUM_THREADS", "2")
            .output()
            .expect("run thin");
        let _ = std::fs::remove_file(&out);
        let rc = o.status.code().map_or_else(|| "signal".to_string(), |c| c.to_string());
        *rcs.entry(format!("{} rc {rc}", args[0])).or_default() += 1;
        if !matches!(o.status.code(), Some(0 | 1)) {
            bad.push(format!("{label}: rc {rc}: {}", String::from_utf8_lossy(&o.stderr)));
        }
    }
    eprintln!("binary, {sample} cases in {:.1} s under prlimit --as={CLI_MEM} and timeout {CLI_TIMEOUT_S}s: {rcs:?}", t0.elapsed().as_secs_f64());
    assert!(bad.is_empty(), "{bad:#?}");
}

#[allow(dead_code)]
#[path = "../thin-core/tests/common/json_mutate.rs"]
mod json_mutate;
