//! The run control `thin run` and `thin chat` share (issue 26, point 5), end to end on the tiny
//! fixtures and the real SmolLM2: the prompt from a file or standard input, `--system` inside the
//! chat template, stop strings, `--ctx` (refused above the model's and the CPU engine's limits,
//! honoured below them), the repetition penalty and min-p against a reimplementation here,
//! `thin tokenize` and `thin --version`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde_json::Value;
use thin_core::engine::Engine;
use thin_core::format::Archive;
use thin_core::tokenizer::TextTokenizer;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn utf8(p: &Path) -> &str {
    p.to_str().expect("utf8 path")
}

fn thin(args: &[&str]) -> Output {
    thin_with_stdin(args, "")
}

fn thin_with_stdin(args: &[&str], input: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_thin"))
        .args(args)
        .env("RAYON_NUM_THREADS", "2")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run thin");
    child.stdin.take().expect("stdin").write_all(input.as_bytes()).expect("write stdin");
    child.wait_with_output().expect("wait for thin")
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).expect("stdout is utf8")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `thin convert tests/fixtures/tiny/<name> --profile f32` into `dir`.
fn convert(name: &str, dir: &Path) -> PathBuf {
    let src = repo().join("tests/fixtures/tiny").join(name);
    let out = dir.join(format!("{name}.thin"));
    let o = thin(&["convert", utf8(&src), "-o", utf8(&out), "--profile", "f32", "--quiet"]);
    assert!(o.status.success(), "convert {name}: {}", stderr(&o));
    out
}

fn tokenizer(archive: &Path) -> TextTokenizer {
    TextTokenizer::from_info(&Archive::open(archive).expect("open").manifest().tokenizer).expect("tokenizer")
}

/// One `thin run --format jsonl`: prompt ids, (id, text) per token, the stats line.
struct Jsonl {
    prompt_ids: Vec<u32>,
    tokens: Vec<(u32, String)>,
    stats: Value,
}

impl Jsonl {
    fn ids(&self) -> Vec<u32> {
        self.tokens.iter().map(|t| t.0).collect()
    }
}

fn run_jsonl_stdin(archive: &Path, extra: &[&str], input: &str) -> Jsonl {
    let mut args = vec!["run", utf8(archive), "--format", "jsonl"];
    args.extend_from_slice(extra);
    let o = thin_with_stdin(&args, input);
    assert!(o.status.success(), "thin {args:?}: {}", stderr(&o));
    let lines: Vec<Value> = stdout(&o).lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}"))).collect();
    let ids = |v: &Value| -> Vec<u32> { v.as_array().expect("ids").iter().map(|x| x.as_u64().expect("id") as u32).collect() };
    let tokens = lines[1..lines.len() - 1]
        .iter()
        .map(|l| (l["id"].as_u64().expect("id") as u32, l["text"].as_str().expect("text").to_string()))
        .collect();
    Jsonl { prompt_ids: ids(&lines[0]["prompt_ids"]), tokens, stats: lines[lines.len() - 1].clone() }
}

fn run_jsonl(archive: &Path, extra: &[&str]) -> Jsonl {
    run_jsonl_stdin(archive, extra, "")
}

/// `thin run` in text mode: stdout (the answer and a newline) and stderr.
fn run_text(archive: &Path, extra: &[&str]) -> (String, String) {
    let mut args = vec!["run", utf8(archive)];
    args.extend_from_slice(extra);
    let o = thin(&args);
    assert!(o.status.success(), "thin {args:?}: {}", stderr(&o));
    (stdout(&o), stderr(&o))
}

