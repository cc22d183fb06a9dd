//! The `tokenizers` BPE that encodes a SentencePiece vocabulary as llama.cpp's `llm_tokenizer_spm`
//! does, built directly from the vocabulary (tokens, scores, token types) the archive stores.
//!
//! Spaces become `▁`, adjacent pieces merge highest score first into a token of the vocabulary,
//! and what no token covers falls back to `<0xXX>` byte tokens. SentencePiece stores scores, not
//! merges, so the merges are derived from them as transformers' `SentencePieceExtractor` does:
//! every split of a token into two tokens, ranked by the whole token's score. Control,
//! user-defined and unknown tokens are added tokens, split out of the text before the merges
//! (llama.cpp's `tokenizer_st_partition`). Decoding turns `▁` back into spaces and byte tokens
//! into bytes.
//!
//! The archive keeps the vocabulary, not the half million derived merges: deriving them and
//! building the BPE here is several times cheaper than parsing them back from a 12 MB
//! `tokenizer.json` (Gemma 3), and every open pays it.

use std::collections::{HashMap, HashSet};

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::replace::Replace;
use tokenizers::{AddedToken, DecoderWrapper, NormalizerWrapper, Tokenizer};

use crate::manifest::SentencePieceVocab;

// llama.cpp's `llama_token_type` (the values of `tokenizer.ggml.token_type`).
pub const TOKEN_TYPE_UNKNOWN: i32 = 2;
pub const TOKEN_TYPE_CONTROL: i32 = 3;
pub const TOKEN_TYPE_USER_DEFINED: i32 = 4;
pub const TOKEN_TYPE_BYTE: i32 = 6;

/// Bytes hashed while deriving SentencePiece merges (the sum of every token's length squared):
/// Gemma 3's 262,144 tokens take 26.5M; a vocabulary of huge tokens is refused before the work.
pub const MAX_SENTENCEPIECE_MERGE_WORK: u64 = 1 << 30;

/// Why a stored SentencePiece vocabulary cannot be built: the field it concerns (`tokens`,
/// `scores`, `types`, `unknown_token_id`) and the reason.
#[derive(Debug, Clone, PartialEq)]
pub struct VocabError {
    pub field: &'static str,
    pub reason: String,
}

impl std::fmt::Display for VocabError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sentencepiece.{}: {}", self.field, self.reason)
    }
}

/// Everything [`build`] needs to hold before it sizes or hashes anything: one finite score and one
/// type per token, an unknown id inside the vocabulary, all 256 byte tokens, bounded merge work.
pub fn check(v: &SentencePieceVocab) -> Result<(), VocabError> {
    let n = v.tokens.len();
    if v.scores.len() != n {
        return Err(VocabError { field: "scores", reason: format!("{} scores for {n} tokens", v.scores.len()) });
    }
    if let Some(i) = v.scores.iter().position(|s| !s.is_finite()) {
        // The manifest is JSON, which has no NaN or infinity: such a score could not be stored.
        return Err(VocabError { field: "scores", reason: format!("token {i}'s score is {}, not a finite number", v.scores[i]) });
    }
    if v.types.len() != n {
        return Err(VocabError { field: "types", reason: format!("{} types for {n} tokens", v.types.len()) });
    }
    if n > u32::MAX as usize {
        return Err(VocabError { field: "tokens", reason: format!("{n} tokens, more than ids can number") });
    }
    if let Some(id) = v.unknown_token_id.filter(|&id| id as usize >= n) {
        return Err(VocabError { field: "unknown_token_id", reason: format!("token id {id} >= vocab size {n}") });
    }
    let byte_tokens: HashSet<&str> =
        v.tokens.iter().zip(&v.types).filter(|&(_, &ty)| ty == TOKEN_TYPE_BYTE).map(|(t, _)| t.as_str()).collect();
    for b in 0..=255u8 {
        let piece = format!("<0x{b:02X}>");
        if !byte_tokens.contains(piece.as_str()) {
            return Err(VocabError {
                field: "tokens",
                reason: format!("no byte token {piece} (type {TOKEN_TYPE_BYTE}) for the byte fallback"),
            });
        }
    }
    let work = v.tokens.iter().fold(0u64, |w, t| w.saturating_add((t.len() as u64).saturating_mul(t.len() as u64)));
    if work > MAX_SENTENCEPIECE_MERGE_WORK {
        return Err(VocabError {
            field: "tokens",
            reason: format!(
                "deriving merges from these tokens would hash {work} bytes (their lengths squared), more than {MAX_SENTENCEPIECE_MERGE_WORK}"
            ),
        });
    }
    Ok(())
}

