//! The OpenAI API's shapes: a request body read field by field (each bad field named in a 4xx
//! error object), the error object itself, and the response and stream-chunk bodies.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};
use thin_core::sampler::SamplerConfig;
use thin_core::tokenizer::ChatMessage;

/// An error as OpenAI sends it: `{"error": {"message", "type", "param", "code"}}` with its HTTP
/// status.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, `requests`, `server_error`.
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 about one request field.
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.to_string()),
            code: None,
        }
    }

    /// A 4xx/5xx about the request as a whole.
    pub fn new(status: StatusCode, kind: &'static str, code: Option<&'static str>, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), kind, param: None, code }
    }

    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            r.headers_mut().insert(axum::http::header::RETRY_AFTER, axum::http::HeaderValue::from_static("1"));
        }
        r
    }
}

/// Which endpoint a body was sent to: chat takes `messages`, completions a `prompt`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
}

#[derive(Debug, Clone)]
pub enum Input {
    Messages(Vec<ChatMessage>),
    Text(String),
    /// `prompt` given as token ids: no tokenizer, no template.
    Ids(Vec<u32>),
}

/// A completion request as the engine needs it.
#[derive(Debug, Clone)]
pub struct CompletionRequest {
    pub input: Input,
    /// `None`: up to the end of the context.
    pub max_tokens: Option<usize>,
    pub sampling: SamplerConfig,
    pub stop: Vec<String>,
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk with `usage` before `[DONE]`.
    pub include_usage: bool,
}

/// Most stop strings a request may give (OpenAI allows 4).
pub const MAX_STOP_STRINGS: usize = 16;

