//! `thin serve` over raw HTTP/1.1 (std TcpStream, no client library): answers equal `thin run`'s
//! with the same settings, every bad-input class is a 4xx with OpenAI's error object and the next
//! request is still served, the API key, and on the real SmolLM2 (slow enough to hold the engine
//! busy) the queue's 429 and a disconnect that cancels generation; then the `openai` Python
//! client (scripts/serve_client_test.py) against the real model and a load test on a tiny one.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn utf8(p: &Path) -> &str {
    p.to_str().expect("utf8 path")
}

fn thin(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_thin")).args(args).env("RAYON_NUM_THREADS", "2").output().expect("run thin")
}

/// `thin convert tests/fixtures/tiny/llama-tiny --profile f32` (context 256 positions).
fn tiny(dir: &Path) -> PathBuf {
    let out = dir.join("llama-tiny.thin");
    let src = repo().join("tests/fixtures/tiny/llama-tiny");
    let o = thin(&["convert", utf8(&src), "-o", utf8(&out), "--profile", "f32", "--quiet"]);
    assert!(o.status.success(), "convert: {}", String::from_utf8_lossy(&o.stderr));
    out
}

/// The real SmolLM2-135M-Instruct, bf16 (scripts/fetch-smollm2.sh fetches the GGUF).
fn smollm2(dir: &Path) -> PathBuf {
    let gguf = match std::env::var_os("THIN_SMOLLM2_GGUF") {
        Some(p) => PathBuf::from(p),
        None => repo().join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    };
    assert!(gguf.is_file(), "{} is missing: run scripts/fetch-smollm2.sh", gguf.display());
    let out = dir.join("smollm2.thin");
    let o = thin(&["convert", utf8(&gguf), "-o", utf8(&out), "--quiet"]);
    assert!(o.status.success(), "convert: {}", String::from_utf8_lossy(&o.stderr));
    out
}

/// A running `thin serve` on an ephemeral loopback port; its stderr lines are kept (one per
/// finished request: `<id>: P prompt tokens, N generated in S s; stop: <why>`). Killed on drop.
struct Served {
    child: Child,
    addr: SocketAddr,
    log: Arc<Mutex<Vec<String>>>,
}

impl Served {
    fn start(archive: &Path, extra: &[&str]) -> Served {
        let mut child = Command::new(env!("CARGO_BIN_EXE_thin"))
            .args(["serve", utf8(archive), "--port", "0"])
            .args(extra)
            .env("RAYON_NUM_THREADS", "2")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start thin serve");
        let stderr = child.stderr.take().expect("stderr");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        let lines = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(a) = line.strip_prefix("listening on http://").and_then(|r| r.strip_suffix("/v1")) {
                    let _ = tx.send(a.parse::<SocketAddr>().expect("address"));
                }
                lines.lock().expect("log").push(line);
            }
        });
        let addr = rx.recv_timeout(Duration::from_secs(120)).unwrap_or_else(|_| panic!("no address: {:?}", log.lock().expect("log")));
        Served { child, addr, log }
    }

    /// The log line about request `id` (waits for it up to `within`).
    fn finished(&self, id: &str, within: Duration) -> String {
        let start = Instant::now();
        loop {
            if let Some(l) = self.log.lock().expect("log").iter().find(|l| l.starts_with(&format!("{id}: "))) {
                return l.clone();
            }
            assert!(start.elapsed() < within, "no log line for {id}: {:?}", self.log.lock().expect("log"));
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn post(&self, path: &str, body: &Value) -> Reply {
        http(self.addr, "POST", path, &[], body.to_string().as_bytes())
    }

    /// A request that must succeed.
    fn ok(&self, path: &str, body: &Value) -> Value {
        let r = self.post(path, body);
        assert_eq!(r.status, 200, "{path} {body}: {}", r.text());
        r.json()
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Reply {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
    /// The `data:` payloads of a server-sent event stream.
    fn events(&self) -> Vec<String> {
        self.text().lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect()
    }
    /// OpenAI's error object; returns (type, param, code).
    fn error(&self) -> (String, Value, Value) {
        let v = self.json();
        let e = &v["error"];
        let keys: Vec<&String> = e.as_object().unwrap_or_else(|| panic!("no error object: {v}")).keys().collect();
        assert_eq!(keys, ["code", "message", "param", "type"], "{v}");
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        (e["type"].as_str().expect("type").to_string(), e["param"].clone(), e["code"].clone())
    }
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120))).expect("timeout");
    s
}

