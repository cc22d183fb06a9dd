//! `thin`: convert checkpoints into `.thin` archives, inspect, verify and run them.

mod bench;
mod chat;
mod eval;
mod inspect;
mod plan;
mod run;
mod serve;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use thin_core::convert::{convert, ConvertOptions};
use thin_core::format::Archive;
use thin_core::quant::Profile;

#[derive(Parser)]
#[command(name = "thin", version, about = "ThinTensor: shape-specialized inference engines")]
struct Cli {
    /// Threads of the CPU engine (the calling thread and N - 1 workers); default: the physical
    /// cores this process may run on.
    #[arg(long, global = true, value_name = "N", allow_negative_numbers = true, value_parser = parse_threads)]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

/// `--threads N`, checked as clap parses it.
fn parse_threads(s: &str) -> Result<usize, String> {
    let n = s.parse::<usize>().map_err(|_| format!("{s:?} is not a whole number"))?;
    thin_core::cpu::check_threads(n).map_err(|e| e.to_string())
}

/// `--gpu-mem SIZE`, checked as clap parses it.
pub(crate) fn parse_gpu_mem(s: &str) -> Result<u64, String> {
    thin_core::residency::parse_size(s).map_err(|e| e.to_string())
}

/// `--residency all|stream|auto|hybrid`, checked as clap parses it.
pub(crate) fn parse_residency(s: &str) -> Result<thin::Residency, String> {
    s.parse()
}

/// `--profile NAME|PATH`: a shipped profile or a user's TOML file, checked as clap parses it.
fn parse_profile(s: &str) -> Result<Profile, String> {
    Profile::load(s).map_err(|e| e.to_string())
}

#[derive(Subcommand)]
enum Command {
    /// Convert a Hugging Face safetensors directory or a .gguf file into a .thin archive.
    Convert {
        /// A model directory (config.json, *.safetensors, tokenizer.json) or a .gguf file.
        src: PathBuf,
        /// Output archive.
        #[arg(short, long)]
        out: PathBuf,
        /// A shipped profile (bf16, f32, bf16-f32edges, fp8, mxfp4, native; see profiles/) or the
        /// path of your own profile file.
        #[arg(long, default_value = "bf16", value_parser = parse_profile)]
        profile: Profile,
        /// Let the profile quantize tensors the source already stores as quantized blocks
        /// (rounding twice; refused by default).
        #[arg(long)]
        allow_requantize: bool,
        /// No progress bar or summary.
        #[arg(long)]
        quiet: bool,
    },
    /// Print an archive's header, architecture, tokenizer, tensors and quantization plan.
    Inspect {
        file: PathBuf,
        /// One JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Check every page checksum of an archive.
    Verify { file: PathBuf },
    /// Where the weights would live on the GPU: weight bytes by role and layer, KV cache,
    /// workspace, the device budget, and the decision (all resident, or which layers stream with
    /// the bytes a token and the tok/s bound). Allocates nothing; needs no GPU.
    Plan {
        file: PathBuf,
        /// The most device memory the engine may take, e.g. 2GiB, 4G, 512MiB, 1.5GiB [default:
        /// the free memory of GPU 0, or unknown without one].
        #[arg(long, value_name = "SIZE", value_parser = parse_gpu_mem)]
        gpu_mem: Option<u64>,
        /// KV-cache positions [default: 4096, or the model's maximum if smaller].
        #[arg(long)]
        ctx: Option<usize>,
        /// Host-to-device bandwidth for the tok/s bound [default: 50, assumed for PCIe Gen5 x16].
        #[arg(long, value_name = "GB/S", value_parser = plan::parse_link_gb_s)]
        link_gb_s: Option<f64>,
        /// The CPU engine's rate for `--residency hybrid`, GB of weights a second [default:
        /// measured here on the archive's last layer].
        #[arg(long, value_name = "GB/S", value_parser = plan::parse_link_gb_s)]
        host_gb_s: Option<f64>,
        /// all: every weight on the device or refused; stream: the layers that do not fit stream
        /// from host memory; auto: all when it fits with 1 GiB of the free memory to spare
        /// (none kept back from a given --gpu-mem), else as stream; hybrid: the layers that do not
        /// fit split between streaming and the CPU engine (their KV cache in host memory).
        #[arg(long, value_name = "all|stream|auto|hybrid", default_value = "auto", value_parser = parse_residency)]
        residency: thin::Residency,
        /// One JSON object instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Decode speed: the reference method (prefill "Hello", warm-up, timed greedy steps) and a
    /// llama-bench style pp/tg table, mean ± sd over repetitions.
    Bench {
        file: PathBuf,
        #[arg(long, value_enum, default_value = "cuda")]
        backend: thin::Backend,
        /// KV-cache positions to allocate.
        #[arg(long, default_value_t = 4096)]
        ctx: usize,
        #[arg(long, default_value_t = 10)]
        warmup: usize,
        #[arg(long, default_value_t = 200)]
        steps: usize,
        #[arg(long, default_value_t = 512)]
        pp: usize,
        #[arg(long, default_value_t = 128)]
        tg: usize,
        #[arg(long, default_value_t = 5)]
        reps: usize,
        /// One JSON object instead of the table.
        #[arg(long)]
        json: bool,
        /// Also time each decode kernel on its own (all its launches of a step, replayed in step
        /// order), with the weight bandwidth it reaches.
        #[arg(long)]
        profile: bool,
        /// Also report each kernel's cost inside the replayed step, from timestamps the kernels
        /// write (a separately compiled, stamped build of the kernels).
        #[arg(long)]
        timeline: bool,
        /// Skip the blake3 check of the archive's pages at load (its cost is then out of the
        /// cold start figure).
        #[arg(long)]
        no_verify: bool,
        /// The most device memory the engine may take (e.g. 4GiB): the layers that do not fit
        /// stream from host memory (--residency), below what streaming needs the load is refused
        /// with the plan and the smallest --gpu-mem that runs.
        #[arg(long, value_name = "SIZE", value_parser = parse_gpu_mem)]
        gpu_mem: Option<u64>,
        /// all: every weight on the device or refused; stream: the layers that do not fit stream
        /// from host memory; auto: all when it fits with 1 GiB of the free memory to spare, else
        /// as stream; hybrid: the layers that do not fit split between streaming and the CPU
        /// engine (their KV cache in host memory).
        #[arg(long, value_name = "all|stream|auto|hybrid", default_value = "auto", value_parser = parse_residency)]
        residency: thin::Residency,
    },
    /// Teacher-forced logits of the GPU engine over given ids, as raw f32 rows (for fidelity checks).
    Logits {
        file: PathBuf,
        /// A JSON array of token ids.
        #[arg(long)]
        ids: PathBuf,
        /// How many of the ids form the prompt (prefilled at once).
        #[arg(long)]
        prompt_len: usize,
        #[arg(short, long)]
        out: PathBuf,
        #[arg(long, default_value_t = 4096)]
        ctx: usize,
        /// The CPU reference engine instead of the GPU (the oracle the GPU is checked against).
        #[arg(long)]
        cpu: bool,
        /// The most device memory the GPU engine may take (as for `run`).
        #[arg(long, value_name = "SIZE", value_parser = parse_gpu_mem)]
        gpu_mem: Option<u64>,
        /// Where the weights live (as for `run`): `stream` under a --gpu-mem gives the logits of
        /// streamed layers, to compare with `all` bit for bit.
        #[arg(long, value_name = "all|stream|auto|hybrid", default_value = "auto", value_parser = parse_residency)]
        residency: thin::Residency,
    },
    /// Generate text from an archive with the engine compiled in for its architecture.
    Run(run::RunArgs),
    /// Perplexity over a text in windows, and KL divergence from a reference archive or saved
    /// logits, as llama.cpp's llama-perplexity (--kl-divergence) scores them.
    Eval(eval::EvalArgs),
    /// An OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/models,
    /// /health) over one engine.
    Serve(serve::ServeArgs),
    /// An interactive chat in the terminal (the archive's chat template over the conversation).
    Chat(chat::ChatArgs),
    /// The token ids of a text and the piece each stands for (like llama-tokenize).
    Tokenize(run::TokenizeArgs),
}

/// `thin --version`: the version, the engines compiled into this build and whether CUDA is.
fn version() -> String {
    let engines = thin::compiled_engines();
    let engines = if engines.is_empty() { "none (build with --features <arch>)".to_string() } else { engines.join(", ") };
    let cuda = if thin::CUDA_COMPILED { "compiled in" } else { "not compiled in (build with --features cuda)" };
    format!("{}\nengines: {engines}\ncuda: {cuda}", env!("CARGO_PKG_VERSION"))
}

/// Exit status of a panic: EX_SOFTWARE (an internal error), never Rust's 101.
const EXIT_INTERNAL_ERROR: i32 = 70;

/// A panic anywhere in `thin` (any thread) is a bug: say so in one line, remove a half-written
/// archive, exit 70. Panics inside a guarded call into a library that parses untrusted data
/// (`thin_core::tokenizer`) stay quiet: they come back as typed errors.
fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        if thin_core::tokenizer::in_guarded_call() {
            return;
        }
        let at = info.location().map_or_else(String::new, |l| format!(" at {}:{}", l.file(), l.line()));
        eprintln!("internal error: {}{at} (a bug in thin; please report it)", thin_core::tokenizer::panic_message(info.payload()));
        for p in thin_core::format::remove_unfinished_temporaries() {
            eprintln!("removed {}", p.display());
        }
        std::process::exit(EXIT_INTERNAL_ERROR);
    }));
    // For the test of this hook (tests/hostile.rs): a panic on the main thread or on another one.
    // Debug builds only: a release binary has no such switch.
    #[cfg(debug_assertions)]
    match std::env::var("THIN_TEST_PANIC").as_deref() {
        Ok("main") => panic!("THIN_TEST_PANIC=main"),
        Ok("thread") => {
            let _ = std::thread::spawn(|| panic!("THIN_TEST_PANIC=thread")).join();
        }
        _ => {}
    }
}

