//! `thin chat`: an interactive terminal chat (like `llama-cli -cnv`). Each turn renders the whole
//! conversation through the archive's chat template; the oldest turns are dropped when it would no
//! longer leave room for an answer in the context. Ctrl-C stops the answer being written (and
//! quits at the prompt); `/exit` or end of input quits, `/clear` forgets the conversation. The run
//! control (context, system message, stop strings, sampling) is `thin run`'s.

use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context};
use clap::Args;
use thin::{Flow, GenerateOptions, Session, StopStrings};
use thin_core::tokenizer::ChatMessage;

use crate::run::RunControl;

#[derive(Args, Debug)]
pub struct ChatArgs {
    /// A .thin archive with a chat template.
    pub model: PathBuf,
    /// Most tokens per answer; the conversation is shortened to leave this much room.
    #[arg(long, default_value_t = 512)]
    pub max_tokens: usize,
    #[command(flatten)]
    pub control: RunControl,
}

/// The conversation's prompt ids, with the oldest user/assistant turns dropped until they leave
/// `room` positions for the answer; `None` when even the last message alone does not fit.
fn fit(session: &Session, history: &mut Vec<ChatMessage>, room: usize) -> anyhow::Result<Option<Vec<u32>>> {
    let tok = session.tokenizer();
    let first_turn = usize::from(history.first().is_some_and(|m| m.role == "system"));
    loop {
        let ids = tok.encode(&tok.render_chat(history).context("rendering the chat template")?)?;
        if ids.len() + room <= session.ctx() {
            return Ok(Some(ids));
        }
        if history.len() <= first_turn + 1 {
            return Ok(None);
        }
        // A turn is a user message and the answer to it: drop both, so roles still alternate.
        history.remove(first_turn);
        if history.get(first_turn).is_some_and(|m| m.role == "assistant") && history.len() > first_turn + 1 {
            history.remove(first_turn);
        }
    }
}

pub fn chat(a: ChatArgs) -> anyhow::Result<()> {
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let mut session = a.control.open(&a.model)?;
    if a.max_tokens >= session.ctx() {
        bail!("--max-tokens {} leaves no room for a message in a context of {} tokens", a.max_tokens, session.ctx());
    }
    let sampling = a.control.sampling();
    // Ctrl-C: stop the answer being generated; at the prompt, quit.
    let (generating, stop) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
    {
        let (generating, stop) = (generating.clone(), stop.clone());
        ctrlc::set_handler(move || {
            if generating.load(Ordering::SeqCst) {
                stop.store(true, Ordering::SeqCst);
            } else {
                eprintln!();
                std::process::exit(130);
            }
        })
        .context("installing the Ctrl-C handler")?;
    }
    let interactive = std::io::stdin().is_terminal();
    eprintln!(
        "{} on {}, context {} tokens. /exit quits, /clear forgets the conversation, Ctrl-C stops an answer.",
        session.arch(),
        session.backend(),
        session.ctx()
    );
    let system: Vec<ChatMessage> = a.control.system_message().into_iter().collect();
    let mut history = system.clone();
    let tok = session.tokenizer().clone();
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    let mut out = std::io::stdout();
    loop {
        if interactive {
            write!(out, "> ")?;
            out.flush()?;
        }
        let Some(line) = lines.next() else { break };
        let line = line.context("reading standard input")?;
        match line.trim() {
            "/exit" => break,
            "/clear" => {
                history.clone_from(&system);
                continue;
            }
            "" => continue,
            _ => {}
        }
        history.push(ChatMessage { role: "user".into(), content: line });
        let Some(prompt) = fit(&session, &mut history, a.max_tokens)? else {
            eprintln!("that message does not fit the context of {} tokens with room for an answer; not sent", session.ctx());
            history.pop();
            continue;
        };
        let mut answer = String::new();
        let mut stream = tok.stream();
        let mut stops = StopStrings::new(&a.control.stop);
        let mut stopped_by_string = false;
        stop.store(false, Ordering::SeqCst);
        generating.store(true, Ordering::SeqCst);
        let opts = GenerateOptions { max_tokens: a.max_tokens, sampling };
        let result = session.generate(&prompt, &opts, |id| {
            if stop.load(Ordering::SeqCst) {
                return Ok(Flow::Stop);
            }
            if !tok.is_eos(id) {
                let (text, at_stop) = stops.push(&stream.push(id)?);
                out.write_all(text.as_bytes())?;
                out.flush()?;
                answer += &text;
                stopped_by_string = at_stop;
            }
            Ok(if stopped_by_string { Flow::Stop } else { Flow::Continue })
        });
        generating.store(false, Ordering::SeqCst);
        if !stopped_by_string {
            let rest = stops.finish();
            out.write_all(rest.as_bytes())?;
            answer += &rest;
        }
        writeln!(out)?;
        let stats = result?;
        if stats.stop == thin::Stop::Cancelled && !stopped_by_string {
            eprintln!("[stopped]");
        }
        history.push(ChatMessage { role: "assistant".into(), content: answer });
    }
    Ok(())
}
