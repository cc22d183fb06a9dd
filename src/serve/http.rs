//! The HTTP side: routes, API-key check, bounded body reads, tokenization and context checks
//! before a request is queued, and the answer as one JSON body or as server-sent events.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use serde_json::json;
use thin::GenerateOptions;
use thin_core::sampler::SamplerConfig;
use thin_core::tokenizer::{ChatMessage, TextTokenizer, TokenizerError};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::api::{parse_request, ApiError, Endpoint, Head, Input};
use super::worker::{Event, Job};

/// What a request gets for what it does not say: the run-control flags `thin serve` was started
/// with.
pub struct RequestDefaults {
    /// `seed` aside: see [`RequestDefaults::seed`].
    pub sampling: SamplerConfig,
    /// `--seed`: the seed of every request that gives none; without it each such request gets
    /// a new one.
    pub seed: Option<u64>,
    /// `--system`: first in a chat request's messages when they bring no system message.
    pub system: Option<ChatMessage>,
    /// `--stop`: added to each request's own stop strings.
    pub stop: Vec<String>,
}

/// What every handler shares.
pub struct Server {
    /// The model's id in requests and in /v1/models.
    pub model: String,
    /// Positions a prompt and its answer may take together.
    pub ctx: usize,
    pub tokenizer: Arc<TextTokenizer>,
    pub jobs: SyncSender<Job>,
    pub api_key: Option<String>,
    pub max_body_bytes: usize,
    /// How long a request body may take to arrive.
    pub timeout: Duration,
    pub defaults: RequestDefaults,
    pub started: u64,
    requests: AtomicU64,
}

impl Server {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        model: String,
        ctx: usize,
        tokenizer: Arc<TextTokenizer>,
        jobs: SyncSender<Job>,
        api_key: Option<String>,
        max_body_bytes: usize,
        timeout: Duration,
        defaults: RequestDefaults,
    ) -> Server {
        Server { model, ctx, tokenizer, jobs, api_key, max_body_bytes, timeout, defaults, started: unix_now(), requests: AtomicU64::new(0) }
    }
}

pub fn router(server: Arc<Server>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .fallback(unknown_url)
        .method_not_allowed_fallback(wrong_method)
        .with_state(server)
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

async fn unknown_url(method: Method, uri: Uri) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", Some("unknown_url"), format!("no such endpoint: {method} {}", uri.path()))
}

async fn wrong_method(method: Method, uri: Uri) -> ApiError {
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", Some("method_not_allowed"), format!("{} does not take {method}", uri.path()))
}

async fn health() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

async fn models(State(s): State<Arc<Server>>, headers: HeaderMap) -> Result<Json<serde_json::Value>, ApiError> {
    s.authorize(&headers)?;
    Ok(Json(json!({
        "object": "list",
        "data": [{"id": s.model, "object": "model", "created": s.started, "owned_by": "thin", "context_length": s.ctx}],
    })))
}