fn main() -> ExitCode {
    install_panic_hook();
    // clap takes a 'static version string; this one is made once per process.
    let cli = Cli::command().version(&*Box::leak(version().into_boxed_str()));
    let cli = Cli::from_arg_matches(&cli.get_matches()).unwrap_or_else(|e| e.exit());
    match dispatch(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn dispatch(cli: Cli) -> anyhow::Result<()> {
    if let Some(n) = cli.threads {
        thin_core::cpu::set_threads(n).context("starting the CPU threads")?;
    }
    match cli.command {
        Command::Run(args) => run::run(args),
        Command::Eval(args) => eval::eval(args),
        Command::Serve(args) => serve::serve(args),
        Command::Chat(args) => chat::chat(args),
        Command::Tokenize(args) => run::tokenize(args),
        Command::Convert { src, out, profile, allow_requantize, quiet } => {
            // An interrupted convert removes its temporary file (the final name is only ever a
            // whole archive: it is renamed into place at the end).
            let _ = ctrlc::set_handler(|| {
                for p in thin_core::format::remove_unfinished_temporaries() {
                    eprintln!("interrupted: removed {}", p.display());
                }
                std::process::exit(130);
            });
            for p in thin_core::format::remove_stale_temporaries(&out) {
                eprintln!("removed {}, left by a convert that was killed", p.display());
            }
            let opts = ConvertOptions { profile, allow_requantize, progress: !quiet, archs: thin_generated::KNOWN_ARCHS };
            let r = convert(&src, &out, &opts)
                .with_context(|| format!("converting {} to {}", src.display(), out.display()))?;
            if !quiet {
                println!(
                    "wrote {}: {} tensors, {} bytes in {:.2} s ({:.2} GB/s)",
                    r.output.display(),
                    r.tensors,
                    r.bytes_written,
                    r.seconds,
                    r.gb_per_s
                );
            }
            Ok(())
        }
        Command::Inspect { file, json } => {
            let a = Archive::open(&file).with_context(|| format!("opening {}", file.display()))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&inspect::to_json(&a))?);
            } else {
                print!("{}", inspect::to_text(&a));
            }
            Ok(())
        }
        Command::Bench { file, backend, ctx, warmup, steps, pp, tg, reps, json, profile, timeline, no_verify, gpu_mem, residency } => {
            bench::bench(&file, &bench::BenchOptions { backend, ctx, warmup, steps, pp, tg, reps, json, profile, timeline, no_verify, gpu_mem, residency })
        }
        Command::Plan { file, gpu_mem, ctx, link_gb_s, host_gb_s, json, residency } => plan::plan(&file, &plan::PlanOptions { gpu_mem, ctx, link_gb_s, host_gb_s, json, residency }),
        Command::Logits { file, ids, prompt_len, out, ctx, cpu, gpu_mem, residency } => {
            let backend = if cpu { thin::Backend::Cpu } else { thin::Backend::Cuda };
            bench::logits(&file, &ids, prompt_len, &out, &thin::Options { backend, ctx: Some(ctx), gpu_mem, residency, ..Default::default() })
        }
        Command::Verify { file } => {
            let start = Instant::now();
            let a = Archive::open(&file).with_context(|| format!("opening {}", file.display()))?;
            let r = a.verify().with_context(|| format!("verifying {}", file.display()))?;
            let s = start.elapsed().as_secs_f64();
            let gbs = if s > 0.0 { r.bytes as f64 / s / 1e9 } else { 0.0 };
            println!(
                "ok: {}: {} pages, {} tensors, {} bytes verified in {:.3} s ({:.2} GB/s)",
                file.display(),
                r.pages,
                r.tensors,
                r.bytes,
                s,
                gbs
            );
            Ok(())
        }
    }
}
