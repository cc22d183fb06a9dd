//! `thin run`: open an archive with the compiled-in engine that fits it (the library's
//! `thin::open`) and generate text, streamed as it is decoded, with prompt and generation speed
//! reported separately; and the run control it shares with `chat` (and `thin tokenize`).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use thin::{Session, StopStrings};
use thin_core::format::Archive;
use thin_core::sampler::{SamplerConfig, DEFAULT_REPEAT_LAST_N};
use thin_core::tokenizer::ChatMessage;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// The generated text on stdout as it is decoded; speeds on stderr.
    Text,
    /// JSON lines: `{"prompt_ids":[...]}`, one `{"id":N,"text":"..."}` per generated token, then the stats.
    Jsonl,
}

/// What `run`, `chat` and `serve` share, as llama-cli spells it: where the engine runs, how much
/// context it holds, whether its pages are checked, a system message, stop strings, and how each
/// token is chosen (for `serve`: for each request that does not say).
#[derive(Args, Debug, Clone)]
pub struct RunControl {
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: thin::Backend,
    /// Positions a prompt and its answer may take together (default 4096, or the model's maximum
    /// if smaller; more than the model's maximum is refused; a CPU engine holds at most
    /// min(4096, the model's maximum)).
    #[arg(long, value_parser = ctx)]
    pub ctx: Option<usize>,
    /// A system message before the user's (`run` needs --chat; `chat` keeps it when old turns are
    /// dropped; `serve` puts it first in chat requests that bring none).
    #[arg(long)]
    pub system: Option<String>,
    /// Stop before this text (not printed); repeat for several (`serve`: added to each request's).
    #[arg(long = "stop", value_name = "STR")]
    pub stop: Vec<String>,
    /// 0 is greedy (argmax).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true, value_parser = temperature)]
    pub temperature: f32,
    /// Sample among the k most likely tokens only; 0 means no cut.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = top_k)]
    pub top_k: usize,
    /// Nucleus sampling: the smallest set of tokens whose probability reaches p; 1 means no cut.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true, value_parser = top_p)]
    pub top_p: f32,
    /// Keep only tokens at least this likely relative to the most likely one (after
    /// temperature); 0 means no cut.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true, value_parser = min_p)]
    pub min_p: f32,
    /// Divide the positive logits and multiply the negative ones of tokens seen in the last
    /// --repeat-last-n (prompt included), greedy too; 1 is off.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true, value_parser = repeat_penalty)]
    pub repeat_penalty: f32,
    /// How many of the latest tokens the repetition penalty looks at; 0 is off.
    #[arg(long, default_value_t = DEFAULT_REPEAT_LAST_N, allow_negative_numbers = true, value_parser = repeat_last_n)]
    pub repeat_last_n: usize,
    /// Seed of the sampler's RNG: the same seed gives the same tokens [default: 0; serve: a new
    /// seed for each request that gives none].
    #[arg(long)]
    pub seed: Option<u64>,
    /// Skip the blake3 check of the archive's pages at load (a damaged weight then goes
    /// unnoticed).
    #[arg(long)]
    pub no_verify: bool,
    /// The most device memory the CUDA engine may take, e.g. 4GiB, 512MiB [default: the free
    /// memory]: the layers that do not fit stream from host memory (--residency); below what
    /// streaming needs the load is refused with the plan and the smallest --gpu-mem that runs.
    #[arg(long, value_name = "SIZE", value_parser = crate::parse_gpu_mem)]
    pub gpu_mem: Option<u64>,
    /// all: every weight on the GPU or refused; stream: the layers that do not fit stream from
    /// host memory each token; auto: all when it fits with 1 GiB of the free memory to spare
    /// (none kept back from a given --gpu-mem), else as stream; hybrid: the layers that do not fit
    /// split between streaming and the CPU engine (their KV cache in host memory).
    #[arg(long, value_name = "all|stream|auto|hybrid", default_value = "auto", value_parser = crate::parse_residency)]
    pub residency: thin::Residency,
}

// Flags are checked as clap parses them (negative numbers reach these parsers instead of clap's
// advice to write `-- -1`), so a bad value is named with its range.

fn temperature(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(t) if t.is_finite() && t >= 0.0 => Ok(t),
        _ => Err(format!("{s:?} is not a finite number >= 0 (0 is greedy)")),
    }
}

fn top_p(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(p) if p > 0.0 && p <= 1.0 => Ok(p),
        _ => Err(format!("{s:?} is not in (0, 1] (1: no cut)")),
    }
}