async fn chat(State(s): State<Arc<Server>>, headers: HeaderMap, body: Body) -> Response {
    complete(s, Endpoint::Chat, headers, body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn completions(State(s): State<Arc<Server>>, headers: HeaderMap, body: Body) -> Response {
    complete(s, Endpoint::Completions, headers, body).await.unwrap_or_else(IntoResponse::into_response)
}

impl Server {
    /// With `--api-key`, every /v1 request carries `Authorization: Bearer KEY`.
    fn authorize(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(key) = &self.api_key else { return Ok(()) };
        let unauthorized = |m: &str| ApiError::new(StatusCode::UNAUTHORIZED, "invalid_request_error", Some("invalid_api_key"), m);
        let given = headers.get(header::AUTHORIZATION).ok_or_else(|| {
            unauthorized("no API key given: send `Authorization: Bearer KEY` (this server was started with --api-key)")
        })?;
        let given = given.to_str().ok().and_then(|v| v.strip_prefix("Bearer ")).map(str::trim).unwrap_or_default();
        // The same time for every wrong key of a length: no byte-by-byte early exit.
        let same = given.len() == key.len() && given.bytes().zip(key.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0;
        if same {
            Ok(())
        } else {
            Err(unauthorized("incorrect API key"))
        }
    }

    /// The body, at most `max_body_bytes`, within `timeout` (a client that stalls gets a 408).
    async fn read_body(&self, headers: &HeaderMap, body: Body) -> Result<Vec<u8>, ApiError> {
        let too_large = || {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                Some("request_too_large"),
                format!("the request body is larger than this server's limit of {} bytes (--max-body-bytes)", self.max_body_bytes),
            )
        };
        let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > self.max_body_bytes as u64) {
            return Err(too_large());
        }
        let read = async {
            let mut stream = body.into_data_stream();
            let mut buf = Vec::new();
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", None, format!("reading the request body: {e}")))?;
                if buf.len() + chunk.len() > self.max_body_bytes {
                    return Err(too_large());
                }
                buf.extend_from_slice(&chunk);
            }
            Ok(buf)
        };
        tokio::time::timeout(self.timeout, read).await.unwrap_or_else(|_| {
            Err(ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                Some("request_timeout"),
                format!("the request body did not arrive within {} s (--timeout)", self.timeout.as_secs_f64()),
            ))
        })
    }

    /// Prompt ids: the messages through the archive's chat template, or the prompt text encoded.
    fn tokenize(&self, input: Input) -> Result<Vec<u32>, ApiError> {
        let (param, ids) = match input {
            Input::Messages(mut m) => {
                if let Some(system) = self.defaults.system.as_ref().filter(|_| m.first().is_none_or(|first| first.role != "system")) {
                    m.insert(0, system.clone());
                }
                ("messages", self.tokenizer.render_chat(&m).and_then(|text| self.tokenizer.encode(&text)))
            }
            Input::Text(t) => ("prompt", self.tokenizer.encode(&t)),
            Input::Ids(ids) => {
                let vocab = self.tokenizer.vocab_size();
                if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
                    return Err(ApiError::invalid("prompt", format!("token id {bad} is outside the vocabulary of {vocab}")));
                }
                ("prompt", Ok(ids))
            }
        };
        let ids = ids.map_err(|e| match e {
            TokenizerError::NoChatTemplate => ApiError::invalid(param, "this model's archive has no chat template: use /v1/completions with a prompt"),
            e => ApiError::invalid(param, e.to_string()),
        })?;
        if ids.is_empty() {
            return Err(ApiError::invalid(param, "the prompt encodes to no tokens"));
        }
        Ok(ids)
    }

    /// `max_tokens` for a prompt of `n` tokens: what the request asked if prompt and answer fit
    /// the context, else a 400; up to the end of the context when the request does not say.
    fn fit(&self, n: usize, max_tokens: Option<usize>, param: &str) -> Result<usize, ApiError> {
        let exceeded = |param: &str, m: String| ApiError { code: Some("context_length_exceeded"), ..ApiError::invalid(param, m) };
        if n >= self.ctx {
            return Err(exceeded(param, format!("the prompt has {n} tokens; this server's context is {} tokens (--ctx)", self.ctx)));
        }
        match max_tokens {
            Some(m) if n.saturating_add(m) > self.ctx => Err(exceeded(
                "max_tokens",
                format!("the prompt's {n} tokens and max_tokens {m} exceed the context of {} tokens: at most {} for this prompt", self.ctx, self.ctx - n),
            )),
            Some(m) => Ok(m),
            None => Ok(self.ctx - n),
        }
    }

    /// A seed for a request that gives none: different per request.
    fn fresh_seed(&self, n: u64) -> u64 {
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        thin_core::sampler::Rng::new(nanos ^ n.rotate_left(32)).next_u64()
    }
}