/// A failing command: its exit code and stderr (never a panic).
fn fails(args: &[&str]) -> (Option<i32>, String) {
    let o = thin(args);
    let err = stderr(&o);
    assert!(!o.status.success(), "thin {args:?} should fail: {}", stdout(&o));
    assert!(err.starts_with("error: ") || err.lines().any(|l| l.starts_with("error: ")), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    (o.status.code(), err)
}

fn ids_arg(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

const PROMPT: &str = "The quick brown fox";

#[test]
fn the_prompt_comes_from_a_file_or_standard_input() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let a = convert("llama-tiny", tmp.path());
    let want = run_jsonl(&a, &["--prompt", PROMPT, "--max-tokens", "6"]);
    assert_eq!(want.prompt_ids, tokenizer(&a).encode(PROMPT).expect("encode"));

    // One trailing newline is dropped, as llama-cli's -f does.
    let file = tmp.path().join("prompt.txt");
    std::fs::write(&file, format!("{PROMPT}\n")).expect("write");
    let got = run_jsonl(&a, &["--file", utf8(&file), "--max-tokens", "6"]);
    assert_eq!((&got.prompt_ids, got.ids()), (&want.prompt_ids, want.ids()));
    let got = run_jsonl_stdin(&a, &["--file", "-", "--max-tokens", "6"], &format!("{PROMPT}\r\n"));
    assert_eq!((&got.prompt_ids, got.ids()), (&want.prompt_ids, want.ids()));
    // Only one: a second newline is part of the prompt.
    std::fs::write(&file, format!("{PROMPT}\n\n")).expect("write");
    let got = run_jsonl(&a, &["-f", utf8(&file), "--max-tokens", "1"]);
    assert_eq!(got.prompt_ids, tokenizer(&a).encode(&format!("{PROMPT}\n")).expect("encode"));

    std::fs::write(&file, "\n").expect("write");
    assert!(fails(&["run", utf8(&a), "--file", utf8(&file)]).1.contains("the prompt file is empty"));
    let missing = tmp.path().join("missing.txt");
    let (code, err) = fails(&["run", utf8(&a), "--file", utf8(&missing)]);
    assert_eq!(code, Some(1));
    assert!(err.contains("reading the prompt from") && err.contains("missing.txt"), "{err}");
    let (code, err) = fails(&["run", utf8(&a), "--file", utf8(&file), "--prompt", "x"]);
    assert_eq!(code, Some(2), "--file and --prompt together are a usage error: {err}");
}

#[test]
fn the_system_message_goes_into_the_chat_template() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let a = convert("llama-tiny", tmp.path());
    let out = run_jsonl(&a, &["--chat", "--system", "Be brief.", "--prompt", "hi there", "--max-tokens", "3"]);
    // llama-tiny's template is `{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}`.
    let rendered = "<system>Be brief.\n<user>hi there\n";
    let tok = tokenizer(&a);
    assert_eq!(out.prompt_ids, tok.encode(rendered).expect("encode"));
    assert!(tok.decode(&out.prompt_ids).expect("decode").contains("<system>Be brief.\n"));
    // `thin tokenize` of the rendered text gives the same ids.
    let o = thin(&["tokenize", utf8(&a), rendered, "--ids-only"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o), format!("[{}]\n", out.prompt_ids.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")));
    // Without --chat there is nowhere to put it.
    let (code, err) = fails(&["run", utf8(&a), "--system", "Be brief.", "--prompt", "hi"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("--system") && err.contains("--chat"), "{err}");
}

/// A short piece from the middle of `text` (on character boundaries).
fn middle(text: &str, chars: usize) -> String {
    let cs: Vec<char> = text.chars().collect();
    assert!(cs.len() >= 2 * chars + 4, "the answer is too short to cut: {text:?}");
    cs[cs.len() / 2..cs.len() / 2 + chars].iter().collect()
}

#[test]
fn stop_strings_cut_the_output() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let a = convert("llama-tiny", tmp.path());
    let (full, _) = run_text(&a, &["--prompt", PROMPT, "--max-tokens", "24"]);
    let full = full.strip_suffix('\n').expect("a newline ends the answer").to_string();
    let stop = middle(&full, 2);
    let cut = &full[..full.find(&stop).expect("the stop string is in the text")];

    let (out, err) = run_text(&a, &["--prompt", PROMPT, "--max-tokens", "24", "--stop", &stop]);
    assert_eq!(out, format!("{cut}\n"), "stop {stop:?}");
    assert!(err.contains("stop: stop_string"), "{err}");
    // Repeatable: the first stop string in the text wins, one that never comes changes nothing.
    let (out, _) = run_text(&a, &["--prompt", PROMPT, "--max-tokens", "24", "--stop", "never \u{1F600}", "--stop", &stop]);
    assert_eq!(out, format!("{cut}\n"));
    let (out, _) = run_text(&a, &["--prompt", PROMPT, "--max-tokens", "24", "--stop", "never \u{1F600}"]);
    assert_eq!(out, format!("{full}\n"));

    // jsonl lists every generated token with its own text, up to the one that completed the stop
    // string, and says why it stopped.
    let j = run_jsonl(&a, &["--prompt", PROMPT, "--max-tokens", "24", "--stop", &stop]);
    assert_eq!(j.stats["stop"], "stop_string");
    let text: String = j.tokens.iter().map(|t| t.1.as_str()).collect();
    assert!(text.starts_with(&format!("{cut}{stop}")) && full.starts_with(&text), "{text:?} vs {full:?}");
    assert!(j.tokens.len() < 24);

    // `thin chat` cuts its answer at the same place.
    let (chat_full, _) = run_text(&a, &["--chat", "--prompt", "hi there", "--max-tokens", "24"]);
    let chat_full = chat_full.strip_suffix('\n').expect("newline");
    let stop = middle(chat_full, 2);
    let cut = &chat_full[..chat_full.find(&stop).expect("in the text")];
    let o = thin_with_stdin(&["chat", utf8(&a), "--max-tokens", "24", "--stop", &stop], "hi there\n");
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o), format!("{cut}\n"));
    assert!(!stderr(&o).contains("[stopped]"), "a stop string is not a Ctrl-C: {}", stderr(&o));
}

