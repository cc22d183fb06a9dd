//! `thin serve`: an OpenAI-compatible HTTP server over one engine. `POST /v1/chat/completions`
//! and `POST /v1/completions` (one JSON body, or server-sent events ending `data: [DONE]`),
//! `GET /v1/models`, `GET /health`. Requests are tokenized and checked on arrival, then wait in a
//! bounded queue for the one engine thread (`worker`); a full queue is a 429, bad input a 4xx
//! with OpenAI's error object (`api`), and the server goes on.

mod api;
mod http;
mod worker;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use axum::serve::ListenerExt;
use clap::Args;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// A .thin archive (made by `thin convert`).
    pub model: PathBuf,
    /// Address to listen on; the default takes connections from this machine only.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the one taken is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: thin::Backend,
    /// Positions a prompt and its answer may take together (default 4096, at most the model's).
    #[arg(long)]
    pub ctx: Option<usize>,
    /// Require `Authorization: Bearer KEY` on every /v1 request.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Requests that may wait while one is generated; past that the server answers 429.
    #[arg(long, default_value_t = 32)]
    pub queue: usize,
    /// Largest request body accepted (413 above it).
    #[arg(long, default_value_t = 2 << 20)]
    pub max_body_bytes: usize,
    /// Seconds a client may take to send its request body (408 after it).
    #[arg(long, default_value_t = 600.0)]
    pub timeout: f64,
    /// The model's id in the API (default: the archive's file name without `.thin`).
    #[arg(long)]
    pub alias: Option<String>,
}

pub fn serve(a: ServeArgs) -> anyhow::Result<()> {
    if a.ctx == Some(0) {
        bail!("--ctx must be at least 1");
    }
    if !(a.timeout.is_finite() && a.timeout > 0.0) {
        bail!("--timeout must be a number of seconds > 0");
    }
    let session = thin::open(&a.model, &thin::Options { backend: a.backend, ctx: a.ctx, progress: true, ..Default::default() })
        .with_context(|| format!("no engine for {}", a.model.display()))?;
    let model = a.alias.clone().unwrap_or_else(|| a.model.file_stem().map_or("model".into(), |s| s.to_string_lossy().into_owned()));
    let (arch, backend, ctx) = (session.arch(), session.backend(), session.ctx());
    let tokenizer = session.tokenizer().clone();
    let jobs = worker::spawn(session, a.queue).context("starting the engine thread")?;
    let server = Arc::new(http::Server::new(
        model.clone(),
        ctx,
        tokenizer,
        jobs,
        a.api_key.clone(),
        a.max_body_bytes,
        Duration::from_secs_f64(a.timeout),
    ));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting the async runtime")?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port))
            .await
            .with_context(|| format!("listening on {}:{}", a.host, a.port))?;
        let addr = listener.local_addr()?;
        if !addr.ip().is_loopback() && a.api_key.is_none() {
            eprintln!("warning: listening on {} without --api-key: anyone who reaches it can use it", addr.ip());
        }
        eprintln!("{model}: {arch} on {backend}, context {ctx} tokens, queue {}", a.queue);
        eprintln!("listening on http://{addr}/v1");
        // Tokens go out as they are made: no waiting to fill a segment.
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        axum::serve(listener, http::router(server)).await.context("serving")
    })
}
