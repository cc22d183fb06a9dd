//! Tokenizer wrapper (HF `tokenizers`) with BOS handling, streaming detokenization, and chat-template
//! rendering (minijinja, with Python string methods as HF templates use them).
//!
//! The tokenizer JSON and the chat template come from files (an archive, a GGUF, an HF directory),
//! and both libraries can panic on inputs they accept at parse time (a `Strip` decoder whose
//! `stop` runs past a token panics when that token is decoded). Every call into them runs under
//! [`guarded`], which turns a panic into [`TokenizerError::Panicked`] naming the part, and
//! [`TextTokenizer::from_info`] exercises the tokenizer once (a probe text encoded and decoded,
//! every vocabulary id decoded) so a broken one is refused where it enters, not mid-answer.

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::manifest::TokenizerInfo;

pub mod sentencepiece;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("the tokenizer in the archive does not load: {0}")]
    Load(String),
    #[error("encoding the prompt failed: {0}")]
    Encode(String),
    #[error("decoding tokens failed: {0}")]
    Decode(String),
    #[error("the archive has no chat template (needed for --chat)")]
    NoChatTemplate,
    #[error("chat template: {0}")]
    Template(String),
    #[error("the archive's chat template exceeded its {what} limit ({limit}) while rendering: a template that loops or grows without end")]
    TemplateLimit { what: &'static str, limit: u64 },
    #[error("the {part} crashed the {library} library while {during}: {message}")]
    Panicked { part: &'static str, library: &'static str, during: String, message: String },
}

/// The parts a [`TokenizerError::Panicked`] names.
pub const TOKENIZER_JSON: &str = "embedded tokenizer.json";
pub const CHAT_TEMPLATE: &str = "chat template";

/// Text every tokenizer must encode and decode at load: ASCII words, digits, punctuation,
/// whitespace runs, Latin-1, CJK, an emoji (4 UTF-8 bytes).
pub const PROBE_TEXT: &str = "Hello, world! 0123456789 \t\n  <|x|> é ß 中文 🙂";

thread_local! {
    /// Depth of [`guarded`] calls on this thread.
    static GUARDED: Cell<u32> = const { Cell::new(0) };
}

/// Whether this thread is inside a [`guarded`] library call: a panic hook stays quiet then (the
/// panic becomes a typed error when it unwinds out of the call).
pub fn in_guarded_call() -> bool {
    GUARDED.with(|g| g.get() > 0)
}

/// The message a panic carried (`panic!("...")` gives a `&str` or a `String`).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_string())
}

/// Runs `f`, a call into `library` on untrusted `part`, turning a panic into
/// [`TokenizerError::Panicked`].
fn guarded<T>(part: &'static str, library: &'static str, during: impl FnOnce() -> String, f: impl FnOnce() -> T) -> Result<T, TokenizerError> {
    GUARDED.with(|g| g.set(g.get() + 1));
    let r = catch_unwind(AssertUnwindSafe(f));
    GUARDED.with(|g| g.set(g.get() - 1));
    r.map_err(|p| TokenizerError::Panicked { part, library, during: during(), message: panic_message(&*p) })
}

/// Instructions a chat template may execute per render: real templates take a few thousand for
/// a long conversation; a looping one stops here in milliseconds.
pub const CHAT_TEMPLATE_FUEL: u64 = 2_000_000;
/// Bytes a rendered chat prompt may have (far above any context a model here takes).
pub const CHAT_TEMPLATE_MAX_OUTPUT: usize = 8 << 20;

/// A writer that refuses bytes past `limit` (the template stops at the first write past it).
struct Bounded {
    out: Vec<u8>,
    limit: usize,
    overflowed: bool,
}

impl std::io::Write for Bounded {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.out.len() + b.len() > self.limit {
            self.overflowed = true;
            return Err(std::io::Error::other("output limit"));
        }
        self.out.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The `tokenizers` tokenizer an archive describes: built from its SentencePiece vocabulary, or
/// parsed from its `tokenizer.json` (exactly one of the two is there).
fn library_tokenizer(info: &TokenizerInfo) -> Result<tokenizers::Tokenizer, TokenizerError> {
    match (&info.sentencepiece, info.tokenizer_json.is_empty()) {
        (Some(vocab), true) => guarded(TOKENIZER_JSON, "tokenizers", || "building it from the SentencePiece vocabulary".into(), || sentencepiece::build(vocab))?
            .map_err(|e| TokenizerError::Load(e.to_string())),
        (Some(_), false) => Err(TokenizerError::Load("both a tokenizer.json and a SentencePiece vocabulary: an archive has one".into())),
        (None, _) => guarded(TOKENIZER_JSON, "tokenizers", || "parsing it".into(), || info.tokenizer_json.parse::<tokenizers::Tokenizer>())?
            .map_err(|e| TokenizerError::Load(e.to_string())),
    }
}

/// One chat message as HF templates expect it (`{"role": ..., "content": ...}`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    bos_token_id: Option<u32>,
    eos_token_ids: Vec<u32>,
    add_bos: bool,
    chat_template: Option<String>,
}