fn head(method: &str, path: &str, headers: &[(&str, &str)], len: Option<usize>) -> String {
    let mut h = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    if let Some(n) = len {
        h += &format!("Content-Type: application/json\r\nContent-Length: {n}\r\n");
    }
    for (k, v) in headers {
        h += &format!("{k}: {v}\r\n");
    }
    h + "\r\n"
}

/// Status line, headers and body (de-chunked) of a whole response.
fn parse_reply(raw: &[u8]) -> Reply {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or_else(|| panic!("no header end: {}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.lines();
    let status = lines.next().and_then(|l| l.split(' ').nth(1)).and_then(|s| s.parse().ok()).expect("status");
    let headers: Vec<(String, String)> =
        lines.filter_map(|l| l.split_once(':')).map(|(k, v)| (k.trim().to_string(), v.trim().to_string())).collect();
    let mut body = raw[split + 4..].to_vec();
    if headers.iter().any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked")) {
        let (mut out, mut rest) = (Vec::new(), &body[..]);
        while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
            let n = usize::from_str_radix(String::from_utf8_lossy(&rest[..eol]).trim(), 16).expect("chunk size");
            if n == 0 {
                break;
            }
            out.extend_from_slice(&rest[eol + 2..eol + 2 + n]);
            rest = &rest[eol + 4 + n..];
        }
        body = out;
    }
    Reply { status, headers, body }
}

fn http(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
    let mut s = connect(addr);
    s.write_all(head(method, path, headers, (method == "POST").then_some(body.len())).as_bytes()).expect("write");
    s.write_all(body).expect("write body");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read");
    parse_reply(&raw)
}

/// `thin run --format jsonl`: (text without EOS, prompt tokens, generated tokens, stop).
fn run(archive: &Path, extra: &[&str]) -> (String, u64, u64, String) {
    let mut args = vec!["run", utf8(archive), "--format", "jsonl"];
    args.extend_from_slice(extra);
    let o = thin(&args);
    assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
    let lines: Vec<Value> = String::from_utf8_lossy(&o.stdout).lines().map(|l| serde_json::from_str(l).expect("json line")).collect();
    let stats = lines.last().expect("stats");
    let text = lines[1..lines.len() - 1].iter().map(|l| l["text"].as_str().expect("text")).collect();
    (text, stats["prompt_tokens"].as_u64().expect("n"), stats["generated_tokens"].as_u64().expect("n"), stats["stop"].as_str().expect("stop").into())
}

fn finish_reason(run_stop: &str) -> &'static str {
    match run_stop {
        "eos" => "stop",
        "max_tokens" | "max_seq" => "length",
        other => panic!("run stopped by {other}"),
    }
}