fn top_k(s: &str) -> Result<usize, String> {
    s.parse::<usize>().map_err(|_| format!("{s:?} is not a whole number >= 0 (0: no cut)"))
}

fn min_p(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(p) if (0.0..=1.0).contains(&p) => Ok(p),
        _ => Err(format!("{s:?} is not in [0, 1] (0: no cut)")),
    }
}

fn repeat_penalty(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(p) if p.is_finite() && p > 0.0 => Ok(p),
        _ => Err(format!("{s:?} is not a finite number > 0 (1: off)")),
    }
}

fn repeat_last_n(s: &str) -> Result<usize, String> {
    s.parse::<usize>().map_err(|_| format!("{s:?} is not a whole number >= 0 (0: off)"))
}

fn ctx(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("{s:?} is not a whole number >= 1")),
    }
}

impl RunControl {
    pub fn sampling(&self) -> SamplerConfig {
        SamplerConfig {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            seed: self.seed.unwrap_or(0),
        }
    }

    /// The session for `model` on `--backend` with `--ctx` (above the model's maximum: refused,
    /// naming both), its pages checked unless `--no-verify`, which says so once.
    pub fn open(&self, model: &Path) -> anyhow::Result<Session> {
        let integrity = if self.no_verify {
            eprintln!("--no-verify: the pages of {} are not checked against their blake3", model.display());
            thin::Integrity::Trust
        } else {
            thin::Integrity::Verify
        };
        let opts = thin::Options { backend: self.backend, ctx: self.ctx, progress: true, gpu_mem: self.gpu_mem, residency: self.residency, ..Default::default() };
        thin::open_with(model, &opts, integrity).with_context(|| format!("loading {}", model.display()))
    }

    /// `--system` as the conversation's first message.
    pub fn system_message(&self) -> Option<ChatMessage> {
        self.system.as_ref().map(|s| ChatMessage { role: "system".into(), content: s.clone() })
    }
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// A .thin archive (made by `thin convert`).
    pub model: PathBuf,
    /// The prompt text.
    #[arg(long, required_unless_present_any = ["prompt_ids", "file"])]
    pub prompt: Option<String>,
    /// Read the prompt text from a file (`-`: standard input); one trailing newline is dropped.
    #[arg(short = 'f', long, value_name = "PATH", conflicts_with = "prompt")]
    pub file: Option<PathBuf>,
    /// The prompt as token ids (comma separated) instead of text: no tokenizer, no chat template.
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["prompt", "file", "chat", "system"])]
    pub prompt_ids: Option<Vec<u32>>,
    /// Render the archive's chat template around the prompt (one user message, after --system if
    /// given; generation prompt on).
    #[arg(long)]
    pub chat: bool,
    /// Most tokens to generate (EOS stops earlier).
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    #[command(flatten)]
    pub control: RunControl,
    #[arg(long, value_enum, default_value = "text")]
    pub format: OutputFormat,
}

/// Prompt text from `--file PATH` (`-`: standard input), one trailing newline dropped as
/// llama-cli's `-f` does.
pub fn read_prompt_file(path: &Path) -> anyhow::Result<String> {
    let mut text = if path.as_os_str() == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s).context("reading the prompt from standard input")?;
        s
    } else {
        std::fs::read_to_string(path).with_context(|| format!("reading the prompt from {}", path.display()))?
    };
    if text.ends_with('\n') {
        text.pop();
        if text.ends_with('\r') {
            text.pop();
        }
    }
    Ok(text)
}

