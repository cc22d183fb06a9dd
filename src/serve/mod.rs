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
use clap::Args;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;

use crate::run::RunControl;

// The run control of `run` and `chat` (the sampling flags are the defaults of requests that do
// not say: llama-server's unless given), plus the server's own options.
#[derive(Args, Debug)]
#[command(
    mut_arg("temperature", |a| a.default_value("0.8")),
    mut_arg("top_k", |a| a.default_value("40")),
    mut_arg("top_p", |a| a.default_value("0.95"))
)]
pub struct ServeArgs {
    /// A .thin archive (made by `thin convert`).
    pub model: PathBuf,
    /// Address to listen on; the default takes connections from this machine only.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the one taken is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    #[command(flatten)]
    pub control: RunControl,
    /// Require `Authorization: Bearer KEY` on every /v1 request.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Requests that may wait while one is generated; past that the server answers 429.
    #[arg(long, default_value_t = 32)]
    pub queue: usize,
    /// Largest request body accepted (413 above it).
    #[arg(long, default_value_t = 2 << 20)]
    pub max_body_bytes: usize,
    /// Seconds a client may take to send a request's headers (the connection is closed after
    /// it; also how long an idle kept-alive connection stays open) and, apart, its body (408
    /// after it). llama-server's read timeout.
    #[arg(long, default_value_t = 600.0)]
    pub timeout: f64,
    /// The model's id in the API (default: the archive's file name without `.thin`).
    #[arg(long)]
    pub alias: Option<String>,
}

pub fn serve(a: ServeArgs) -> anyhow::Result<()> {
    if !(a.timeout.is_finite() && a.timeout > 0.0) {
        bail!("--timeout must be a number of seconds > 0");
    }
    let session = a.control.open(&a.model)?;
    let model = a.alias.clone().unwrap_or_else(|| a.model.file_stem().map_or("model".into(), |s| s.to_string_lossy().into_owned()));
    let (arch, backend, ctx) = (session.arch(), session.backend(), session.ctx());
    let tokenizer = session.tokenizer().clone();
    let jobs = worker::spawn(session, a.queue).context("starting the engine thread")?;
    let timeout = Duration::from_secs_f64(a.timeout);
    let defaults = http::RequestDefaults {
        sampling: a.control.sampling(),
        seed: a.control.seed,
        system: a.control.system_message(),
        stop: a.control.stop.clone(),
    };
    let server = Arc::new(http::Server::new(model.clone(), ctx, tokenizer, jobs, a.api_key.clone(), a.max_body_bytes, timeout, defaults));
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
        let app = http::router(server);
        // hyper's own HTTP/1 connections (axum::serve sets no timer, so no header timeout): a
        // client that does not finish its request head within --timeout is disconnected.
        let mut http1 = hyper::server::conn::http1::Builder::new();
        http1.timer(TokioTimer::new()).header_read_timeout(timeout);
        loop {
            let tcp = match listener.accept().await {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // Out of file descriptors and the like: the listener itself is fine.
                    eprintln!("accepting a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            // Tokens go out as they are made: no waiting to fill a segment.
            let _ = tcp.set_nodelay(true);
            let conn = http1.serve_connection(TokioIo::new(tcp), TowerToHyperService::new(app.clone()));
            tokio::spawn(async move {
                // A connection's end (a timeout, a reset, a malformed head) concerns it alone.
                let _ = conn.await;
            });
        }
    })
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::ServeArgs;
    use crate::run::RunArgs;

    #[derive(Parser)]
    struct Serve {
        #[command(flatten)]
        args: ServeArgs,
    }

    #[derive(Parser)]
    struct Run {
        #[command(flatten)]
        args: RunArgs,
    }

    /// `serve` takes `run`'s flags; its sampling defaults are llama-server's, `run`'s greedy.
    #[test]
    fn serve_shares_the_run_control_with_its_own_sampling_defaults() {
        let s = Serve::try_parse_from(["serve", "m.thin"]).expect("parses").args;
        let c = &s.control;
        assert_eq!((c.temperature, c.top_k, c.top_p, c.min_p, c.repeat_penalty, c.repeat_last_n, c.seed), (0.8, 40, 0.95, 0.0, 1.0, 64, None));
        assert_eq!((c.ctx, c.no_verify, c.system.as_deref(), c.stop.len()), (None, false, None, 0));
        let r = Run::try_parse_from(["run", "m.thin", "--prompt", "x"]).expect("parses").args;
        let c = &r.control;
        assert_eq!((c.temperature, c.top_k, c.top_p, c.seed), (0.0, 0, 1.0, None));
        assert_eq!(c.sampling().seed, 0);

        let s = Serve::try_parse_from([
            "serve", "m.thin", "--ctx", "512", "--temperature", "0", "--top-k", "5", "--seed", "7", "--system", "Be brief.", "--stop", "END",
            "--no-verify", "--backend", "cpu", "--timeout", "2.5",
        ])
        .expect("parses")
        .args;
        let c = &s.control;
        assert_eq!((c.ctx, c.temperature, c.top_k, c.seed, c.no_verify, c.backend), (Some(512), 0.0, 5, Some(7), true, thin::Backend::Cpu));
        assert_eq!((c.system.as_deref(), c.stop.as_slice(), s.timeout), (Some("Be brief."), ["END".to_string()].as_slice(), 2.5));
        // The run control's checks hold for serve too.
        let e = Serve::try_parse_from(["serve", "m.thin", "--top-p", "0"]).err().expect("refused").to_string();
        assert!(e.contains("\"0\" is not in (0, 1]"), "{e}");
        assert!(Serve::try_parse_from(["serve", "m.thin", "--ctx", "0"]).is_err());
    }
}