/// The text, finish reason and usage of a streamed answer; checks the stream's shape on the way.
fn streamed(r: &Reply, chat: bool) -> (String, String, Option<Value>) {
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.header("content-type").is_some_and(|c| c.starts_with("text/event-stream")), "{:?}", r.headers);
    let events = r.events();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{events:?}");
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).expect("chunk")).collect();
    let id = chunks[0]["id"].clone();
    let object = if chat { "chat.completion.chunk" } else { "text_completion" };
    assert!(chunks.iter().all(|c| c["id"] == id && c["object"] == object), "{chunks:?}");
    let (mut text, mut finish, mut usage) = (String::new(), None, None);
    for (i, c) in chunks.iter().enumerate() {
        if let Some(u) = c.get("usage") {
            assert_eq!(c["choices"], json!([]), "the usage chunk has no choices");
            usage = Some(u.clone());
            continue;
        }
        assert!(finish.is_none(), "a chunk after the finish chunk: {c}");
        let choice = &c["choices"][0];
        if chat && i == 0 {
            assert_eq!(choice["delta"], json!({"role": "assistant", "content": ""}));
        }
        let piece = if chat { choice["delta"]["content"].as_str() } else { choice["text"].as_str() };
        text += piece.unwrap_or_default();
        finish = choice["finish_reason"].as_str().map(str::to_string);
    }
    (text, finish.expect("a finish chunk"), usage)
}

