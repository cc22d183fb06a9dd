//! Hugging Face safetensors directory importer: config.json, (sharded) *.safetensors, tokenizer files.
