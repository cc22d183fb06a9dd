//! `thin run`: open an archive with the compiled-in engine that fits it (the library's
//! `thin::open`) and generate text, streamed as it is decoded, with prompt and generation speed
//! reported separately.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use thin_core::sampler::SamplerConfig;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// The generated text on stdout as it is decoded; speeds on stderr.
    Text,
    /// JSON lines: `{"prompt_ids":[...]}`, one `{"id":N,"text":"..."}` per generated token, then the stats.
    Jsonl,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// A .thin archive (made by `thin convert`).
    pub model: PathBuf,
    /// The prompt text.
    #[arg(long, required_unless_present = "prompt_ids")]
    pub prompt: Option<String>,
    /// The prompt as token ids (comma separated) instead of text: no tokenizer, no chat template.
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["prompt", "chat"])]
    pub prompt_ids: Option<Vec<u32>>,
    /// Render the archive's chat template around the prompt (one user message, generation prompt on).
    #[arg(long)]
    pub chat: bool,
    /// Most tokens to generate (EOS stops earlier).
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// 0 is greedy (argmax).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true, value_parser = temperature)]
    pub temperature: f32,
    /// Sample among the k most likely tokens only; 0 means no cut.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true, value_parser = top_k)]
    pub top_k: usize,
    /// Nucleus sampling: the smallest set of tokens whose probability reaches p; 1 means no cut.
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true, value_parser = top_p)]
    pub top_p: f32,
    /// Seed of the sampler's RNG: the same seed gives the same tokens.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: thin::Backend,
    #[arg(long, value_enum, default_value = "text")]
    pub format: OutputFormat,
}

// Sampling flags are checked as clap parses them (negative numbers reach these parsers instead
// of clap's advice to write `-- -1`), so a bad value is named with its range.

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

pub fn run(a: RunArgs) -> anyhow::Result<()> {
    let sampling = SamplerConfig { temperature: a.temperature, top_k: a.top_k, top_p: a.top_p, seed: a.seed, ..Default::default() };
    if a.prompt.as_deref() == Some("") {
        bail!("--prompt is empty");
    }
    let mut session = thin::open(&a.model, &thin::Options { backend: a.backend, progress: true, ..Default::default() })
        .with_context(|| format!("no engine for {}", a.model.display()))?;
    let prompt_ids = match (&a.prompt_ids, &a.prompt) {
        (Some(ids), _) => ids.clone(),
        (None, Some(text)) => session.prompt(text, a.chat).context("encoding the prompt")?,
        (None, None) => bail!("give --prompt TEXT or --prompt-ids IDS"),
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
    let opts = thin::GenerateOptions { max_tokens: a.max_tokens, sampling };
    let stats = session.generate(&prompt_ids, &opts, |id| {
        // EOS ends the text: it is reported (jsonl) but not printed.
        let text = if tok.is_eos(id) { String::new() } else { stream.push(id)? };
        if jsonl {
            writeln!(out, "{}", serde_json::json!({ "id": id, "text": text }))?;
        } else {
            out.write_all(text.as_bytes())?;
        }
        out.flush()?;
        Ok(thin::Flow::Continue)
    })?;
    if jsonl {
        let j = serde_json::json!({
            "prompt_tokens": stats.prompt_tokens,
            "generated_tokens": stats.generated_tokens,
            "decode_steps": stats.decode_steps,
            "prompt_s": stats.prompt_s,
            "gen_s": stats.gen_s,
            "prompt_tok_s": stats.prompt_tok_s(),
            "gen_tok_s": stats.gen_tok_s(),
            "stop": stats.stop.name(),
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
            stats.stop.name()
        );
    }
    out.flush()?;
    Ok(())
}