#[test]
fn answers_equal_thin_run_with_the_same_settings() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let a = tiny(tmp.path());
    let s = Served::start(&a, &[]);

    let h = http(s.addr, "GET", "/health", &[], b"");
    assert_eq!((h.status, h.json()), (200, json!({"status": "ok"})));
    let m = http(s.addr, "GET", "/v1/models", &[], b"").json();
    assert_eq!(m["object"], "list");
    assert_eq!((m["data"][0]["id"].as_str(), m["data"][0]["context_length"].as_u64()), (Some("llama-tiny"), Some(256)));

    // /v1/completions, greedy: the text, usage and finish reason of `thin run`.
    let (want, prompt_tokens, generated, stop) = run(&a, &["--prompt", "The quick brown fox", "--max-tokens", "12"]);
    let body = json!({"model": "llama-tiny", "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0});
    let r = s.ok("/v1/completions", &body);
    assert_eq!(r["object"], "text_completion");
    assert_eq!(r["choices"][0]["text"].as_str(), Some(want.as_str()));
    assert_eq!(r["choices"][0]["finish_reason"], finish_reason(&stop));
    assert_eq!(r["usage"], json!({"prompt_tokens": prompt_tokens, "completion_tokens": generated, "total_tokens": prompt_tokens + generated}));
    let (text, finish, usage) = streamed(&s.post("/v1/completions", &json!({"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "stream": true})), false);
    assert_eq!((text.as_str(), finish.as_str(), usage), (want.as_str(), finish_reason(&stop), None));

    // /v1/chat/completions: the archive's template around the messages, as `thin run --chat`.
    let (want, prompt_tokens, generated, stop) = run(&a, &["--chat", "--prompt", "hi there", "--max-tokens", "10"]);
    let body = json!({"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 10, "temperature": 0});
    let r = s.ok("/v1/chat/completions", &body);
    assert_eq!(r["object"], "chat.completion");
    assert_eq!(r["choices"][0]["message"], json!({"role": "assistant", "content": want}));
    assert_eq!(r["choices"][0]["finish_reason"], finish_reason(&stop));
    assert_eq!(r["usage"]["prompt_tokens"].as_u64(), Some(prompt_tokens));
    assert_eq!(r["usage"]["completion_tokens"].as_u64(), Some(generated));
    let mut body = body;
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (text, finish, usage) = streamed(&s.post("/v1/chat/completions", &body), true);
    assert_eq!((text.as_str(), finish.as_str()), (want.as_str(), finish_reason(&stop)));
    assert_eq!(usage, Some(r["usage"].clone()));

    // Seeded sampling is `thin run`'s sampler: the same seed, the same text.
    let (want, ..) = run(&a, &["--prompt", "Once", "--max-tokens", "16", "--temperature", "1", "--seed", "7"]);
    let body = json!({"prompt": "Once", "max_tokens": 16, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 7});
    assert_eq!(s.ok("/v1/completions", &body)["choices"][0]["text"].as_str(), Some(want.as_str()));
    assert_eq!(s.ok("/v1/completions", &body)["choices"][0]["text"].as_str(), Some(want.as_str()));

    // A stop string: the text ends before its first occurrence, finish_reason "stop", streamed
    // or not (the stream holds back a possible start of it, never sends it).
    let (full, ..) = run(&a, &["--prompt", "The quick brown fox", "--max-tokens", "12"]);
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() >= 6, "{full:?}");
    let stop: String = chars[3..5].iter().collect();
    let want = &full[..full.find(&stop).expect("stop string in the text")];
    for stream in [false, true] {
        let body = json!({"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "stop": [stop], "stream": stream});
        let (text, finish) = if stream {
            let (t, f, _) = streamed(&s.post("/v1/completions", &body), false);
            (t, f)
        } else {
            let r = s.ok("/v1/completions", &body);
            (r["choices"][0]["text"].as_str().expect("text").to_string(), r["choices"][0]["finish_reason"].as_str().expect("finish").to_string())
        };
        assert_eq!((text.as_str(), finish.as_str()), (want, "stop"), "stop {stop:?} in {full:?}, stream {stream}");
    }

    // Without max_tokens the answer may fill the context: 250 prompt ids leave 6 positions.
    let ids: Vec<u32> = vec![5; 250];
    let r = s.ok("/v1/completions", &json!({"prompt": ids, "temperature": 0}));
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    assert_eq!(r["usage"]["completion_tokens"], 6);
}

/// `thin serve` takes `thin run`'s run-control flags: the sampling flags and `--seed` are the
/// defaults of requests that do not say, `--system` goes first in chat requests that bring no
/// system message, `--stop` is added to every request's.
#[test]
fn the_run_control_flags_are_the_defaults_of_requests() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let a = tiny(tmp.path());
    // The stop string: an ASCII character of the greedy completion that does not begin it.
    let (full, ..) = run(&a, &["--prompt", "The quick brown fox", "--max-tokens", "12"]);
    let stop = full.chars().find(|&c| c.is_ascii_graphic() && full.find(c).is_some_and(|i| i > 0)).expect("an ASCII character").to_string();
    let cut = &full[..full.find(&stop).expect("stop string in the text")];
    assert!(!cut.is_empty() && cut.len() < full.len(), "{full:?}");
    let sys = "Answer briefly.";
    let s = Served::start(&a, &["--temperature", "1", "--top-k", "0", "--top-p", "1", "--seed", "7", "--system", sys, "--stop", &stop, "--ctx", "200"]);
    assert_eq!(http(s.addr, "GET", "/v1/models", &[], b"").json()["data"][0]["context_length"], 200);

    // Nothing but the messages: `thin run --chat --system` with the same sampling and seed, cut
    // before the stop string (jsonl lists whole tokens), twice the same text.
    let (sampled, ..) = run(&a, &["--chat", "--system", sys, "--prompt", "hi there", "--max-tokens", "10", "--temperature", "1", "--seed", "7"]);
    let want = &sampled[..sampled.find(&stop).unwrap_or(sampled.len())];
    assert!(!want.is_empty(), "{sampled:?} begins with {stop:?}");
    let body = json!({"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 10});
    for _ in 0..2 {
        assert_eq!(s.ok("/v1/chat/completions", &body)["choices"][0]["message"]["content"].as_str(), Some(want));
    }
    // Without --seed each request would draw its own: the seed is what makes these equal.
    let (other, ..) = run(&a, &["--chat", "--system", sys, "--prompt", "hi there", "--max-tokens", "10", "--temperature", "1", "--seed", "8"]);
    assert_ne!(other, sampled, "seeds 7 and 8 give the same text: the check above proves nothing");
    // A request's own system message and fields win.
    let (want, ..) = run(&a, &["--chat", "--system", "Other.", "--prompt", "hi there", "--max-tokens", "10"]);
    let body = json!({"messages": [{"role": "system", "content": "Other."}, {"role": "user", "content": "hi there"}], "max_tokens": 10, "temperature": 0, "stop": "\u{1}"});
    let r = s.ok("/v1/chat/completions", &body);
    let text = r["choices"][0]["message"]["content"].as_str().expect("text");
    // --stop still applies on top of the request's own stop string.
    assert_eq!(text, &want[..want.find(&stop).unwrap_or(want.len())]);
    // --stop on a completion: the greedy text cut before it.
    let r = s.ok("/v1/completions", &json!({"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}));
    assert_eq!((r["choices"][0]["text"].as_str(), r["choices"][0]["finish_reason"].as_str()), (Some(cut), Some("stop")));
}

#[test]
fn bad_input_is_a_4xx_with_an_error_object_and_the_next_request_is_served() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let a = tiny(tmp.path());
    let s = Served::start(&a, &["--max-body-bytes", "4096", "--timeout", "1"]);
    let good = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let still_served = |what: &str| {
        let r = s.post("/v1/chat/completions", &good);
        assert_eq!(r.status, 200, "after {what}: {}", r.text());
    };
    let msg = |content: &str| json!([{"role": "user", "content": content}]);
    let long = "a".repeat(300); // byte-level tokenizer: 300 tokens, the context is 256
    // (path, raw body, status, param, code)
    let cases: Vec<(&str, String, u16, Value, Value)> = vec![
        ("/v1/chat/completions", "{\"messages\": [".into(), 400, Value::Null, json!("invalid_json")),
        ("/v1/chat/completions", "\"just a string\"".into(), 400, Value::Null, Value::Null),
        ("/v1/chat/completions", json!({"messages": msg("x"), "max_tokens": "5"}).to_string(), 400, json!("max_tokens"), Value::Null),
        ("/v1/chat/completions", json!({"messages": msg("x"), "temperature": [1]}).to_string(), 400, json!("temperature"), Value::Null),
        ("/v1/chat/completions", json!({"messages": "hi"}).to_string(), 400, json!("messages"), Value::Null),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": 3}]}).to_string(), 400, json!("messages[0].content"), Value::Null),
        ("/v1/chat/completions", json!({"model": "gpt-4o", "messages": msg("x")}).to_string(), 404, json!("model"), json!("model_not_found")),
        ("/v1/chat/completions", json!({"messages": []}).to_string(), 400, json!("messages"), Value::Null),
        ("/v1/chat/completions", json!({"messages": msg(&long)}).to_string(), 400, json!("messages"), json!("context_length_exceeded")),
        ("/v1/chat/completions", json!({"messages": msg("x"), "max_tokens": 1000}).to_string(), 400, json!("max_tokens"), json!("context_length_exceeded")),
        ("/v1/completions", json!({"prompt": vec![5u32; 300]}).to_string(), 400, json!("prompt"), json!("context_length_exceeded")),
        ("/v1/completions", json!({"prompt": [5, 100000]}).to_string(), 400, json!("prompt"), Value::Null),
        ("/v1/completions", json!({"prompt": "x", "max_tokens": 0}).to_string(), 400, json!("max_tokens"), Value::Null),
        ("/v1/completions", json!({"prompt": "x".repeat(5000)}).to_string(), 413, Value::Null, json!("request_too_large")),
    ];
    for (path, body, status, param, code) in cases {
        let r = http(s.addr, "POST", path, &[], body.as_bytes());
        assert_eq!(r.status, status, "{path} {body:.80}: {}", r.text());
        let (kind, p, c) = r.error();
        assert_eq!((kind.as_str(), p, c), ("invalid_request_error", param, code), "{body:.80}");
        still_served(&body);
    }

    // An oversized body sent in chunks (no Content-Length) is cut off at the limit too.
    let mut c = connect(s.addr);
    let chunk = format!("{:x}\r\n{}\r\n", 3000, "x".repeat(3000));
    let req = "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n";
    c.write_all(format!("{req}{chunk}{chunk}0\r\n\r\n").as_bytes()).expect("write");
    let mut raw = Vec::new();
    let _ = c.read_to_end(&mut raw);
    let r = parse_reply(&raw);
    assert_eq!((r.status, r.error().2), (413, json!("request_too_large")));
    still_served("a chunked oversized body");

    // Unknown URL, wrong method.
    let r = http(s.addr, "GET", "/v2/nothing", &[], b"");
    assert_eq!((r.status, r.error().2), (404, json!("unknown_url")));
    let r = http(s.addr, "GET", "/v1/chat/completions", &[], b"");
    assert_eq!((r.status, r.error().2), (405, json!("method_not_allowed")));

    // A slow client: a body that stops arriving is a 408 after --timeout (1 s), while other
    // clients are served meanwhile.
    let mut slow = connect(s.addr);
    slow.write_all(head("POST", "/v1/chat/completions", &[], Some(100)).as_bytes()).expect("write");
    slow.write_all(b"{\"messages\":").expect("write");
    let start = Instant::now();
    still_served("a slow client, meanwhile");
    let mut raw = Vec::new();
    let _ = slow.read_to_end(&mut raw);
    let r = parse_reply(&raw);
    assert_eq!((r.status, r.error().2), (408, json!("request_timeout")));
    let waited = start.elapsed().as_secs_f64();
    assert!((0.8..10.0).contains(&waited), "408 after {waited} s");
    still_served("a slow client");

    // A client that sends its request head slowly, a header line every 200 ms, or connects and
    // sends nothing: disconnected once --timeout (1 s) has passed since it connected, however
    // it trickles; others are served meanwhile and after.
    for trickle in [true, false] {
        let mut slow = connect(s.addr);
        let start = Instant::now();
        slow.set_read_timeout(Some(Duration::from_millis(200))).expect("timeout");
        slow.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n").expect("write");
        still_served("a slow head, meanwhile");
        let mut raw = Vec::new();
        let closed = loop {
            assert!(start.elapsed() < Duration::from_secs(10), "still open after 10 s (trickle {trickle})");
            if trickle && slow.write_all(b"X-Slow: 1\r\n").is_err() {
                break start.elapsed();
            }
            let mut buf = [0u8; 512];
            match slow.read(&mut buf) {
                Ok(0) => break start.elapsed(),
                Ok(n) => raw.extend_from_slice(&buf[..n]),
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                Err(_) => break start.elapsed(), // reset by the server
            }
        };
        let closed = closed.as_secs_f64();
        assert!((0.9..3.0).contains(&closed), "trickle {trickle}: closed after {closed} s");
        // hyper closes it without an answer, or with a 408; never anything else.
        assert!(raw.is_empty() || raw.starts_with(b"HTTP/1.1 408"), "{}", String::from_utf8_lossy(&raw));
        still_served("a slow head");
    }

    // Bytes that are not HTTP at all; a client that connects and leaves.
    let mut junk = connect(s.addr);
    junk.write_all(b"\x00\x01garbage\r\n\r\n").expect("write");
    let mut raw = Vec::new();
    let _ = junk.read_to_end(&mut raw);
    assert!(raw.starts_with(b"HTTP/1.1 400"), "{}", String::from_utf8_lossy(&raw));
    drop(connect(s.addr));
    still_served("junk and an empty connection");
}

#[test]
fn api_key_is_required_when_given() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let a = tiny(tmp.path());
    let s = Served::start(&a, &["--api-key", "sekret-1"]);
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string();
    for (headers, status) in [
        (vec![], 401),
        (vec![("Authorization", "Bearer wrong-11")], 401),
        (vec![("Authorization", "sekret-1")], 401),
        (vec![("Authorization", "Bearer sekret-1")], 200),
    ] {
        let r = http(s.addr, "POST", "/v1/chat/completions", &headers, body.as_bytes());
        assert_eq!(r.status, status, "{headers:?}: {}", r.text());
        if status == 401 {
            assert_eq!(r.error().2, json!("invalid_api_key"));
        }
        assert_eq!(http(s.addr, "GET", "/v1/models", &headers, b"").status, status, "{headers:?}");
    }
    assert_eq!(http(s.addr, "GET", "/health", &[], b"").status, 200, "/health needs no key");
}

fn is_content_chunk(line: &str) -> bool {
    line.starts_with("data: {") && line.contains("\"content\":\"") && !line.contains("\"role\"")
}

/// Reads a streamed response's next `n` content chunks (the engine is generating by then).
fn read_chunks(s: &mut BufReader<TcpStream>, n: usize) {
    let mut got = 0;
    let mut line = String::new();
    while got < n {
        line.clear();
        assert!(s.read_line(&mut line).expect("read") > 0, "stream ended after {got} chunks");
        got += is_content_chunk(&line) as usize;
    }
}

/// Counts the content chunks that have already arrived, without waiting for more.
fn drain_chunks(s: &mut BufReader<TcpStream>) -> usize {
    s.get_ref().set_nonblocking(true).expect("nonblocking");
    let (mut got, mut line) = (0, String::new());
    loop {
        line.clear();
        match s.read_line(&mut line) {
            Ok(0) | Err(_) => return got,
            Ok(_) => got += is_content_chunk(&line) as usize,
        }
    }
}

/// "<id>: P prompt tokens, N generated in S s; stop: <why>" → (N, why).
fn generated(line: &str) -> (usize, String) {
    let n = line.split(" prompt tokens, ").nth(1).and_then(|r| r.split(' ').next()).and_then(|n| n.parse().ok());
    let stop = line.rsplit("stop: ").next().unwrap_or_default().to_string();
    (n.unwrap_or_else(|| panic!("{line}")), stop)
}

#[test]
fn real_smollm2_queue_disconnects_and_the_openai_client() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let a = smollm2(tmp.path());
    let long = |stream: bool| {
        json!({"messages": [{"role": "user", "content": "Write a long story about the sea."}], "max_tokens": 400, "temperature": 0, "stream": stream})
            .to_string()
    };
    {
        let s = Served::start(&a, &["--queue", "1"]);
        // A: streams; once 3 chunks have come, the engine is busy with it.
        let mut first = BufReader::new(connect(s.addr));
        first.get_mut().write_all((head("POST", "/v1/chat/completions", &[], Some(long(true).len())) + &long(true)).as_bytes()).expect("write");
        read_chunks(&mut first, 3);
        // B waits in the queue (its one place); C finds it full.
        let short = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}).to_string();
        let mut second = connect(s.addr);
        second.write_all((head("POST", "/v1/chat/completions", &[], Some(short.len())) + &short).as_bytes()).expect("write");
        std::thread::sleep(Duration::from_millis(300));
        let t = Instant::now();
        let r = http(s.addr, "POST", "/v1/chat/completions", &[], short.as_bytes());
        assert_eq!(r.status, 429, "{}", r.text());
        assert!(t.elapsed() < Duration::from_secs(2), "the 429 waited for the engine");
        assert_eq!(r.error(), ("requests".into(), Value::Null, json!("rate_limit_exceeded")));
        assert_eq!(r.header("retry-after"), Some("1"));
        // A's client reads what has come and goes away. The server notices when it next writes
        // (the first write after the close may still succeed) and the engine stops at the token
        // after that: a few tokens past what the client saw, never the 400 asked for. B is
        // answered.
        read_chunks(&mut first, 2);
        let seen = 5 + drain_chunks(&mut first);
        drop(first);
        let (n, stop) = generated(&s.finished("chatcmpl-1", Duration::from_secs(30)));
        assert_eq!(stop, "cancelled");
        assert!((seen..=seen + 3).contains(&n), "A generated {n} tokens; its client saw {seen} and left");
        eprintln!("cancelled: the client saw {seen} chunks, the engine generated {n} tokens");
        let mut raw = Vec::new();
        second.read_to_end(&mut raw).expect("read B");
        let r = parse_reply(&raw);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["usage"]["completion_tokens"], 3);
        // A client of a non-streamed answer that leaves cancels it too.
        let mut d = connect(s.addr);
        d.write_all((head("POST", "/v1/chat/completions", &[], Some(long(false).len())) + &long(false)).as_bytes()).expect("write");
        std::thread::sleep(Duration::from_millis(1500));
        drop(d);
        let (n, stop) = generated(&s.finished("chatcmpl-4", Duration::from_secs(30)));
        assert_eq!(stop, "cancelled");
        assert!(n < 400, "{n}");
        assert_eq!(s.post("/v1/chat/completions", &serde_json::from_str::<Value>(&short).expect("json")).status, 200);
    }
    openai_client(&a, tmp.path());
}

/// A venv with the pinned `openai` package (made once, kept under target/).
fn openai_python() -> PathBuf {
    const OPENAI: &str = "openai==3.63.0";
    let venv = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("openai-venv");
    let python = venv.join("bin/python");
    let marker = venv.join(OPENAI);
    if !marker.is_file() {
        let _ = std::fs::remove_dir_all(&venv);
        let o = Command::new("python3").args(["-m", "venv", utf8(&venv)]).output().expect("python3 -m venv");
        assert!(o.status.success(), "venv: {}", String::from_utf8_lossy(&o.stderr));
        let o = Command::new(&python)
            .args(["-m", "pip", "install", "-q", "--disable-pip-version-check", OPENAI])
            .env("PIP_CACHE_DIR", repo().join(".cache/pip-http"))
            .output()
            .expect("pip");
        assert!(o.status.success(), "pip install {OPENAI}: {}", String::from_utf8_lossy(&o.stderr));
        std::fs::write(&marker, b"").expect("marker");
    }
    python
}

/// scripts/serve_client_test.py with the openai package: on SmolLM2, a non-streamed and a
/// streamed chat completion whose text is `thin run --chat`'s; on the tiny model, 200 requests
/// from 8 clients against a queue of 2, every one answered 200 or 429, the server's RSS flat.
fn openai_client(smollm2: &Path, dir: &Path) {
    let python = openai_python();
    let script = repo().join("scripts/serve_client_test.py");
    let prompt = "What is the capital of France?";
    let (text, prompt_tokens, generated, stop) = run(smollm2, &["--chat", "--prompt", prompt, "--max-tokens", "24"]);
    let expect = dir.join("expect.json");
    let want = json!({"text": text, "finish_reason": finish_reason(&stop), "prompt_tokens": prompt_tokens, "completion_tokens": generated});
    std::fs::write(&expect, want.to_string()).expect("write");
    let s = Served::start(smollm2, &["--api-key", "k-123"]);
    let url = format!("http://{}/v1", s.addr);
    let o = Command::new(&python)
        .args([utf8(&script), "equal", "--base-url", &url, "--api-key", "k-123", "--model", "smollm2"])
        .args(["--prompt", prompt, "--max-tokens", "24", "--expect", utf8(&expect)])
        .output()
        .expect("python");
    assert!(o.status.success(), "{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    eprint!("{}", String::from_utf8_lossy(&o.stdout));
    drop(s);

    let tiny = tiny(dir);
    let s = Served::start(&tiny, &["--queue", "2"]);
    let url = format!("http://{}/v1", s.addr);
    let o = Command::new(&python)
        .args([utf8(&script), "load", "--base-url", &url, "--model", "llama-tiny", "--pid", &s.child.id().to_string()])
        .args(["--requests", "200", "--clients", "8"])
        .output()
        .expect("python");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}{}", String::from_utf8_lossy(&o.stderr));
    eprintln!("{out}");
}
