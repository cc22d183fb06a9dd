//! `thin convert`: source model -> quantization plan -> folded, re-laid-out tensors -> `.thin` archive.