impl TextTokenizer {
    /// Parses the tokenizer JSON and exercises it ([`TextTokenizer::probe`]): a tokenizer that
    /// does not load, fails or panics is refused here.
    pub fn from_info(info: &TokenizerInfo) -> Result<Self, TokenizerError> {
        let inner = library_tokenizer(info)?;
        let t = TextTokenizer {
            inner,
            bos_token_id: info.bos_token_id,
            eos_token_ids: info.eos_token_ids.clone(),
            add_bos: info.add_bos,
            chat_template: info.chat_template.clone(),
        };
        t.probe()?;
        Ok(t)
    }

    /// The kind of the library's model (`thin inspect`).
    pub fn model_type(&self) -> &'static str {
        match self.inner.get_model() {
            tokenizers::ModelWrapper::BPE(_) => "BPE",
            tokenizers::ModelWrapper::WordPiece(_) => "WordPiece",
            tokenizers::ModelWrapper::WordLevel(_) => "WordLevel",
            tokenizers::ModelWrapper::Unigram(_) => "Unigram",
        }
    }

    /// Entries of the model's vocabulary, added tokens not counted.
    pub fn model_vocab_size(&self) -> usize {
        self.inner.get_vocab_size(false)
    }

    /// Tokens split out of the text before the model sees it (special and user-defined).
    pub fn added_token_count(&self) -> usize {
        self.inner.get_added_tokens_decoder().len()
    }

    /// Encodes and decodes [`PROBE_TEXT`], then decodes every id of the vocabulary in one call
    /// (decoders work token by token, so a token that breaks the decoder shows here).
    pub fn probe(&self) -> Result<(), TokenizerError> {
        let ids = self.encode(PROBE_TEXT)?;
        self.decode(&ids)?;
        let vocab = u32::try_from(self.vocab_size()).unwrap_or(u32::MAX);
        let all: Vec<u32> = (0..vocab).collect();
        self.decode(&all)?;
        Ok(())
    }

    /// Ids of `text`; the tokenizer's own post-processor runs, and BOS is prepended when the archive
    /// asks for it and the post-processor did not already add it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let enc = guarded(TOKENIZER_JSON, "tokenizers", || format!("encoding {} bytes of text", text.len()), || self.inner.encode(text, true))?
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        let mut ids = enc.get_ids().to_vec();
        if let (true, Some(bos)) = (self.add_bos, self.bos_token_id) {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let during = || match ids {
            [id] => format!("decoding token {id}"),
            _ => format!("decoding {} tokens", ids.len()),
        };
        guarded(TOKENIZER_JSON, "tokenizers", during, || self.inner.decode(ids, false))?.map_err(|e| TokenizerError::Decode(e.to_string()))
    }

    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_token_ids.contains(&id)
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    fn token_text(&self, id: Option<u32>) -> String {
        id.and_then(|i| self.inner.id_to_token(i)).unwrap_or_default()
    }

    /// Renders the archive's chat template with `add_generation_prompt = true`.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, TokenizerError> {
        let template = self.chat_template.as_deref().ok_or(TokenizerError::NoChatTemplate)?;
        guarded(CHAT_TEMPLATE, "minijinja", || format!("rendering {} messages", messages.len()), || self.render_unguarded(template, messages))?
    }

    fn render_unguarded(&self, template: &str, messages: &[ChatMessage]) -> Result<String, TokenizerError> {
        let mut env = minijinja::Environment::new();
        env.set_fuel(Some(CHAT_TEMPLATE_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_template("chat", template).map_err(|e| TokenizerError::Template(e.to_string()))?;
        let tmpl = env.get_template("chat").map_err(|e| TokenizerError::Template(e.to_string()))?;
        let eos = self.token_text(self.eos_token_ids.first().copied());
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => self.token_text(self.bos_token_id),
            eos_token => eos,
        };
        let mut out = Bounded { out: Vec::new(), limit: CHAT_TEMPLATE_MAX_OUTPUT, overflowed: false };
        let rendered = tmpl.render_captured_to(ctx, &mut out).map(|_| ());
        match rendered {
            Ok(()) => String::from_utf8(out.out).map_err(|e| TokenizerError::Template(format!("renders invalid UTF-8: {e}"))),
            Err(e) if e.kind() == minijinja::ErrorKind::OutOfFuel => Err(TokenizerError::TemplateLimit { what: "instruction", limit: CHAT_TEMPLATE_FUEL }),
            Err(_) if out.overflowed => {
                Err(TokenizerError::TemplateLimit { what: "output size", limit: CHAT_TEMPLATE_MAX_OUTPUT as u64 })
            }
            Err(e) => Err(TokenizerError::Template(e.to_string())),
        }
    }

    /// Render the chat template once on a one-message conversation, as `thin run --chat` does: a
    /// template that does not parse, raises, loops or grows without end is refused where it
    /// enters (at convert), not when a user first chats. No template: nothing to check.
    pub fn check_chat_template(&self) -> Result<(), TokenizerError> {
        match self.render_chat(&[ChatMessage { role: "user".into(), content: "Hello".into() }]) {
            Ok(_) | Err(TokenizerError::NoChatTemplate) => Ok(()),
            Err(e) => Err(e),
        }
    }

    pub fn stream(&self) -> TokenStream<'_> {
        TokenStream { tok: self, ids: Vec::new(), prefix_offset: 0, read_offset: 0 }
    }
}