#[test]
fn ctx_is_honoured_below_the_engine_limit_and_refused_above_the_models() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let a = convert("llama-tiny", tmp.path());
    // The limit thin reads for a CPU engine is the one codegen compiled into it.
    let manifest = Archive::open(&a).expect("open").manifest().clone();
    assert_eq!(thin::cpu_max_seq(&manifest.arch), Some(thin_generated::llama_tiny::consts::MAX_SEQ));
    assert_eq!(thin_generated::llama_tiny::consts::MAX_SEQ, 256);

    // 10 prompt tokens in a context of 20: 10 positions, so 11 tokens (the last one is sampled
    // from the 20th position's logits), the same as without --ctx up to there.
    let prompt = ids_arg(&[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]);
    let short = run_jsonl(&a, &["--prompt-ids", &prompt, "--max-tokens", "50", "--ctx", "20"]);
    assert_eq!((short.tokens.len(), &short.stats["stop"]), (11, &Value::from("max_seq")));
    let long = run_jsonl(&a, &["--prompt-ids", &prompt, "--max-tokens", "50"]);
    assert_eq!(long.tokens.len(), 50);
    assert_eq!(short.ids(), long.ids()[..11]);
    // A prompt longer than the context is refused with it.
    let (_, err) = fails(&["run", utf8(&a), "--prompt-ids", &ids_arg(&[5; 25]), "--ctx", "20"]);
    assert!(err.contains("max_seq 20"), "{err}");

    // Above the model's maximum (256 positions), refused before anything runs, by the three
    // commands alike (the library's typed error, not a cap).
    let want = format!("error: loading {}: --ctx 300 is more than the model's maximum of 256 positions\n", utf8(&a));
    for args in [vec!["run", utf8(&a), "--prompt", "hi"], vec!["chat", utf8(&a)], vec!["serve", utf8(&a), "--port", "0"]] {
        let (code, err) = fails(&[&args[..], &["--ctx", "300"]].concat());
        assert_eq!((code, err.as_str()), (Some(1), want.as_str()), "{}", args[0]);
    }
    let e = thin::open(&a, &thin::Options { ctx: Some(257), ..Default::default() }).err().expect("refused");
    assert!(matches!(e, thin::Error::CtxAboveModel { ctx: 257, model_max: 256 }), "{e}");
    // At the maximum: taken as asked.
    let s = thin::open(&a, &thin::Options { ctx: Some(256), ..Default::default() }).expect("opens");
    assert_eq!(s.ctx(), 256);
    let (code, err) = fails(&["run", utf8(&a), "--prompt", "hi", "--ctx", "0"]);
    assert_eq!(code, Some(2), "{err}");
}