async fn complete(s: Arc<Server>, endpoint: Endpoint, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    s.authorize(&headers)?;
    let body = s.read_body(&headers, body).await?;
    let n = s.requests.fetch_add(1, Ordering::Relaxed) + 1;
    let defaults = SamplerConfig { seed: s.defaults.seed.unwrap_or_else(|| s.fresh_seed(n)), ..s.defaults.sampling };
    let mut req = parse_request(&body, endpoint, &s.model, &defaults)?;
    for stop in &s.defaults.stop {
        if !stop.is_empty() && !req.stop.contains(stop) {
            req.stop.push(stop.clone());
        }
    }
    drop(body);
    let param = if endpoint == Endpoint::Chat { "messages" } else { "prompt" };
    // Templates and tokenizers take time on long inputs: off the connection threads.
    let prompt = {
        let (s, input) = (s.clone(), req.input.clone());
        tokio::task::spawn_blocking(move || s.tokenize(input))
            .await
            .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", None, format!("tokenizing: {e}")))??
    };
    let max_tokens = s.fit(prompt.len(), req.max_tokens, param)?;
    let prefix = if endpoint == Endpoint::Chat { "chatcmpl" } else { "cmpl" };
    let head = Head { endpoint, id: format!("{prefix}-{n}"), created: unix_now(), model: s.model.clone() };
    let (events, rx) = unbounded_channel();
    let opts = GenerateOptions { max_tokens, sampling: req.sampling };
    let job = Job { id: head.id.clone(), prompt, opts, stop: req.stop, events };
    match s.jobs.try_send(job) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) => {
            return Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "requests",
                Some("rate_limit_exceeded"),
                "the server's queue is full (--queue); try again shortly",
            ))
        }
        Err(TrySendError::Disconnected(_)) => {
            return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", None, "the engine has stopped"))
        }
    }
    if req.stream {
        Ok(stream(head, rx, req.include_usage).into_response())
    } else {
        whole(head, rx).await
    }
}

/// The answer as one body, once generation has ended.
async fn whole(head: Head, mut rx: UnboundedReceiver<Event>) -> Result<Response, ApiError> {
    let mut text = String::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Text(t) => text.push_str(&t),
            Event::Done { finish, usage } => return Ok(Json(head.response(&text, finish, usage)).into_response()),
            Event::Failed(e) => return Err(e),
        }
    }
    Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", None, "the engine stopped mid-answer"))
}

/// Server-sent events: (a chat's role chunk,) one chunk per piece of text, the finish chunk,
/// usage if asked, then `data: [DONE]`. An error after the stream began is sent as an error
/// object event, then `[DONE]`.
fn stream(head: Head, rx: UnboundedReceiver<Event>, include_usage: bool) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let data = |v: serde_json::Value| SseEvent::default().data(v.to_string());
    let first = (head.endpoint == Endpoint::Chat).then(|| data(head.role_chunk()));
    let rest = futures_util::stream::unfold(Some(rx), move |rx| {
        let head = head.clone();
        async move {
            let mut rx = rx?;
            let done = || SseEvent::default().data("[DONE]");
            let (events, more) = match rx.recv().await {
                Some(Event::Text(t)) => (vec![data(head.chunk(&t, None))], true),
                Some(Event::Done { finish, usage }) => {
                    let mut v = vec![data(head.chunk("", Some(finish)))];
                    if include_usage {
                        v.push(data(head.usage_chunk(usage)));
                    }
                    v.push(done());
                    (v, false)
                }
                Some(Event::Failed(e)) => (vec![data(e.body()), done()], false),
                None => (vec![data(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", None, "the engine stopped mid-answer").body()), done()], false),
            };
            Some((futures_util::stream::iter(events), more.then_some(rx)))
        }
    });
    let all = futures_util::stream::iter(first).chain(rest.flatten()).map(Ok);
    Sse::new(all).keep_alive(KeepAlive::default())
}