/// Incremental detokenization: text is emitted only once it is complete (no half UTF-8 sequence),
/// and each step decodes only a short window, so streaming stays O(1) per token.
pub struct TokenStream<'a> {
    tok: &'a TextTokenizer,
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl TokenStream<'_> {
    /// Adds one token and returns the text it completes (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String, TokenizerError> {
        self.ids.push(id);
        let prefix = self.tok.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = self.tok.decode(&self.ids[self.prefix_offset..])?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') {
            let new = full.get(prefix.len()..).unwrap_or_default().to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            Ok(new)
        } else {
            Ok(String::new())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tiny fixtures' tokenizer: byte-level BPE over the 256 byte symbols, no merges.
    fn byte_level_info(template: Option<&str>) -> TokenizerInfo {
        let json = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/tiny/llama-tiny/tokenizer.json"))
            .expect("fixture tokenizer");
        TokenizerInfo {
            tokenizer_json: json,
            sentencepiece: None,
            chat_template: template.map(str::to_string),
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
            add_bos: true,
        }
    }

    /// Templates that loop or grow without end stop at their limits with a typed error, quickly
    /// and in bounded memory; a real template renders; the check passes without a template.
    #[test]
    fn runaway_chat_templates_hit_their_limits() {
        let render = |tmpl: &str| TextTokenizer::from_info(&byte_level_info(Some(tmpl))).unwrap().render_chat(&[ChatMessage { role: "user".into(), content: "hi".into() }]);
        let t = std::time::Instant::now();
        match render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}") {
            Err(TokenizerError::TemplateLimit { what: "instruction", limit: CHAT_TEMPLATE_FUEL }) => {}
            other => panic!("nested loop: {other:?}"),
        }
        match render("{% for i in range(1000) %}{{ 'x' * 100000 }}{% endfor %}") {
            Err(e @ TokenizerError::TemplateLimit { what: "output size", .. }) => assert!(e.to_string().contains("chat template"), "{e}"),
            other => panic!("100 MB of output: {other:?}"),
        }
        assert!(t.elapsed().as_secs_f64() < 5.0, "limits took {:?}", t.elapsed());
        assert_eq!(render("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}").unwrap(), "<user>hi");
        assert!(TextTokenizer::from_info(&byte_level_info(None)).unwrap().check_chat_template().is_ok());
        let raises = TextTokenizer::from_info(&byte_level_info(Some("{{ raise_exception('no') }}"))).unwrap();
        assert!(matches!(raises.check_chat_template(), Err(TokenizerError::Template(_))));
    }

    #[test]
    fn encode_prepends_bos_once_and_round_trips() {
        let t = TextTokenizer::from_info(&byte_level_info(None)).unwrap();
        let ids = t.encode("héllo").unwrap();
        assert_eq!(ids[0], 1);
        assert_eq!(ids.len(), 1 + "héllo".len()); // one token per byte, no merges
        assert!(t.decode(&ids[1..]).unwrap() == "héllo");
        assert!(t.is_eos(2) && !t.is_eos(1));
    }

    #[test]
    fn stream_emits_whole_characters_only() {
        let t = TextTokenizer::from_info(&byte_level_info(None)).unwrap();
        let ids = t.encode("aé€b").unwrap();
        let mut s = t.stream();
        let pieces: Vec<String> = ids[1..].iter().map(|&i| s.push(i).unwrap()).collect();
        assert_eq!(pieces.concat(), "aé€b");
        // 'é' is two bytes: its first byte emits nothing, its second emits the character.
        assert_eq!(pieces[1], "");
        assert_eq!(pieces[2], "é");
    }

    #[test]
    fn chat_template_renders_with_python_methods() {
        let tpl = "{% for m in messages %}<|{{ m.role }}|>{{ m.content.strip() }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";
        let t = TextTokenizer::from_info(&byte_level_info(Some(tpl))).unwrap();
        let out = t.render_chat(&[ChatMessage { role: "user".into(), content: "  hi ".into() }]).unwrap();
        assert_eq!(out, "<|user|>hi\n<|assistant|>");
        let none = TextTokenizer::from_info(&byte_level_info(None)).unwrap();
        assert!(matches!(none.render_chat(&[]), Err(TokenizerError::NoChatTemplate)));
    }

    /// A `Strip` decoder whose `stop` runs past a one-character token parses, then panics inside
    /// `tokenizers` when that token is decoded (issue 24's reproducer): loading probes the whole
    /// vocabulary, so it is refused at load, naming the part; and a call on a tokenizer that got
    /// past the probe is guarded too.
    #[test]
    fn a_decoder_that_panics_is_refused_at_load() {
        let mut info = byte_level_info(None);
        let mut v: serde_json::Value = serde_json::from_str(&info.tokenizer_json).unwrap();
        v["decoder"] = serde_json::json!({"type": "Strip", "content": "a", "start": 0, "stop": 2});
        info.tokenizer_json = v.to_string();
        let parsed: tokenizers::Tokenizer = info.tokenizer_json.parse().expect("the library accepts it");
        let a = parsed.token_to_id("a").expect("byte-level 'a'");
        let hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        assert!(catch_unwind(AssertUnwindSafe(|| parsed.decode(&[a], false))).is_err(), "the library itself panics");
        let loaded = TextTokenizer::from_info(&info);
        let guarded_decode = TextTokenizer { inner: parsed, bos_token_id: None, eos_token_ids: vec![], add_bos: false, chat_template: None }.decode(&[a]);
        std::panic::set_hook(hook);
        match loaded {
            Err(e @ TokenizerError::Panicked { part: TOKENIZER_JSON, library: "tokenizers", .. }) => {
                let msg = e.to_string();
                assert!(msg.starts_with("the embedded tokenizer.json crashed the tokenizers library while decoding 256 tokens"), "{msg}");
            }
            other => panic!("{:?}", other.err()),
        }
        match guarded_decode {
            Err(TokenizerError::Panicked { during, .. }) => assert_eq!(during, format!("decoding token {a}")),
            other => panic!("{other:?}"),
        }
        assert!(!in_guarded_call());
    }

    /// An archive's tokenizer is a tokenizer.json or a SentencePiece vocabulary, not both; a
    /// vocabulary that does not hold together is a load error.
    #[test]
    fn stored_sentencepiece_vocabulary_is_checked() {
        let mut info = byte_level_info(None);
        let vocab = crate::manifest::SentencePieceVocab { tokens: vec!["a".into()], scores: vec![0.0], types: vec![1], unknown_token_id: None };
        info.sentencepiece = Some(vocab);
        assert!(matches!(TextTokenizer::from_info(&info), Err(TokenizerError::Load(m)) if m.contains("both")));
        info.tokenizer_json.clear();
        assert!(matches!(TextTokenizer::from_info(&info), Err(TokenizerError::Load(m)) if m.contains("<0x00>")));
    }

    #[test]
    fn bad_tokenizer_json_is_a_typed_error() {
        let mut info = byte_level_info(None);
        info.tokenizer_json = "{not json".into();
        assert!(matches!(TextTokenizer::from_info(&info), Err(TokenizerError::Load(_))));
    }
}