/// The real SmolLM2 (8192 positions): its CPU engine holds 4096, so `--ctx 5000` on the CPU is
/// refused naming the engine's limit, and `--ctx 9000` the model's.
#[test]
fn ctx_above_the_cpu_engines_kv_cache_is_refused() {
    let gguf = repo().join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(gguf.is_file(), "{} is missing: run scripts/fetch-smollm2.sh", gguf.display());
    let tmp = tempfile::tempdir().expect("tempdir");
    let a = tmp.path().join("smollm2.thin");
    let o = thin(&["convert", utf8(&gguf), "-o", utf8(&a), "--profile", "native", "--quiet"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let arch = Archive::open(&a).expect("open").manifest().arch.clone();
    assert_eq!(arch.max_position_embeddings, 8192);
    assert_eq!(thin::cpu_max_seq(&arch), Some(thin_generated::smollm2_135m::consts::MAX_SEQ));

    let (code, err) = fails(&["run", utf8(&a), "--backend", "cpu", "--prompt", "hi", "--ctx", "5000"]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains("a context of 5000 positions is more than the CPU engine for smollm2-135m holds: its KV cache has 4096")
            && err.contains("--ctx 4096 or less"),
        "{err}"
    );
    let (_, err) = fails(&["run", utf8(&a), "--backend", "cpu", "--prompt", "hi", "--ctx", "9000"]);
    assert!(err.contains("--ctx 9000 is more than the model's maximum of 8192 positions"), "{err}");
    let out = run_jsonl(&a, &["--backend", "cpu", "--prompt", "hi", "--ctx", "4096", "--max-tokens", "1"]);
    assert_eq!(out.tokens.len(), 1);
}

/// Greedy decoding with llama.cpp's repetition penalty, written out here over the engine itself:
/// each step, the distinct tokens among the last `last_n` of prompt + output have their logit
/// divided by `penalty` when positive, multiplied when not; then the first largest wins.
fn penalized_greedy(archive: &Path, prompt: &[u32], steps: usize, penalty: f32, last_n: usize) -> Vec<u32> {
    let mut engine = thin_generated::llama_tiny::Engine::new(Archive::open(archive).expect("open")).expect("engine");
    let mut history = prompt.to_vec();
    let mut out = Vec::new();
    let mut logits = engine.prefill(prompt).expect("prefill").to_vec();
    loop {
        let mut seen: Vec<u32> = history[history.len().saturating_sub(last_n)..].to_vec();
        seen.sort();
        seen.dedup();
        for t in seen {
            let l = &mut logits[t as usize];
            *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
        }
        let best = logits.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b });
        out.push(best.0 as u32);
        history.push(best.0 as u32);
        if out.len() == steps {
            return out;
        }
        logits = engine.decode_step(best.0 as u32).expect("decode").to_vec();
    }
}

#[test]
fn repetition_penalty_and_min_p_through_the_cli() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let a = convert("llama-tiny", tmp.path());
    let prompt: Vec<u32> = vec![1, 40, 41, 42, 40, 41, 42, 40];
    let ids = ids_arg(&prompt);
    let run = |extra: &[&str]| {
        let mut args = vec!["--prompt-ids", &ids, "--max-tokens", "16"];
        args.extend_from_slice(extra);
        run_jsonl(&a, &args).ids()
    };
    let greedy = run(&[]);
    let want = penalized_greedy(&a, &prompt, 16, 1.5, 8);
    assert_ne!(want, greedy, "the penalty should change this greedy continuation");
    assert_eq!(run(&["--repeat-penalty", "1.5", "--repeat-last-n", "8"]), want);
    // The prompt is in the window: a window of the whole text gives another continuation here.
    assert_eq!(run(&["--repeat-penalty", "1.5", "--repeat-last-n", "64"]), penalized_greedy(&a, &prompt, 16, 1.5, 64));
    // Off: penalty 1, or a window of 0.
    assert_eq!(run(&["--repeat-penalty", "1", "--repeat-last-n", "8"]), greedy);
    assert_eq!(run(&["--repeat-penalty", "1.5", "--repeat-last-n", "0"]), greedy);

    // min-p 1 keeps only the most likely token: sampling at any temperature is then greedy.
    assert_eq!(run(&["--temperature", "1.5", "--min-p", "1", "--seed", "3"]), greedy);
    assert_eq!(run(&["--temperature", "1.5", "--min-p", "1", "--repeat-penalty", "1.5", "--repeat-last-n", "8"]), want);
    // Seeded sampling with every option is reproducible.
    let sample = |seed: &str| run(&["--temperature", "1", "--min-p", "0.05", "--repeat-penalty", "1.3", "--top-k", "40", "--seed", seed]);
    let (s1, s2, s3) = (sample("1"), sample("1"), sample("2"));
    assert_eq!(s1, s2);
    assert_ne!(s1, s3);

    for (flag, value, range) in [
        ("--min-p", "1.5", "[0, 1]"),
        ("--min-p", "-0.1", "[0, 1]"),
        ("--repeat-penalty", "0", "> 0"),
        ("--repeat-penalty", "nan", "> 0"),
        ("--repeat-last-n", "-1", "whole number >= 0"),
    ] {
        let (code, err) = fails(&["run", utf8(&a), "--prompt", "x", flag, value]);
        assert_eq!(code, Some(2), "{flag} {value}: {err}");
        assert!(err.contains(flag) && err.contains(range) && !err.contains("-- -"), "{flag} {value}: {err}");
        // chat shares the flags and their checks.
        assert_eq!(fails(&["chat", utf8(&a), flag, value]).0, Some(2));
    }
}

