//! Name tables: Hugging Face and GGUF tensor names of every role, per family. Data, not code.