/// Reads a request body. `model` is the one model served (a request naming another is a 404);
/// `defaults` is the sampling of fields the request does not give (the server's flags; its seed
/// is this request's).
pub fn parse_request(body: &[u8], endpoint: Endpoint, model: &str, defaults: &SamplerConfig) -> Result<CompletionRequest, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", Some("invalid_json"), format!("the request body is not valid JSON: {e}"))
    })?;
    let Value::Object(o) = v else {
        return Err(ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", None, "the request body must be a JSON object"));
    };
    let f = Fields(&o);
    if let Some(m) = f.str("model")? {
        if m != model {
            return Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: format!("the model `{m}` does not exist; this server has `{model}`"),
                kind: "invalid_request_error",
                param: Some("model".into()),
                code: Some("model_not_found"),
            });
        }
    }
    let input = match endpoint {
        Endpoint::Chat => {
            if o.contains_key("prompt") {
                return Err(ApiError::invalid("prompt", "/v1/chat/completions takes `messages`; `prompt` goes to /v1/completions"));
            }
            Input::Messages(messages(o.get("messages"))?)
        }
        Endpoint::Completions => {
            if o.contains_key("messages") {
                return Err(ApiError::invalid("messages", "/v1/completions takes `prompt`; `messages` go to /v1/chat/completions"));
            }
            prompt(o.get("prompt"))?
        }
    };
    if let Some(n) = f.int("n")? {
        if n != 1 {
            return Err(ApiError::invalid("n", format!("n is {n}: this server generates one choice per request")));
        }
    }
    if f.bool("echo")? == Some(true) {
        return Err(ApiError::invalid("echo", "echo is not supported"));
    }
    // Newer clients send max_completion_tokens for chat; both mean the same here.
    let max_tokens = match f.int("max_tokens")? {
        Some(n) => Some((n, "max_tokens")),
        None => f.int("max_completion_tokens")?.map(|n| (n, "max_completion_tokens")),
    };
    let max_tokens = match max_tokens {
        Some((n, name)) if n < 1 => return Err(ApiError::invalid(name, format!("{name} is {n}; it must be at least 1"))),
        Some((n, _)) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        None => None,
    };
    let temperature = f.num("temperature")?.unwrap_or(defaults.temperature as f64);
    if !(temperature.is_finite() && temperature >= 0.0) {
        return Err(ApiError::invalid("temperature", format!("temperature is {temperature}; it must be a number >= 0 (0 is greedy)")));
    }
    let top_p = f.num("top_p")?.unwrap_or(defaults.top_p as f64);
    if !(0.0..=1.0).contains(&top_p) {
        return Err(ApiError::invalid("top_p", format!("top_p is {top_p}; it must be in [0, 1] (1: no cut)")));
    }
    let top_k = match f.int("top_k")? {
        Some(k) if k < 0 => return Err(ApiError::invalid("top_k", format!("top_k is {k}; it must be >= 0 (0: no cut)"))),
        Some(k) => usize::try_from(k).unwrap_or(usize::MAX),
        None => defaults.top_k,
    };
    let min_p = f.num("min_p")?.unwrap_or(defaults.min_p as f64);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(ApiError::invalid("min_p", format!("min_p is {min_p}; it must be in [0, 1] (0: no cut)")));
    }
    let repeat_penalty = f.num("repeat_penalty")?.unwrap_or(defaults.repeat_penalty as f64);
    if !(repeat_penalty.is_finite() && repeat_penalty > 0.0) {
        return Err(ApiError::invalid("repeat_penalty", format!("repeat_penalty is {repeat_penalty}; it must be a number > 0 (1: off)")));
    }
    // OpenAI's seed is a signed 64-bit integer; its bits seed the RNG.
    let seed = f.int("seed")?.map_or(defaults.seed, |s| s as u64);
    let stop = stop_strings(o.get("stop"))?;
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match o.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(so)) => Fields(so).bool("include_usage").map_err(|e| ApiError { param: Some("stream_options.include_usage".into()), ..e })?.unwrap_or(false),
        Some(other) => return Err(ApiError::invalid("stream_options", format!("stream_options must be an object, not {}", type_name(other)))),
    };
    let sampling = SamplerConfig {
        temperature: temperature as f32,
        top_k,
        top_p: top_p as f32,
        min_p: min_p as f32,
        repeat_penalty: repeat_penalty as f32,
        repeat_last_n: defaults.repeat_last_n,
        seed,
    };
    Ok(CompletionRequest { input, max_tokens, sampling, stop, stream, include_usage })
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Typed reads of optional fields; `null` counts as absent (clients send it for defaults).
struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn get(&self, k: &str) -> Option<&Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }
    fn wrong(k: &str, want: &str, v: &Value) -> ApiError {
        ApiError::invalid(k, format!("{k} must be {want}, not {}", type_name(v)))
    }
    fn str(&self, k: &str) -> Result<Option<&str>, ApiError> {
        self.get(k).map(|v| v.as_str().ok_or_else(|| Self::wrong(k, "a string", v))).transpose()
    }
    fn bool(&self, k: &str) -> Result<Option<bool>, ApiError> {
        self.get(k).map(|v| v.as_bool().ok_or_else(|| Self::wrong(k, "a boolean", v))).transpose()
    }
    fn num(&self, k: &str) -> Result<Option<f64>, ApiError> {
        self.get(k).map(|v| v.as_f64().ok_or_else(|| Self::wrong(k, "a number", v))).transpose()
    }
    /// A whole number (`2.0` too, as JSON encoders write some integers).
    fn int(&self, k: &str) -> Result<Option<i64>, ApiError> {
        self.get(k)
            .map(|v| {
                v.as_i64()
                    .or_else(|| v.as_u64().map(|u| u.min(i64::MAX as u64) as i64))
                    .or_else(|| v.as_f64().filter(|x| x.fract() == 0.0 && x.abs() < 9e15).map(|x| x as i64))
                    .ok_or_else(|| Self::wrong(k, "an integer", v))
            })
            .transpose()
    }
}