/// The merges, best first: every split of a token into two tokens, ranked by the whole token's score.
fn merges(v: &SentencePieceVocab) -> Vec<(String, String)> {
    // llama.cpp merges two pieces whenever their concatenation is any token of the vocabulary
    // (user-defined "▁▁" included; the last token of a repeated text wins, as in its map).
    let by_text: HashMap<&str, usize> = v.tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i)).collect();
    let mut merges: Vec<(f32, usize, &str, &str)> = Vec::new();
    for (&whole, &id) in &by_text {
        for (at, _) in whole.char_indices().skip(1) {
            let (left, right) = whole.split_at(at);
            if by_text.contains_key(left) && by_text.contains_key(right) {
                merges.push((v.scores[id], id, left, right));
            }
        }
    }
    // Highest score first, as llama.cpp's work queue. Among equal scores llama.cpp merges the
    // leftmost pair; ranking the longer token first does the same for runs of one piece (Gemma's
    // "▁▁".."▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁", all scored -1000): the leftmost symbol grows first.
    let whole_len = |m: &(f32, usize, &str, &str)| m.2.len() + m.3.len();
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(whole_len(b).cmp(&whole_len(a))).then(a.1.cmp(&b.1)).then(a.2.len().cmp(&b.2.len())));
    merges.into_iter().map(|(_, _, l, r)| (l.to_string(), r.to_string())).collect()
}

/// The tokenizer of a vocabulary that passed [`check`] (checked again here: this is the only
/// way in).
pub fn build(v: &SentencePieceVocab) -> Result<Tokenizer, VocabError> {
    check(v)?;
    let lib = |e: tokenizers::Error| VocabError { field: "tokens", reason: format!("the tokenizers library refused the BPE: {e}") };
    // A repeated text keeps its last id, as a JSON object's last key does.
    let vocab: Vocab = v.tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let mut bpe = BPE::builder().vocab_and_merges(vocab, merges(v)).fuse_unk(true).byte_fallback(true);
    if let Some(id) = v.unknown_token_id {
        bpe = bpe.unk_token(v.tokens[id as usize].clone());
    }
    let mut tok = Tokenizer::new(bpe.build().map_err(lib)?);
    tok.with_normalizer(Some(NormalizerWrapper::Replace(Replace::new(" ", "\u{2581}").map_err(lib)?)));
    tok.with_decoder(Some(DecoderWrapper::Sequence(Sequence::new(vec![
        DecoderWrapper::Replace(Replace::new("\u{2581}", " ").map_err(lib)?),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ]))));
    let added: Vec<AddedToken> = v
        .tokens
        .iter()
        .zip(&v.types)
        .filter(|&(_, ty)| [TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNKNOWN].contains(ty))
        .map(|(t, _)| AddedToken::from(t.clone(), true).single_word(false).lstrip(false).rstrip(false).normalized(false))
        .collect();
    tok.add_tokens(&added);
    Ok(tok)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Control tokens, the 256 byte tokens, then "▁", "a", "b", "ab", "▁ab" (best score first).
    fn vocab() -> SentencePieceVocab {
        let mut tokens: Vec<String> = ["<pad>", "<eos>", "<bos>", "<unk>"].map(String::from).to_vec();
        let mut types = vec![TOKEN_TYPE_CONTROL, TOKEN_TYPE_CONTROL, TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN];
        let mut scores = vec![-1000.0; 4];
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(TOKEN_TYPE_BYTE);
            scores.push(0.0);
        }
        for (t, sc) in [("▁", -1.0), ("a", -2.0), ("b", -3.0), ("ab", -4.0), ("▁ab", -5.0)] {
            tokens.push(t.into());
            types.push(1);
            scores.push(sc);
        }
        SentencePieceVocab { tokens, scores, types, unknown_token_id: Some(3) }
    }

    #[test]
    fn builds_merges_by_score_with_byte_fallback() {
        let tok = build(&vocab()).expect("builds");
        let enc = tok.encode("ab ab<eos>c", false).expect("encode");
        let id = |t: &str| tok.token_to_id(t).expect(t);
        assert_eq!(enc.get_ids(), [id("ab"), id("▁ab"), 1, id("<0x63>")]);
        assert_eq!(tok.decode(enc.get_ids(), false).expect("decode"), "ab ab<eos>c");
    }

    #[test]
    fn hostile_vocabularies_are_typed_errors() {
        let err = |f: &dyn Fn(&mut SentencePieceVocab)| {
            let mut v = vocab();
            f(&mut v);
            let checked = check(&v).expect_err("refused");
            assert_eq!(build(&v).err(), Some(checked.clone()), "build refuses what check refuses");
            checked
        };
        let e = err(&|v| {
            v.scores.pop();
        });
        assert_eq!((e.field, e.reason.as_str()), ("scores", "264 scores for 265 tokens"));
        let e = err(&|v| v.scores[7] = f32::NAN);
        assert_eq!((e.field, e.reason.as_str()), ("scores", "token 7's score is NaN, not a finite number"));
        let e = err(&|v| v.scores[9] = f32::NEG_INFINITY);
        assert_eq!((e.field, e.reason.as_str()), ("scores", "token 9's score is -inf, not a finite number"));
        let e = err(&|v| v.types.push(1));
        assert_eq!((e.field, e.reason.as_str()), ("types", "266 types for 265 tokens"));
        let e = err(&|v| v.unknown_token_id = Some(265));
        assert_eq!((e.field, e.reason.as_str()), ("unknown_token_id", "token id 265 >= vocab size 265"));
        let e = err(&|v| v.types[4 + 0x41] = 1);
        assert!(e.field == "tokens" && e.reason.contains("<0x41>"), "{e}");
        let e = err(&|v| v.tokens[264] = "a".repeat(40_000));
        assert!(e.field == "tokens" && e.reason.contains("would hash 16000"), "{e}");
    }
}
