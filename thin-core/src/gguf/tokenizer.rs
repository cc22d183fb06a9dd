//! Hugging Face `tokenizer.json` from GGUF tokenizer metadata (`tokenizer.ggml.*`).
//!
//! For `tokenizer.ggml.model == "gpt2"` this builds what transformers' `GGUFGPTConverter`
//! (a `GPT2Converter`) builds: byte-level BPE over the GGUF vocab and merges, ByteLevel
//! pre-tokenizer/decoder/post-processor, control (3) and user-defined (4) tokens as special added
//! tokens.
//!
//! For `"llama"` (SentencePiece, as Gemma's GGUFs carry it: tokens, scores, token types, `<0xXX>`
//! byte tokens) it keeps the vocabulary itself ([`SentencePieceVocab`]); the tokenizer that
//! encodes as llama.cpp's `llm_tokenizer_spm` is built from it by
//! [`crate::tokenizer::sentencepiece`], at convert and at every open.

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

use super::{get_str, get_u64, GgufError, GgufValue};
use crate::manifest::{SentencePieceVocab, TokenizerInfo};
use crate::tokenizer::sentencepiece::{self, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED};

fn string_array<'m>(meta: &'m BTreeMap<String, GgufValue>, key: &str) -> Result<Option<Vec<&'m str>>, GgufError> {
    match meta.get(key) {
        None => Ok(None),
        Some(GgufValue::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_str().ok_or_else(|| GgufError::WrongKeyType {
                    key: key.to_string(),
                    expected: "array of string",
                    found: format!("array of {}", v.type_name()),
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        Some(v) => Err(GgufError::WrongKeyType {
            key: key.to_string(),
            expected: "array of string",
            found: v.type_name().to_string(),
        }),
    }
}

fn f32_array(meta: &BTreeMap<String, GgufValue>, key: &str) -> Result<Option<Vec<f32>>, GgufError> {
    let wrong = |found: String| GgufError::WrongKeyType { key: key.to_string(), expected: "array of f32", found };
    match meta.get(key) {
        None => Ok(None),
        Some(GgufValue::Array(a)) => a
            .iter()
            .map(|v| match *v {
                GgufValue::F32(x) => Ok(x),
                _ => Err(wrong(format!("array of {}", v.type_name()))),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        Some(v) => Err(wrong(v.type_name().to_string())),
    }
}

fn bool_key(meta: &BTreeMap<String, GgufValue>, key: &str) -> Result<Option<bool>, GgufError> {
    match meta.get(key) {
        None => Ok(None),
        Some(GgufValue::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(GgufError::WrongKeyType { key: key.into(), expected: "bool", found: v.type_name().into() }),
    }
}

fn token_id(meta: &BTreeMap<String, GgufValue>, key: &str, vocab: usize) -> Result<Option<u32>, GgufError> {
    match get_u64(meta, key)? {
        None => Ok(None),
        Some(id) if id < vocab as u64 => Ok(Some(id as u32)),
        Some(id) => Err(GgufError::BadValue {
            key: key.to_string(),
            reason: format!("token id {id} >= vocab size {vocab}"),
        }),
    }
}

/// `TokenizerInfo` (with an embedded HF `tokenizer.json`) from GGUF metadata.
pub fn tokenizer_from_gguf(meta: &BTreeMap<String, GgufValue>) -> Result<TokenizerInfo, GgufError> {
    let model = get_str(meta, "tokenizer.ggml.model")?
        .ok_or_else(|| GgufError::MissingKey("tokenizer.ggml.model".to_string()))?;
    let sentencepiece = match model {
        "gpt2" => false,
        "llama" => true,
        other => return Err(GgufError::UnsupportedTokenizer(other.to_string())),
    };
    let tokens = string_array(meta, "tokenizer.ggml.tokens")?
        .ok_or_else(|| GgufError::MissingKey("tokenizer.ggml.tokens".to_string()))?;
    let types: Vec<i64> = match meta.get("tokenizer.ggml.token_type") {
        None => Vec::new(),
        Some(GgufValue::Array(a)) => a
            .iter()
            .map(|v| match *v {
                GgufValue::I32(x) => Ok(x as i64),
                GgufValue::U32(x) => Ok(x as i64),
                GgufValue::I64(x) => Ok(x),
                GgufValue::U8(x) => Ok(x as i64),
                GgufValue::I8(x) => Ok(x as i64),
                _ => Err(GgufError::WrongKeyType {
                    key: "tokenizer.ggml.token_type".into(),
                    expected: "array of integer",
                    found: format!("array of {}", v.type_name()),
                }),
            })
            .collect::<Result<_, _>>()?,
        Some(v) => {
            return Err(GgufError::WrongKeyType {
                key: "tokenizer.ggml.token_type".into(),
                expected: "array of integer",
                found: v.type_name().into(),
            })
        }
    };
    if !types.is_empty() && types.len() != tokens.len() {
        return Err(GgufError::BadValue {
            key: "tokenizer.ggml.token_type".into(),
            reason: format!("{} types for {} tokens", types.len(), tokens.len()),
        });
    }

    let (tokenizer_json, sentencepiece) = if sentencepiece {
        (String::new(), Some(sentencepiece_vocab(meta, &tokens, &types)?))
    } else {
        let mut vocab = Map::new();
        for (i, t) in tokens.iter().enumerate() {
            vocab.insert((*t).to_string(), Value::from(i as u64));
        }
        let added: Vec<Value> = types
            .iter()
            .enumerate()
            .filter(|(_, &ty)| ty == TOKEN_TYPE_CONTROL as i64 || ty == TOKEN_TYPE_USER_DEFINED as i64)
            .map(|(i, _)| {
                json!({
                    "id": i as u64,
                    "content": tokens[i],
                    "single_word": false,
                    "lstrip": false,
                    "rstrip": false,
                    "normalized": false,
                    "special": true,
                })
            })
            .collect();
        let tok = gpt2_bpe(meta, vocab, added)?;
        (serde_json::to_string(&tok).map_err(|e| GgufError::TokenizerJson(e.to_string()))?, None)
    };
    let bos_token_id = token_id(meta, "tokenizer.ggml.bos_token_id", tokens.len())?;
    let eos = token_id(meta, "tokenizer.ggml.eos_token_id", tokens.len())?;
    let add_bos = bool_key(meta, "tokenizer.ggml.add_bos_token")?.unwrap_or(false);
    let chat_template = get_str(meta, "tokenizer.chat_template")?.map(str::to_string);
    Ok(TokenizerInfo {
        tokenizer_json,
        sentencepiece,
        chat_template,
        bos_token_id,
        eos_token_ids: eos.into_iter().collect(),
        add_bos,
    })
}

/// Byte-level BPE over the GGUF's vocab and `tokenizer.ggml.merges` (GPT-2 style).
fn gpt2_bpe(meta: &BTreeMap<String, GgufValue>, vocab: Map<String, Value>, added: Vec<Value>) -> Result<Value, GgufError> {
    let merges = string_array(meta, "tokenizer.ggml.merges")?.unwrap_or_default();
    let mut merge_list = Vec::with_capacity(merges.len());
    for m in &merges {
        let Some((a, b)) = m.split_once(' ') else {
            return Err(GgufError::BadValue {
                key: "tokenizer.ggml.merges".into(),
                reason: format!("merge {m:?} has no space"),
            });
        };
        merge_list.push(json!([a, b]));
    }
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merge_list,
        },
    }))
}

/// The SentencePiece vocabulary as the GGUF has it, checked as the tokenizer built from it needs
/// ([`sentencepiece::check`]).
fn sentencepiece_vocab(meta: &BTreeMap<String, GgufValue>, tokens: &[&str], types: &[i64]) -> Result<SentencePieceVocab, GgufError> {
    // llama.cpp prepends a space to every text fragment unless the GGUF says false (its default).
    if bool_key(meta, "tokenizer.ggml.add_space_prefix")?.unwrap_or(true) {
        return Err(GgufError::BadValue {
            key: "tokenizer.ggml.add_space_prefix".into(),
            reason: "true (or absent): a space before each text fragment is not supported yet (Gemma's GGUFs say false)".into(),
        });
    }
    if types.is_empty() {
        return Err(GgufError::MissingKey("tokenizer.ggml.token_type".into()));
    }
    // Counts, byte tokens and bounds are `sentencepiece::check`'s, below.
    let scores = f32_array(meta, "tokenizer.ggml.scores")?.ok_or_else(|| GgufError::MissingKey("tokenizer.ggml.scores".into()))?;
    let types = types
        .iter()
        .map(|&ty| {
            i32::try_from(ty).map_err(|_| GgufError::BadValue { key: "tokenizer.ggml.token_type".into(), reason: format!("token type {ty}") })
        })
        .collect::<Result<Vec<i32>, _>>()?;
    let vocab = SentencePieceVocab {
        tokens: tokens.iter().map(|t| t.to_string()).collect(),
        scores,
        types,
        unknown_token_id: token_id(meta, "tokenizer.ggml.unknown_token_id", tokens.len())?,
    };
    sentencepiece::check(&vocab).map_err(|e| GgufError::BadValue {
        key: format!("tokenizer.ggml.{}", if e.field == "types" { "token_type" } else { e.field }),
        reason: e.reason,
    })?;
    Ok(vocab)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> BTreeMap<String, GgufValue> {
        let s = |v: &str| GgufValue::String(v.to_string());
        let mut toks: Vec<String> = Vec::new();
        // All 256 byte-level symbols so any text encodes.
        let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
            .chain(0xA1..=0xAC)
            .chain(0xAE..=0xFF)
            .collect();
        let mut cs = bs.clone();
        let mut n = 0;
        for b in 0..256u32 {
            if !bs.contains(&b) {
                bs.push(b);
                cs.push(256 + n);
                n += 1;
            }
        }
        for c in &cs {
            toks.push(char::from_u32(*c).map(String::from).unwrap_or_default());
        }
        toks.push("he".into());
        toks.push("ll".into());
        toks.push("hell".into());
        toks.push("<|endoftext|>".into());
        let mut types = vec![GgufValue::I32(1); toks.len()];
        let last = types.len() - 1;
        types[last] = GgufValue::I32(3);
        let mut m = BTreeMap::new();
        m.insert("tokenizer.ggml.model".into(), s("gpt2"));
        m.insert(
            "tokenizer.ggml.tokens".into(),
            GgufValue::Array(toks.iter().map(|t| s(t)).collect()),
        );
        m.insert("tokenizer.ggml.token_type".into(), GgufValue::Array(types));
        m.insert(
            "tokenizer.ggml.merges".into(),
            GgufValue::Array(vec![s("h e"), s("l l"), s("he ll")]),
        );
        m.insert("tokenizer.ggml.bos_token_id".into(), GgufValue::U32(last as u32));
        m.insert("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(last as u32));
        m.insert("tokenizer.chat_template".into(), s("{{ messages }}"));
        m
    }

    #[test]
    fn gpt2_tokenizer_loads_and_round_trips() {
        let m = meta();
        let info = tokenizer_from_gguf(&m).expect("tokenizer");
        assert_eq!(info.bos_token_id, Some(259));
        assert_eq!(info.eos_token_ids, vec![259]);
        assert!(!info.add_bos);
        assert_eq!(info.chat_template.as_deref(), Some("{{ messages }}"));
        let tk: tokenizers::Tokenizer = info.tokenizer_json.parse().expect("tokenizer.json loads");
        let text = "hello <|endoftext|> wörld";
        let enc = tk.encode(text, false).expect("encode");
        assert_eq!(enc.get_ids()[0], 258, "hell merged");
        assert!(enc.get_ids().contains(&259), "special token kept whole");
        let dec = tk.decode(enc.get_ids(), false).expect("decode");
        assert_eq!(dec, text);
    }

    /// A SentencePiece vocab: control tokens, the 256 byte tokens, then pieces with scores.
    fn spm_meta() -> BTreeMap<String, GgufValue> {
        let s = |v: &str| GgufValue::String(v.to_string());
        let mut toks: Vec<String> = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "\n"].map(String::from).to_vec();
        let mut types = vec![3, 3, 3, 2, 3, 4];
        let mut scores = vec![-1000.0f32; 6];
        for b in 0..=255u8 {
            toks.push(format!("<0x{b:02X}>"));
            types.push(6);
            scores.push(0.0);
        }
        // Pieces and scores: "hell" outranks "he" + "llo", so "hello" is he|ll -> hell, then + o.
        for (t, sc) in [("▁", -1.0), ("h", -2.0), ("e", -3.0), ("l", -4.0), ("o", -5.0), ("ll", -6.0), ("he", -7.0), ("hell", -8.0), ("llo", -9.0), ("hello", -10.0), ("▁hello", -11.0)] {
            toks.push(t.into());
            types.push(1);
            scores.push(sc);
        }
        let mut m = BTreeMap::new();
        m.insert("tokenizer.ggml.model".into(), s("llama"));
        m.insert("tokenizer.ggml.tokens".into(), GgufValue::Array(toks.iter().map(|t| s(t)).collect()));
        m.insert("tokenizer.ggml.token_type".into(), GgufValue::Array(types.into_iter().map(GgufValue::I32).collect()));
        m.insert("tokenizer.ggml.scores".into(), GgufValue::Array(scores.into_iter().map(GgufValue::F32).collect()));
        m.insert("tokenizer.ggml.bos_token_id".into(), GgufValue::U32(2));
        m.insert("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(1));
        m.insert("tokenizer.ggml.unknown_token_id".into(), GgufValue::U32(3));
        m.insert("tokenizer.ggml.add_bos_token".into(), GgufValue::Bool(true));
        m.insert("tokenizer.ggml.add_space_prefix".into(), GgufValue::Bool(false));
        m
    }

    #[test]
    fn sentencepiece_tokenizer_merges_by_score_and_falls_back_to_bytes() {
        let info = tokenizer_from_gguf(&spm_meta()).expect("tokenizer");
        assert_eq!((info.bos_token_id, info.eos_token_ids.as_slice(), info.add_bos), (Some(2), &[1][..], true));
        assert!(info.tokenizer_json.is_empty(), "the vocabulary is stored, not a tokenizer.json");
        let tk = sentencepiece::build(info.sentencepiece.as_ref().expect("a SentencePiece vocabulary")).expect("builds");
        let id = |t: &str| tk.token_to_id(t).expect(t);
        let text = "hello hello<start_of_turn>hé\nx";
        let enc = tk.encode(text, false).expect("encode");
        let want = [
            id("hello"),
            id("▁hello"),
            4,
            id("h"),
            id("<0xC3>"),
            id("<0xA9>"),
            5,
            id("<0x78>"),
        ];
        assert_eq!(enc.get_ids(), want);
        assert_eq!(tk.decode(enc.get_ids(), false).expect("decode"), text);
    }

    #[test]
    fn sentencepiece_metadata_errors_are_typed() {
        let mut m = spm_meta();
        m.insert("tokenizer.ggml.add_space_prefix".into(), GgufValue::Bool(true));
        assert!(matches!(tokenizer_from_gguf(&m), Err(GgufError::BadValue { key, .. }) if key == "tokenizer.ggml.add_space_prefix"));
        let mut m = spm_meta();
        m.remove("tokenizer.ggml.scores");
        assert!(matches!(tokenizer_from_gguf(&m), Err(GgufError::MissingKey(k)) if k == "tokenizer.ggml.scores"));
        let mut m = spm_meta();
        m.insert("tokenizer.ggml.scores".into(), GgufValue::Array(vec![GgufValue::F32(0.0)]));
        assert!(matches!(tokenizer_from_gguf(&m), Err(GgufError::BadValue { key, reason }) if key == "tokenizer.ggml.scores" && reason == "1 scores for 273 tokens"));
        let mut m = spm_meta();
        m.insert("tokenizer.ggml.scores".into(), GgufValue::Array(vec![GgufValue::U32(0); 273]));
        assert!(matches!(tokenizer_from_gguf(&m), Err(GgufError::WrongKeyType { key, .. }) if key == "tokenizer.ggml.scores"));
        let mut m = spm_meta();
        if let Some(GgufValue::Array(t)) = m.get_mut("tokenizer.ggml.tokens") {
            t[6 + 0x41] = GgufValue::String("A".into());
        }
        assert!(matches!(tokenizer_from_gguf(&m), Err(GgufError::BadValue { reason, .. }) if reason.contains("<0x41>")));
        let mut m = spm_meta();
        if let Some(GgufValue::Array(t)) = m.get_mut("tokenizer.ggml.tokens") {
            t[272] = GgufValue::String("a".repeat(40_000));
        }
        assert!(matches!(tokenizer_from_gguf(&m), Err(GgufError::BadValue { key, reason }) if key == "tokenizer.ggml.tokens" && reason.contains("would hash 16000")), "{:?}", tokenizer_from_gguf(&m).err());
    }

    #[test]
    fn other_models_are_typed_errors() {
        let mut m = meta();
        m.insert("tokenizer.ggml.model".into(), GgufValue::String("bert".into()));
        assert!(matches!(tokenizer_from_gguf(&m), Err(GgufError::UnsupportedTokenizer(s)) if s == "bert"));
        m.remove("tokenizer.ggml.model");
        assert!(matches!(tokenizer_from_gguf(&m), Err(GgufError::MissingKey(_))));
    }
}