/// `messages`: a non-empty array of `{role, content}`; content a string or an array of text parts.
fn messages(v: Option<&Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let list = match v {
        None | Some(Value::Null) => return Err(ApiError::invalid("messages", "messages is required")),
        Some(Value::Array(a)) => a,
        Some(other) => return Err(Fields::wrong("messages", "an array", other)),
    };
    if list.is_empty() {
        return Err(ApiError::invalid("messages", "messages is empty; give at least one message"));
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let at = |field: &str| format!("messages[{i}].{field}");
            let Value::Object(o) = m else {
                return Err(ApiError::invalid(&format!("messages[{i}]"), format!("messages[{i}] must be an object, not {}", type_name(m))));
            };
            let role = match o.get("role") {
                Some(Value::String(r)) => r.as_str(),
                Some(other) => return Err(ApiError::invalid(&at("role"), format!("{} must be a string, not {}", at("role"), type_name(other)))),
                None => return Err(ApiError::invalid(&at("role"), format!("{} is required", at("role")))),
            };
            // OpenAI's `developer` role is its newer name for `system`.
            let role = match role {
                "system" | "developer" => "system",
                "user" => "user",
                "assistant" => "assistant",
                other => {
                    return Err(ApiError::invalid(
                        &at("role"),
                        format!("{} is `{other}`; this server takes system, developer, user and assistant", at("role")),
                    ))
                }
            };
            let content = match o.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    let mut text = String::new();
                    for (j, p) in parts.iter().enumerate() {
                        match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                            (Some("text"), Some(t)) => text.push_str(t),
                            _ => {
                                return Err(ApiError::invalid(
                                    &format!("{}[{j}]", at("content")),
                                    format!("{}[{j}] must be a text part {{\"type\": \"text\", \"text\": ...}}", at("content")),
                                ))
                            }
                        }
                    }
                    text
                }
                None | Some(Value::Null) => return Err(ApiError::invalid(&at("content"), format!("{} is required", at("content")))),
                Some(other) => {
                    return Err(ApiError::invalid(&at("content"), format!("{} must be a string or an array of text parts, not {}", at("content"), type_name(other))))
                }
            };
            Ok(ChatMessage { role: role.to_string(), content })
        })
        .collect()
}

/// `prompt`: a string, an array of one string, or an array of token ids.
fn prompt(v: Option<&Value>) -> Result<Input, ApiError> {
    let not_one = || ApiError::invalid("prompt", "prompt must be a string or an array of token ids (one prompt per request)");
    match v {
        None | Some(Value::Null) => Err(ApiError::invalid("prompt", "prompt is required")),
        Some(Value::String(s)) if s.is_empty() => Err(ApiError::invalid("prompt", "prompt is empty")),
        Some(Value::String(s)) => Ok(Input::Text(s.clone())),
        Some(Value::Array(a)) if a.is_empty() => Err(ApiError::invalid("prompt", "prompt is empty")),
        Some(Value::Array(a)) => match a.as_slice() {
            [Value::String(s)] if !s.is_empty() => Ok(Input::Text(s.clone())),
            _ => a
                .iter()
                .map(|x| x.as_u64().and_then(|i| u32::try_from(i).ok()).ok_or_else(not_one))
                .collect::<Result<Vec<u32>, _>>()
                .map(Input::Ids),
        },
        Some(_) => Err(not_one()),
    }
}

/// `stop`: a string or an array of strings.
fn stop_strings(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let list = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_str().map(str::to_string).ok_or_else(|| ApiError::invalid("stop", format!("stop must hold strings, not {}", type_name(x)))))
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(Fields::wrong("stop", "a string or an array of strings", other)),
    };
    if list.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid("stop", format!("stop has {} strings; at most {MAX_STOP_STRINGS}", list.len())));
    }
    if list.iter().any(String::is_empty) {
        return Err(ApiError::invalid("stop", "a stop string is empty"));
    }
    Ok(list)
}

/// Why an answer ended, as OpenAI names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS or a stop string.
    Stop,
    /// `max_tokens` or the end of the context.
    Length,
}

