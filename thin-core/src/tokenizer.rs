//! Tokenizer wrapper (HF tokenizers) and chat-template rendering (minijinja).