pub fn run(a: RunArgs) -> anyhow::Result<()> {
    let control = &a.control;
    if control.system.is_some() && !a.chat {
        bail!("--system is a chat message: add --chat (the archive's chat template places it)");
    }
    let text = match (&a.prompt, &a.file) {
        (Some(text), _) => Some(text.clone()),
        (None, Some(path)) => Some(read_prompt_file(path)?),
        (None, None) => None,
    };
    if text.as_deref() == Some("") {
        bail!("{} is empty", if a.file.is_some() { "the prompt file" } else { "--prompt" });
    }
    let mut session = control.open(&a.model)?;
    let prompt_ids = match (&a.prompt_ids, text) {
        (Some(ids), _) => ids.clone(),
        (None, Some(text)) if a.chat => {
            let user = ChatMessage { role: "user".into(), content: text };
            let messages: Vec<ChatMessage> = control.system_message().into_iter().chain([user]).collect();
            session.chat_prompt(&messages).context("encoding the prompt")?
        }
        (None, Some(text)) => session.prompt(&text, false).context("encoding the prompt")?,
        (None, None) => bail!("give --prompt TEXT, --file PATH or --prompt-ids IDS"),
    };
    if prompt_ids.is_empty() {
        bail!("the prompt encodes to no tokens");
    }
    let (arch, backend) = (session.arch(), session.backend());
    let threads = thin_core::cpu::threads();
    let tok = session.tokenizer().clone();
    let mut stream = tok.stream();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let jsonl = a.format == OutputFormat::Jsonl;
    if jsonl {
        writeln!(out, "{}", serde_json::json!({ "prompt_ids": prompt_ids }))?;
    } else {
        eprintln!("{arch} on {backend} ({threads} threads), {} prompt tokens", prompt_ids.len());
    }
    let opts = thin::GenerateOptions { max_tokens: a.max_tokens, sampling: control.sampling() };
    let mut stops = StopStrings::new(&control.stop);
    let mut stopped_by_string = false;
    let stats = session.generate(&prompt_ids, &opts, |id| {
        // EOS ends the text: it is reported (jsonl) but not printed.
        let piece = if tok.is_eos(id) { String::new() } else { stream.push(id)? };
        // jsonl lists each token's own text; the text output ends before a stop string.
        let (text, stop) = stops.push(&piece);
        if jsonl {
            writeln!(out, "{}", serde_json::json!({ "id": id, "text": piece }))?;
        } else {
            out.write_all(text.as_bytes())?;
        }
        out.flush()?;
        stopped_by_string = stop;
        Ok(if stop { thin::Flow::Stop } else { thin::Flow::Continue })
    })?;
    if !jsonl && !stopped_by_string {
        out.write_all(stops.finish().as_bytes())?;
    }
    let stop = if stopped_by_string { "stop_string" } else { stats.stop.name() };
    if jsonl {
        let j = serde_json::json!({
            "prompt_tokens": stats.prompt_tokens,
            "generated_tokens": stats.generated_tokens,
            "decode_steps": stats.decode_steps,
            "prompt_s": stats.prompt_s,
            "gen_s": stats.gen_s,
            "prompt_tok_s": stats.prompt_tok_s(),
            "gen_tok_s": stats.gen_tok_s(),
            "stop": stop,
            "arch": arch,
            "backend": backend,
            "threads": threads,
        });
        writeln!(out, "{j}")?;
    } else {
        writeln!(out)?;
        eprintln!(
            "prompt: {} tokens in {:.3} s ({:.1} tok/s); generation: {} tokens, {} decode steps in {:.3} s ({:.1} tok/s); stop: {}",
            stats.prompt_tokens,
            stats.prompt_s,
            stats.prompt_tok_s(),
            stats.generated_tokens,
            stats.decode_steps,
            stats.gen_s,
            stats.gen_tok_s(),
            stop
        );
    }
    out.flush()?;
    Ok(())
}

#[derive(Args, Debug)]
pub struct TokenizeArgs {
    /// A .thin archive (its tokenizer is used; no engine is needed).
    pub model: PathBuf,
    /// The text to tokenize.
    #[arg(required_unless_present = "file")]
    pub text: Option<String>,
    /// Read the text from a file (`-`: standard input); one trailing newline is dropped.
    #[arg(short = 'f', long, value_name = "PATH", conflicts_with = "text")]
    pub file: Option<PathBuf>,
    /// Only the ids, as one list `[1, 2, 3]`.
    #[arg(long)]
    pub ids_only: bool,
}

/// `thin tokenize`: the ids of a text and the piece each stands for, one `id -> 'piece'` a line,
/// as llama.cpp's llama-tokenize prints them (BOS included when the archive adds it).
pub fn tokenize(a: TokenizeArgs) -> anyhow::Result<()> {
    let text = match (a.text, &a.file) {
        (Some(t), _) => t,
        (None, Some(path)) => read_prompt_file(path)?,
        (None, None) => bail!("give TEXT or --file PATH"),
    };
    let archive = Archive::open(&a.model).with_context(|| format!("opening {}", a.model.display()))?;
    let tok = archive.tokenizer();
    let ids = tok.encode(&text).context("encoding the text")?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if a.ids_only {
        let list: Vec<String> = ids.iter().map(u32::to_string).collect();
        writeln!(out, "[{}]", list.join(", "))?;
        return Ok(());
    }
    for &id in &ids {
        writeln!(out, "{id:>6} -> '{}'", tok.decode(&[id]).context("decoding a token")?)?;
    }
    Ok(())
}
