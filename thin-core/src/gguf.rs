//! GGUF v2/v3 reader: metadata, tensor infos, block dequantization, tokenizer and arch config from metadata.