#[test]
fn tokenize_prints_ids_and_pieces() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let a = convert("llama-tiny", tmp.path());
    let tok = tokenizer(&a);
    let o = thin(&["tokenize", utf8(&a), "hi there"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let lines: Vec<(u32, String)> = stdout(&o)
        .lines()
        .map(|l| {
            let (id, piece) = l.split_once(" -> ").unwrap_or_else(|| panic!("{l:?}"));
            assert_eq!(id.len(), 6, "ids are right-aligned in 6 columns: {l:?}");
            let piece = piece.strip_prefix('\'').and_then(|p| p.strip_suffix('\'')).unwrap_or_else(|| panic!("{l:?}"));
            (id.trim().parse().expect("id"), piece.to_string())
        })
        .collect();
    // The fixture's tokenizer: GPT-2 byte-level BPE over the 256 byte symbols, no merges, no BOS
    // added. Its ids are the byte-to-symbol table's order: printable ASCII byte b is b - 33, the
    // space (the 33rd non-printable byte) 188 + 32 = 220.
    let want: Vec<(u32, String)> = "hi there".bytes().map(|b| (if b == b' ' { 220 } else { b as u32 - 33 }, (b as char).to_string())).collect();
    assert_eq!(lines, want);
    assert_eq!(lines.iter().map(|l| l.0).collect::<Vec<_>>(), tok.encode("hi there").expect("encode"));

    let o = thin_with_stdin(&["tokenize", utf8(&a), "--file", "-", "--ids-only"], "hi there\n");
    assert!(o.status.success(), "{}", stderr(&o));
    let ids: Vec<u32> = serde_json::from_str(&stdout(&o)).expect("a JSON list of ids");
    assert_eq!(ids, lines.iter().map(|l| l.0).collect::<Vec<_>>());
    assert_eq!(fails(&["tokenize", utf8(&a)]).0, Some(2), "no text");
    assert!(fails(&["tokenize", utf8(&tmp.path().join("nope.thin")), "x"]).1.contains("nope.thin"));
}

#[test]
fn version_lists_the_compiled_engines_and_cuda() {
    let o = thin(&["--version"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], format!("thin {}", env!("CARGO_PKG_VERSION")));
    let engines = lines.iter().find_map(|l| l.strip_prefix("engines: ")).unwrap_or_else(|| panic!("{out}"));
    let engines: Vec<&str> = engines.split(", ").collect();
    let compiled: Vec<&str> = thin_generated::CPU_ENGINES.iter().map(|e| e.arch).collect();
    assert_eq!(engines, compiled);
    for arch in ["llama-tiny", "smollm3-tiny", "gemma3-tiny", "olmoe-tiny", "smollm2-135m", "gemma3-270m"] {
        assert!(engines.contains(&arch), "{out}");
    }
    let cuda = if cfg!(feature = "cuda") { "cuda: compiled in" } else { "cuda: not compiled in (build with --features cuda)" };
    assert!(lines.contains(&cuda), "{out}");
    assert_eq!(stdout(&thin(&["-V"])), out);
}
