//! `thin chat` on llama-tiny with its input piped: each answer equals `thin run` on the whole
//! conversation rendered by the archive's template (computed here with the tokenizer), a message
//! that cannot fit is refused and the chat goes on, `/clear` forgets, `/exit` quits.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use thin_core::format::Archive;
use thin_core::tokenizer::{ChatMessage, TextTokenizer};

fn thin(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_thin")).args(args).env("RAYON_NUM_THREADS", "2").output().expect("run thin")
}

fn utf8(p: &Path) -> &str {
    p.to_str().expect("utf8 path")
}

fn tiny(dir: &Path) -> PathBuf {
    let out = dir.join("llama-tiny.thin");
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny/llama-tiny");
    let o = thin(&["convert", utf8(&src), "-o", utf8(&out), "--profile", "f32", "--quiet"]);
    assert!(o.status.success(), "convert: {}", String::from_utf8_lossy(&o.stderr));
    out
}

/// `thin run --prompt-ids` on the conversation rendered with the template: the answer's text.
fn answer(archive: &Path, tok: &TextTokenizer, conversation: &[(&str, &str)], max_tokens: usize) -> String {
    let msgs: Vec<ChatMessage> = conversation.iter().map(|(r, c)| ChatMessage { role: r.to_string(), content: c.to_string() }).collect();
    let ids = tok.encode(&tok.render_chat(&msgs).expect("template")).expect("encode");
    let ids = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let o = thin(&["run", utf8(archive), "--prompt-ids", &ids, "--max-tokens", &max_tokens.to_string(), "--format", "jsonl"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout).lines().map(|l| serde_json::from_str(l).expect("json")).collect();
    lines[1..lines.len() - 1].iter().map(|l| l["text"].as_str().expect("text")).collect()
}

fn chat(archive: &Path, args: &[&str], input: &str) -> (String, String, Option<i32>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_thin"))
        .args(["chat", utf8(archive)])
        .args(args)
        .env("RAYON_NUM_THREADS", "2")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("thin chat");
    child.stdin.take().expect("stdin").write_all(input.as_bytes()).expect("write");
    let o = child.wait_with_output().expect("wait");
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned(), o.status.code())
}

#[test]
fn chat_answers_each_turn_over_the_whole_conversation() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let a = tiny(tmp.path());
    let tok = TextTokenizer::from_info(&Archive::open(&a).expect("open").manifest().tokenizer).expect("tokenizer");

    let system = ("system", "Be brief.");
    let a1 = answer(&a, &tok, &[system, ("user", "hi there")], 6);
    let a2 = answer(&a, &tok, &[system, ("user", "hi there"), ("assistant", &a1), ("user", "and again")], 6);
    // After /clear only the system message remains.
    let a3 = answer(&a, &tok, &[system, ("user", "fresh")], 6);
    let (out, err, code) = chat(&a, &["--system", "Be brief.", "--max-tokens", "6"], "hi there\nand again\n/clear\n\nfresh\n/exit\nnever read\n");
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out, format!("{a1}\n{a2}\n{a3}\n"), "{err}");

    // llama-tiny's context is 256: with 200 kept for the answer, a 100-byte message cannot fit;
    // it is refused and the next one is answered. End of input quits like /exit.
    let long = "x".repeat(100);
    let a4 = answer(&a, &tok, &[("user", "ok")], 200);
    let (out, err, code) = chat(&a, &["--max-tokens", "200"], &format!("{long}\nok\n"));
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("does not fit the context of 256 tokens"), "{err}");
    assert_eq!(out, format!("{a4}\n"));

    // Turns that no longer fit are dropped, oldest first: after a 200-token answer the first turn
    // leaves no room for the next answer, so the second turn is answered without it.
    let a6 = answer(&a, &tok, &[("user", "more")], 200);
    let msg = |role: &str, content: &str| ChatMessage { role: role.into(), content: content.into() };
    let both = tok.render_chat(&[msg("user", "ok"), msg("assistant", &a4), msg("user", "more")]).expect("template");
    let n = tok.encode(&both).expect("encode").len();
    assert!(n + 200 > 256, "the test needs the first turn to crowd out the second answer ({n} tokens)");
    let (out, err, code) = chat(&a, &["--max-tokens", "200"], "ok\nmore\n");
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out, format!("{a4}\n{a6}\n"), "{err}");
}