impl FinishReason {
    pub fn name(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Sampled tokens, an EOS included (as llama-server counts them).
    pub completion_tokens: usize,
}

impl Usage {
    pub fn json(self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        })
    }
}

/// What every response and chunk of one request shares.
#[derive(Clone, Debug)]
pub struct Head {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl Head {
    fn object(&self, stream: bool) -> &'static str {
        match (self.endpoint, stream) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completions, _) => "text_completion",
        }
    }

    fn with_choices(&self, stream: bool, choices: Value) -> Value {
        json!({"id": self.id, "object": self.object(stream), "created": self.created, "model": self.model, "choices": choices})
    }

    /// The whole answer (no streaming).
    pub fn response(&self, text: &str, finish: FinishReason, usage: Usage) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => json!({
                "index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": finish.name(),
            }),
            Endpoint::Completions => json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish.name()}),
        };
        let mut v = self.with_choices(false, json!([choice]));
        v["usage"] = usage.json();
        v
    }

    /// The first chunk of a chat stream: the role, no text yet.
    pub fn role_chunk(&self) -> Value {
        self.with_choices(true, json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]))
    }

    /// A chunk of text, or with `finish` the last chunk of choices (no text).
    pub fn chunk(&self, text: &str, finish: Option<FinishReason>) -> Value {
        let finish = finish.map(FinishReason::name);
        let choice = match (self.endpoint, finish) {
            (Endpoint::Chat, None) => json!({"index": 0, "delta": {"content": text}, "logprobs": null, "finish_reason": null}),
            (Endpoint::Chat, Some(f)) => json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": f}),
            (Endpoint::Completions, f) => json!({"index": 0, "text": text, "logprobs": null, "finish_reason": f}),
        };
        self.with_choices(true, json!([choice]))
    }

    /// `stream_options.include_usage`: no choices, the usage.
    pub fn usage_chunk(&self, usage: Usage) -> Value {
        let mut v = self.with_choices(true, json!([]));
        v["usage"] = usage.json();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `thin serve`'s default flags (llama-server's sampling), seed 99 for the request.
    const DEFAULTS: SamplerConfig =
        SamplerConfig { temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.0, repeat_penalty: 1.0, repeat_last_n: 64, seed: 99 };

    fn chat(body: &str) -> Result<CompletionRequest, ApiError> {
        parse_request(body.as_bytes(), Endpoint::Chat, "m", &DEFAULTS)
    }

    fn completion(body: &str) -> Result<CompletionRequest, ApiError> {
        parse_request(body.as_bytes(), Endpoint::Completions, "m", &DEFAULTS)
    }

    fn err(r: Result<CompletionRequest, ApiError>) -> (u16, Option<String>, String) {
        let e = r.expect_err("should be refused");
        (e.status.as_u16(), e.param, e.message)
    }

    #[test]
    fn a_full_chat_request_reads_every_field() {
        let r = chat(
            r#"{"model":"m","messages":[{"role":"developer","content":"Be brief."},{"role":"user","content":[{"type":"text","text":"Hi "},{"type":"text","text":"there"}]}],
               "max_tokens":7,"temperature":0,"top_p":0.5,"top_k":3,"min_p":0.1,"repeat_penalty":1.25,"seed":-1,"stop":["\n","END"],"stream":true,"stream_options":{"include_usage":true},"n":1,"user":"x"}"#,
        )
        .expect("valid");
        let Input::Messages(m) = &r.input else { panic!("{:?}", r.input) };
        let m: Vec<(&str, &str)> = m.iter().map(|m| (m.role.as_str(), m.content.as_str())).collect();
        assert_eq!(m, [("system", "Be brief."), ("user", "Hi there")]);
        assert_eq!(r.max_tokens, Some(7));
        assert_eq!(
            r.sampling,
            SamplerConfig { temperature: 0.0, top_k: 3, top_p: 0.5, min_p: 0.1, repeat_penalty: 1.25, repeat_last_n: 64, seed: u64::MAX }
        );
        assert_eq!(r.stop, ["\n", "END"]);
        assert!(r.stream && r.include_usage);
    }

    #[test]
    fn defaults_apply_to_absent_and_null_fields() {
        let r = chat(r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":null,"temperature":null,"stop":"END"}"#).expect("valid");
        assert_eq!(r.max_tokens, None);
        assert_eq!(r.sampling, DEFAULTS);
        assert_eq!(r.stop, ["END"]);
        // Other server flags: their values, and the request's fields still win.
        let flags = SamplerConfig { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.05, repeat_penalty: 1.1, repeat_last_n: 16, seed: 7 };
        let r = parse_request(br#"{"prompt":"x","top_k":5}"#, Endpoint::Completions, "m", &flags).expect("valid");
        assert_eq!(r.sampling, SamplerConfig { top_k: 5, ..flags });
        assert!(!r.stream && !r.include_usage);
        let r = chat(r#"{"messages":[{"role":"user","content":"x"}],"max_completion_tokens":3.0}"#).expect("valid");
        assert_eq!(r.max_tokens, Some(3));
    }

    /// `Input` without the messages (ChatMessage has no PartialEq).
    fn prompt_of(r: CompletionRequest) -> Result<String, Vec<u32>> {
        match r.input {
            Input::Text(t) => Ok(t),
            Input::Ids(ids) => Err(ids),
            Input::Messages(m) => panic!("{m:?}"),
        }
    }

    #[test]
    fn prompts_are_text_or_token_ids() {
        assert_eq!(prompt_of(completion(r#"{"prompt":"The sea"}"#).expect("text")), Ok("The sea".into()));
        assert_eq!(prompt_of(completion(r#"{"prompt":["The sea"]}"#).expect("one")), Ok("The sea".into()));
        assert_eq!(prompt_of(completion(r#"{"prompt":[1,2,3]}"#).expect("ids")), Err(vec![1, 2, 3]));
        for bad in [r#"{"prompt":["a","b"]}"#, r#"{"prompt":[1,-2]}"#, r#"{"prompt":{"a":1}}"#, r#"{"prompt":[4294967296]}"#] {
            assert_eq!(err(completion(bad)).1.as_deref(), Some("prompt"), "{bad}");
        }
        assert_eq!(err(completion(r#"{"prompt":""}"#)).2, "prompt is empty");
        assert_eq!(err(completion(r#"{}"#)).2, "prompt is required");
        assert_eq!(err(completion(r#"{"prompt":"x","messages":[]}"#)).1.as_deref(), Some("messages"));
        assert_eq!(err(chat(r#"{"prompt":"x"}"#)).1.as_deref(), Some("prompt"));
    }

    #[test]
    fn each_bad_field_is_named() {
        let cases: &[(&str, u16, &str, &str)] = &[
            (r#"{"messages":[{"role":"user","content":"x"}]"#, 400, "", "not valid JSON"),
            (r#"[1,2]"#, 400, "", "must be a JSON object"),
            (r#"{"model":"other","messages":[{"role":"user","content":"x"}]}"#, 404, "model", "`other` does not exist; this server has `m`"),
            (r#"{"model":5,"messages":[]}"#, 400, "model", "model must be a string, not a number"),
            (r#"{"messages":[]}"#, 400, "messages", "messages is empty"),
            (r#"{}"#, 400, "messages", "messages is required"),
            (r#"{"messages":"hi"}"#, 400, "messages", "messages must be an array, not a string"),
            (r#"{"messages":[7]}"#, 400, "messages[0]", "must be an object, not a number"),
            (r#"{"messages":[{"content":"x"}]}"#, 400, "messages[0].role", "messages[0].role is required"),
            (r#"{"messages":[{"role":"user","content":"x"},{"role":"tool","content":"x"}]}"#, 400, "messages[1].role", "`tool`"),
            (r#"{"messages":[{"role":"user"}]}"#, 400, "messages[0].content", "is required"),
            (r#"{"messages":[{"role":"user","content":5}]}"#, 400, "messages[0].content", "not a number"),
            (r#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#, 400, "messages[0].content[0]", "text part"),
            (r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":"5"}"#, 400, "max_tokens", "max_tokens must be an integer, not a string"),
            (r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":0}"#, 400, "max_tokens", "at least 1"),
            (r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":2.5}"#, 400, "max_tokens", "an integer"),
            (r#"{"messages":[{"role":"user","content":"x"}],"temperature":-1}"#, 400, "temperature", ">= 0"),
            (r#"{"messages":[{"role":"user","content":"x"}],"temperature":"hot"}"#, 400, "temperature", "a number, not a string"),
            (r#"{"messages":[{"role":"user","content":"x"}],"top_p":1.5}"#, 400, "top_p", "[0, 1]"),
            (r#"{"messages":[{"role":"user","content":"x"}],"top_k":-3}"#, 400, "top_k", ">= 0"),
            (r#"{"messages":[{"role":"user","content":"x"}],"min_p":1.5}"#, 400, "min_p", "[0, 1]"),
            (r#"{"messages":[{"role":"user","content":"x"}],"min_p":"a"}"#, 400, "min_p", "a number, not a string"),
            (r#"{"messages":[{"role":"user","content":"x"}],"repeat_penalty":0}"#, 400, "repeat_penalty", "> 0"),
            (r#"{"messages":[{"role":"user","content":"x"}],"repeat_penalty":-1.1}"#, 400, "repeat_penalty", "> 0"),
            (r#"{"messages":[{"role":"user","content":"x"}],"seed":"s"}"#, 400, "seed", "an integer"),
            (r#"{"messages":[{"role":"user","content":"x"}],"stop":5}"#, 400, "stop", "a string or an array of strings"),
            (r#"{"messages":[{"role":"user","content":"x"}],"stop":["a",1]}"#, 400, "stop", "hold strings"),
            (r#"{"messages":[{"role":"user","content":"x"}],"stop":[""]}"#, 400, "stop", "empty"),
            (r#"{"messages":[{"role":"user","content":"x"}],"stream":"yes"}"#, 400, "stream", "a boolean"),
            (r#"{"messages":[{"role":"user","content":"x"}],"stream_options":{"include_usage":1}}"#, 400, "stream_options.include_usage", "a boolean"),
            (r#"{"messages":[{"role":"user","content":"x"}],"n":2}"#, 400, "n", "one choice"),
        ];
        for (body, status, param, needle) in cases {
            let (s, p, m) = err(chat(body));
            assert_eq!((s, p.as_deref().unwrap_or("")), (*status, *param), "{body}: {m}");
            assert!(m.contains(needle), "{body}: {m:?} lacks {needle:?}");
        }
    }

    #[test]
    fn responses_have_openais_shape() {
        let head = Head { endpoint: Endpoint::Chat, id: "chatcmpl-1".into(), created: 5, model: "m".into() };
        let usage = Usage { prompt_tokens: 3, completion_tokens: 2 };
        assert_eq!(
            head.response("Hi", FinishReason::Stop, usage),
            json!({"id": "chatcmpl-1", "object": "chat.completion", "created": 5, "model": "m",
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "logprobs": null, "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
        );
        assert_eq!(head.chunk("", Some(FinishReason::Length))["choices"][0], json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": "length"}));
        assert_eq!(head.usage_chunk(usage)["choices"], json!([]));
        let head = Head { endpoint: Endpoint::Completions, ..head };
        assert_eq!(head.chunk("a", None)["choices"][0], json!({"index": 0, "text": "a", "logprobs": null, "finish_reason": null}));
        assert_eq!(head.response("a", FinishReason::Length, usage)["object"], "text_completion");
        let e = ApiError::invalid("top_p", "bad");
        assert_eq!(e.body(), json!({"error": {"message": "bad", "type": "invalid_request_error", "param": "top_p", "code": null}}));
    }
}
