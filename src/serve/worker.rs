//! The engine thread: one [`thin::Session`] (not `Sync`, CPU/GPU bound) on its own OS thread,
//! taking jobs in order from a bounded queue. Each job's text goes back over its own channel as
//! it is decoded; when that channel's receiver is gone (the client disconnected), generation stops
//! at the next token.

use std::sync::mpsc::{Receiver, SyncSender};
use std::time::Instant;

use axum::http::StatusCode;
use thin::{Flow, GenerateOptions, Session, Stop, StopStrings};
use thin_core::engine::EngineError;
use tokio::sync::mpsc::UnboundedSender;

use super::api::{ApiError, FinishReason, Usage};

/// One request, tokenized and checked against the context.
pub struct Job {
    /// For the log line.
    pub id: String,
    pub prompt: Vec<u32>,
    pub opts: GenerateOptions,
    pub stop: Vec<String>,
    pub events: UnboundedSender<Event>,
}

/// What a job sends back, in order: text pieces, then `Done` or `Failed`.
#[derive(Debug)]
pub enum Event {
    Text(String),
    Done { finish: FinishReason, usage: Usage },
    Failed(ApiError),
}

/// The queue in front of the engine: `waiting` jobs at most besides the running one.
pub fn spawn(session: Session, waiting: usize) -> std::io::Result<SyncSender<Job>> {
    let (tx, rx) = std::sync::mpsc::sync_channel::<Job>(waiting);
    std::thread::Builder::new().name("thin-engine".into()).spawn(move || run(session, rx))?;
    Ok(tx)
}

fn run(mut session: Session, jobs: Receiver<Job>) {
    for job in jobs {
        if job.events.is_closed() {
            eprintln!("{}: client gone before it started; skipped", job.id);
            continue;
        }
        let start = Instant::now();
        // A panic in one generation (a bug) must not end the server: the engine resets at the
        // start of the next one.
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| generate(&mut session, &job)));
        let event = match outcome {
            Ok(Ok((finish, usage, stop))) => {
                let s = start.elapsed().as_secs_f64();
                eprintln!(
                    "{}: {} prompt tokens, {} generated in {s:.3} s; stop: {stop}",
                    job.id, usage.prompt_tokens, usage.completion_tokens
                );
                Event::Done { finish, usage }
            }
            Ok(Err(e)) => {
                eprintln!("{}: failed: {}", job.id, e.message);
                Event::Failed(e)
            }
            Err(_) => {
                eprintln!("{}: the engine panicked; the server goes on", job.id);
                Event::Failed(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", None, "the engine failed on this request"))
            }
        };
        let _ = job.events.send(event);
    }
}

/// Runs one job; returns why it ended, its token counts and the name of its stop for the log
/// (`eos`, `max_tokens`, `max_seq`, `stop_string`, `cancelled`: the client went away).
fn generate(session: &mut Session, job: &Job) -> Result<(FinishReason, Usage, &'static str), ApiError> {
    let tok = session.tokenizer().clone();
    let mut detok = tok.stream();
    let mut stops = StopStrings::new(&job.stop);
    let mut stopped_by_string = false;
    let result = session.generate(&job.prompt, &job.opts, |id| {
        if job.events.is_closed() {
            return Ok(Flow::Stop);
        }
        if tok.is_eos(id) {
            return Ok(Flow::Continue);
        }
        let (text, stop) = stops.push(&detok.push(id)?);
        if !text.is_empty() && job.events.send(Event::Text(text)).is_err() {
            return Ok(Flow::Stop);
        }
        stopped_by_string = stop;
        Ok(if stop { Flow::Stop } else { Flow::Continue })
    });
    let stats = match result {
        Ok(s) => s,
        Err(thin::Error::Step { source: EngineError::ContextFull { max_seq, .. }, .. }) => {
            let m = format!("the prompt of {} tokens does not fit the engine's context of {max_seq}", job.prompt.len());
            return Err(ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", Some("context_length_exceeded"), m));
        }
        Err(e) => return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", None, e.to_string())),
    };
    if !stopped_by_string {
        let rest = stops.finish();
        if !rest.is_empty() {
            let _ = job.events.send(Event::Text(rest));
        }
    }
    let usage = Usage { prompt_tokens: stats.prompt_tokens, completion_tokens: stats.generated_tokens };
    let (finish, name) = match stats.stop {
        Stop::Eos => (FinishReason::Stop, "eos"),
        Stop::MaxTokens => (FinishReason::Length, "max_tokens"),
        Stop::MaxSeq => (FinishReason::Length, "max_seq"),
        Stop::Cancelled if stopped_by_string => (FinishReason::Stop, "stop_string"),
        Stop::Cancelled => (FinishReason::Stop, "cancelled"),
    };
    Ok((finish, usage, name))
}
