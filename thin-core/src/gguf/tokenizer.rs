//! Hugging Face `tokenizer.json` from GGUF tokenizer metadata (`tokenizer.ggml.*`).
//!
//! For `tokenizer.ggml.model == "gpt2"` this builds what transformers' `GGUFGPTConverter`
//! (a `GPT2Converter`) builds: byte-level BPE over the GGUF vocab and merges, ByteLevel
//! pre-tokenizer/decoder/post-processor, control (3) and user-defined (4) tokens as special added
//! tokens.

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

use super::{get_str, get_u64, GgufError, GgufValue};
use crate::manifest::TokenizerInfo;

const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

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
    if model != "gpt2" {
        return Err(GgufError::UnsupportedTokenizer(model.to_string()));
    }
    let tokens = string_array(meta, "tokenizer.ggml.tokens")?
        .ok_or_else(|| GgufError::MissingKey("tokenizer.ggml.tokens".to_string()))?;
    let merges = string_array(meta, "tokenizer.ggml.merges")?.unwrap_or_default();
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

    let mut vocab = Map::new();
    for (i, t) in tokens.iter().enumerate() {
        vocab.insert((*t).to_string(), Value::from(i as u64));
    }
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
    let added: Vec<Value> = types
        .iter()
        .enumerate()
        .filter(|(_, &ty)| ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED)
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
    let tok = json!({
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
    });
    let tokenizer_json = serde_json::to_string(&tok).map_err(|e| GgufError::TokenizerJson(e.to_string()))?;
    let bos_token_id = token_id(meta, "tokenizer.ggml.bos_token_id", tokens.len())?;
    let eos = token_id(meta, "tokenizer.ggml.eos_token_id", tokens.len())?;
    let add_bos = match meta.get("tokenizer.ggml.add_bos_token") {
        None => false,
        Some(GgufValue::Bool(b)) => *b,
        Some(v) => {
            return Err(GgufError::WrongKeyType {
                key: "tokenizer.ggml.add_bos_token".into(),
                expected: "bool",
                found: v.type_name().into(),
            })
        }
    };
    let chat_template = get_str(meta, "tokenizer.chat_template")?.map(str::to_string);
    Ok(TokenizerInfo {
        tokenizer_json,
        chat_template,
        bos_token_id,
        eos_token_ids: eos.into_iter().collect(),
        add_bos,
    })
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

    #[test]
    fn other_models_are_typed_errors() {
        let mut m = meta();
        m.insert("tokenizer.ggml.model".into(), GgufValue::String("llama".into()));
        assert!(matches!(tokenizer_from_gguf(&m), Err(GgufError::UnsupportedTokenizer(s)) if s == "llama"));
        m.remove("tokenizer.ggml.model");
        assert!(matches!(tokenizer_from_gguf(&m), Err(GgufError::MissingKey(_))));
    }
}
