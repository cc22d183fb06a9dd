//! `thin run`: open an archive, pick the compiled-in engine that fits it, and generate text,
//! streamed as it is decoded, with prompt and generation speed reported separately.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use thin_core::engine::{Engine, EngineError};
use thin_core::format::Archive;
use thin_core::sampler::{Sampler, SamplerConfig};
use thin_core::tokenizer::{ChatMessage, TextTokenizer};

/// Where the engine runs. `auto` picks the best backend built into this binary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    Auto,
    Cpu,
    /// The GPU (a binary built with `--features cuda`).
    Cuda,
}

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
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Sample among the k most likely tokens only; 0 means no cut.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling: the smallest set of tokens whose probability reaches p; 1 means no cut.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Seed of the sampler's RNG: the same seed gives the same tokens.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: Backend,
    #[arg(long, value_enum, default_value = "text")]
    pub format: OutputFormat,
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    Eos,
    MaxTokens,
    /// The engine's context (KV cache) is full.
    MaxSeq,
}

impl Stop {
    pub fn name(self) -> &'static str {
        match self {
            Stop::Eos => "eos",
            Stop::MaxTokens => "max_tokens",
            Stop::MaxSeq => "max_seq",
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Stats {
    pub prompt_tokens: usize,
    /// Sampled tokens, EOS included.
    pub generated_tokens: usize,
    /// `decode_step` calls: the first generated token comes from the prefill logits.
    pub decode_steps: usize,
    pub prompt_s: f64,
    pub gen_s: f64,
    pub stop: Stop,
}

fn per_s(n: usize, s: f64) -> f64 {
    if n > 0 && s > 0.0 {
        n as f64 / s
    } else {
        0.0
    }
}

impl Stats {
    pub fn prompt_tok_s(&self) -> f64 {
        per_s(self.prompt_tokens, self.prompt_s)
    }

    /// Decode steps per second.
    pub fn gen_tok_s(&self) -> f64 {
        per_s(self.decode_steps, self.gen_s)
    }
}

/// Prefill `prompt`, then sample up to `max_tokens` tokens, calling `on_token` with each as soon
/// as it is chosen. Stops after EOS (which is passed to `on_token`), at `max_tokens`, or when the
/// engine's context is full.
pub fn generate(
    engine: &mut dyn Engine,
    prompt: &[u32],
    sampler: &mut Sampler,
    max_tokens: usize,
    is_eos: &dyn Fn(u32) -> bool,
    mut on_token: impl FnMut(u32) -> anyhow::Result<()>,
) -> anyhow::Result<Stats> {
    if prompt.is_empty() {
        bail!("the prompt has no tokens");
    }
    let start = Instant::now();
    let mut logits = engine.prefill(prompt).with_context(|| format!("prefill of {} prompt tokens", prompt.len()))?;
    let prompt_s = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let (mut generated, mut steps) = (0usize, 0usize);
    let stop = loop {
        if generated >= max_tokens {
            break Stop::MaxTokens;
        }
        let id = sampler.sample(&logits);
        generated += 1;
        on_token(id)?;
        if is_eos(id) {
            break Stop::Eos;
        }
        if generated >= max_tokens {
            break Stop::MaxTokens;
        }
        match engine.decode_step(id) {
            Ok(l) => logits = l,
            Err(EngineError::ContextFull { .. }) => break Stop::MaxSeq,
            Err(e) => return Err(e).with_context(|| format!("decode step at position {}", prompt.len() + steps)),
        }
        steps += 1;
    };
    let gen_s = start.elapsed().as_secs_f64();
    Ok(Stats { prompt_tokens: prompt.len(), generated_tokens: generated, decode_steps: steps, prompt_s, gen_s, stop })
}

/// The engine for `archive` on `backend`, and the backend's name.
fn open_engine(backend: Backend, archive: Arc<Archive>) -> anyhow::Result<(Box<dyn Engine + Send>, &'static str)> {
    // The CUDA engine allocates its KV cache up front: 4096 positions, or fewer if the model allows fewer.
    let ctx = 4096.min(archive.manifest().arch.max_position_embeddings.max(1) as usize);
    let cuda = crate::bench::CudaOptions { ctx, progress: true, timeline: false };
    match backend {
        Backend::Cpu => Ok((thin_generated::open_cpu(archive)?, "cpu")),
        Backend::Cuda => Ok((Box::new(crate::bench::open_cuda(&archive, &cuda)?), "cuda")),
        Backend::Auto if cfg!(feature = "cuda") => match crate::bench::open_cuda(&archive, &cuda) {
            Ok(e) => Ok((Box::new(e), "cuda")),
            Err(e) => {
                eprintln!("CUDA backend unavailable ({e:#}); using the CPU backend");
                Ok((thin_generated::open_cpu(archive)?, "cpu"))
            }
        },
        Backend::Auto => Ok((thin_generated::open_cpu(archive)?, "cpu")),
    }
}

fn check_sampling(a: &RunArgs) -> anyhow::Result<SamplerConfig> {
    if !(a.temperature.is_finite() && a.temperature >= 0.0) {
        bail!("--temperature must be a finite number >= 0 (0 is greedy), got {}", a.temperature);
    }
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        bail!("--top-p must be in (0, 1], got {}", a.top_p);
    }
    Ok(SamplerConfig { temperature: a.temperature, top_k: a.top_k, top_p: a.top_p, seed: a.seed })
}

pub fn run(a: RunArgs) -> anyhow::Result<()> {
    let sampling = check_sampling(&a)?;
    let archive = Archive::open(&a.model).with_context(|| format!("opening {}", a.model.display()))?;
    let tok = TextTokenizer::from_info(&archive.manifest().tokenizer)
        .with_context(|| format!("loading the tokenizer of {}", a.model.display()))?;
    let prompt_ids = match (&a.prompt_ids, &a.prompt) {
        (Some(ids), _) => ids.clone(),
        (None, Some(text)) => {
            if text.is_empty() {
                bail!("--prompt is empty");
            }
            let text = if a.chat {
                tok.render_chat(&[ChatMessage { role: "user".into(), content: text.clone() }])
                    .context("rendering the archive's chat template")?
            } else {
                text.clone()
            };
            tok.encode(&text).context("encoding the prompt")?
        }
        (None, None) => bail!("give --prompt TEXT or --prompt-ids IDS"),
    };
    if prompt_ids.is_empty() {
        bail!("the prompt encodes to no tokens");
    }

    let archive = Arc::new(archive);
    let fingerprint = archive.manifest().shape_fingerprint.clone();
    let (mut engine, backend) =
        open_engine(a.backend, archive).with_context(|| format!("no engine for {}", a.model.display()))?;
    let arch = thin_generated::arch_name(&fingerprint).unwrap_or("?");
    let threads = thin_core::cpu::threads();

    let mut sampler = Sampler::new(sampling);
    let mut stream = tok.stream();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let jsonl = a.format == OutputFormat::Jsonl;
    if jsonl {
        writeln!(out, "{}", serde_json::json!({ "prompt_ids": prompt_ids }))?;
    } else {
        eprintln!("{arch} on {backend} ({threads} threads), {} prompt tokens", prompt_ids.len());
    }
    let stats = generate(engine.as_mut(), &prompt_ids, &mut sampler, a.max_tokens, &|id| tok.is_eos(id), |id| {
        // EOS ends the text: it is reported (jsonl) but not printed.
        let text = if tok.is_eos(id) { String::new() } else { stream.push(id).context("decoding a token")? };
        if jsonl {
            writeln!(out, "{}", serde_json::json!({ "id": id, "text": text }))?;
        } else {
            out.write_all(text.as_bytes())?;
        }
        out.flush()?;
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Logits that always favour `next[pos]`; context of `max_seq` positions.
    struct Scripted {
        next: Vec<u32>,
        pos: usize,
        max_seq: usize,
    }

    impl Scripted {
        fn logits(&self) -> Vec<f32> {
            let mut l = vec![0.0; 8];
            l[self.next[self.pos - 1] as usize] = 10.0;
            l
        }
    }

    impl Engine for Scripted {
        fn prefill(&mut self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
            for _ in tokens {
                self.decode_step(0)?;
            }
            Ok(self.logits())
        }
        fn decode_step(&mut self, _token: u32) -> Result<Vec<f32>, EngineError> {
            if self.pos >= self.max_seq {
                return Err(EngineError::ContextFull { pos: self.pos, max_seq: self.max_seq });
            }
            self.pos += 1;
            Ok(self.logits())
        }
        fn reset(&mut self) {
            self.pos = 0;
        }
    }

    fn go(next: &[u32], prompt: usize, max_tokens: usize, max_seq: usize) -> (Vec<u32>, Stats) {
        let mut e = Scripted { next: next.to_vec(), pos: 0, max_seq };
        let mut s = Sampler::new(SamplerConfig::default());
        let mut got = Vec::new();
        let prompt: Vec<u32> = vec![1; prompt];
        let stats = generate(&mut e, &prompt, &mut s, max_tokens, &|id| id == 7, |id| {
            got.push(id);
            Ok(())
        })
        .expect("generate");
        (got, stats)
    }

    #[test]
    fn stops_at_eos_and_reports_it() {
        // After 2 prompt tokens the script favours next[1] = 3, then 4, then EOS (7).
        let (ids, st) = go(&[0, 3, 4, 7, 5, 5], 2, 10, 100);
        assert_eq!(ids, [3, 4, 7]);
        assert_eq!((st.stop, st.generated_tokens, st.decode_steps, st.prompt_tokens), (Stop::Eos, 3, 2, 2));
    }

    #[test]
    fn stops_at_max_tokens_without_an_extra_step() {
        let (ids, st) = go(&[3, 3, 3, 3, 3], 1, 3, 100);
        assert_eq!(ids, [3, 3, 3]);
        assert_eq!((st.stop, st.decode_steps), (Stop::MaxTokens, 2));
        let (ids, st) = go(&[3], 1, 0, 100);
        assert!(ids.is_empty());
        assert_eq!(st.stop, Stop::MaxTokens);
    }

    #[test]
    fn a_full_context_ends_generation_and_an_overlong_prompt_is_an_error() {
        let (ids, st) = go(&[3; 8], 2, 10, 4);
        assert_eq!((ids.len(), st.stop), (3, Stop::MaxSeq));
        let mut e = Scripted { next: vec![3; 8], pos: 0, max_seq: 4 };
        let mut s = Sampler::new(SamplerConfig::default());
        let err = generate(&mut e, &[1; 5], &mut s, 4, &|_| false, |_| Ok(())).err().expect("too long");
        assert!(format!("{err:#}").contains("max_seq 4"), "{err:#}");
        let err = generate(&mut e, &[], &mut s, 4, &|_| false, |_| Ok(())).err().expect("empty");
        assert!(err.to_string().contains("no tokens"));
    }
}
