//! Test support (not part of the stable API): a tiny valid model and helpers that rewrite archive
//! bytes while keeping the archive hash consistent, for building hostile archives.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::arch::{ArchConfig, Family, RopeConfig, ShapeDims};
use crate::dtype::{DType, SourceDType};
use crate::manifest::{BackendHints, Manifest, SourceInfo, TensorEntry, TokenizerInfo, Validation, MANIFEST_FORMAT};
use crate::quant::QuantizationDescriptor;
use crate::role::Role;

use super::{ArchiveWriter, FormatError, Header, PageEntry, HEADER_LEN, PAGE_ENTRY_LEN};

/// Tiny Llama-family config: vocab 32, hidden 16, heads 2/1 of dim 8.
pub fn tiny_arch(layers: u64, tied: bool) -> ArchConfig {
    ArchConfig {
        dims: ShapeDims {
            family: Family::Llama,
            vocab_size: 32,
            hidden_size: 16,
            num_layers: layers,
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 8,
            intermediate_size: 32,
            num_experts: 0,
            top_k: 0,
            tie_word_embeddings: tied,
        },
        rms_norm_eps: 1e-5,
        max_position_embeddings: 128,
        rope: RopeConfig { theta: 10000.0, local_theta: None, scaling: None },
        no_rope_layers: vec![],
        layer_attention: vec![],
        sliding_window: None,
        query_pre_attn_scalar: None,
        final_logit_softcap: None,
        attn_logit_softcap: None,
        moe: None,
        hidden_act: "silu".into(),
    }
}

pub fn tiny_manifest(arch: ArchConfig) -> Manifest {
    Manifest {
        format: MANIFEST_FORMAT.to_string(),
        shape_fingerprint: arch.shape_fingerprint(),
        arch,
        tokenizer: TokenizerInfo {
            tokenizer_json: r#"{"version":"1.0","model":{"type":"WordLevel","vocab":{"a":0},"unk_token":"a"}}"#.into(),
            sentencepiece: None,
            chat_template: Some("{{ messages }}".into()),
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
            add_bos: true,
        },
        tensors: vec![],
        quantization: QuantizationDescriptor::from_plan("bf16", vec![], &[], serde_json::Value::Null),
        backend_hints: BackendHints { alignment: 0, max_page_size: 0, layouts: BTreeMap::new() },
        validation: Validation { parameter_count: 0, tensor_count: 0, tensor_blake3: BTreeMap::new() },
        source: SourceInfo { kind: "safetensors".into(), files: vec!["model.safetensors".into()], details: BTreeMap::new() },
    }
}

pub fn entry(role: Role, layer: Option<u32>, shape: Vec<u64>, dtype: DType) -> TensorEntry {
    TensorEntry {
        name: role.tensor_name(layer),
        role,
        layer,
        shape,
        dtype,
        block_size: 1,
        scales: Vec::new(),
        first_page: 0,
        page_count: 0,
        byte_len: 0,
        source_dtype: match dtype {
            DType::F32 => SourceDType::F32,
            _ => SourceDType::Bf16,
        },
        source_name: role.tensor_name(layer),
        exact_storage_preserved: true,
    }
}

/// Deterministic bytes for a tensor: f32 values `seed + i*0.25`, bf16 from the same values.
pub fn tensor_bytes(e: &TensorEntry, seed: f32) -> Vec<u8> {
    let n: u64 = e.shape.iter().product();
    let mut out = Vec::new();
    for i in 0..n {
        let v = seed + i as f32 * 0.25;
        match e.dtype {
            DType::F32 => out.extend_from_slice(&v.to_le_bytes()),
            DType::Bf16 => out.extend_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes()),
            _ => out.push((i & 0xff) as u8),
        }
    }
    out
}

/// The tensors of [`tiny_arch`]: F32 norms, BF16 matrices (embedding F32 so tests can read it).
pub fn tiny_entries(arch: &ArchConfig) -> Vec<TensorEntry> {
    let h = arch.dims.hidden_size;
    let q = arch.dims.num_heads * arch.dims.head_dim;
    let kv = arch.dims.num_kv_heads * arch.dims.head_dim;
    let mut v = vec![entry(Role::TokenEmbd, None, vec![arch.dims.vocab_size, h], DType::F32)];
    for l in 0..arch.dims.num_layers as u32 {
        v.push(entry(Role::AttnNorm, Some(l), vec![h], DType::F32));
        v.push(entry(Role::AttnQ, Some(l), vec![q, h], DType::Bf16));
        v.push(entry(Role::AttnK, Some(l), vec![kv, h], DType::Bf16));
        v.push(entry(Role::AttnV, Some(l), vec![kv, h], DType::Bf16));
        v.push(entry(Role::AttnO, Some(l), vec![h, q], DType::Bf16));
    }
    v.push(entry(Role::OutputNorm, None, vec![h], DType::F32));
    if !arch.dims.tie_word_embeddings {
        v.push(entry(Role::LmHead, None, vec![arch.dims.vocab_size, h], DType::Bf16));
    }
    v
}

/// Writes the tiny model to `path` (optionally with a small max page size).
pub fn write_tiny(path: &Path, layers: u64, tied: bool, max_page: Option<u64>) -> Result<PathBuf, FormatError> {
    let arch = tiny_arch(layers, tied);
    let mut w = ArchiveWriter::create(path)?;
    if let Some(n) = max_page {
        w = w.with_max_page_size(n);
    }
    for (i, e) in tiny_entries(&arch).into_iter().enumerate() {
        let b = tensor_bytes(&e, i as f32);
        w.add_tensor(e, &b)?;
    }
    w.finish(tiny_manifest(arch))
}

/// Decoded sections of archive bytes (no validation beyond the header's fixed fields).
pub struct Parts {
    pub header: Header,
    pub pages: Vec<PageEntry>,
    pub manifest: serde_json::Value,
}

/// Splits archive bytes; panics on malformed input (tests only feed it writer output).
pub fn split(bytes: &[u8]) -> Parts {
    let header = Header::parse(bytes).expect("header");
    let pt = header.page_table_off as usize;
    let pages = (0..header.page_count as usize)
        .map(|i| PageEntry::parse(&bytes[pt + i * PAGE_ENTRY_LEN as usize..]).expect("page"))
        .collect();
    let m = header.manifest_off as usize;
    let manifest = serde_json::from_slice(&bytes[m..m + header.manifest_len as usize]).expect("manifest json");
    Parts { header, pages, manifest }
}

/// Re-assembles archive bytes from the data region of `bytes` and the given (possibly hostile)
/// page table and manifest, with a correct archive hash. Page table goes where it was; the
/// manifest follows it and ends the file.
pub fn rebuild(bytes: &[u8], header: &Header, pages: &[PageEntry], manifest_json: &[u8]) -> Vec<u8> {
    let pt_off = header.page_table_off as usize;
    let mut out = bytes[..pt_off].to_vec();
    let pt = super::encode_page_table(pages);
    out.extend_from_slice(&pt);
    let m_off = out.len() as u64;
    out.extend_from_slice(manifest_json);
    let h = Header {
        page_count: pages.len() as u64,
        manifest_off: m_off,
        manifest_len: manifest_json.len() as u64,
        archive_hash: super::archive_hash(manifest_json, &pt),
        ..header.clone()
    };
    out[..HEADER_LEN as usize].copy_from_slice(&h.to_bytes());
    out
}

/// Rewrites the header of `bytes` in place (no hash recomputation).
pub fn set_header(bytes: &mut [u8], h: &Header) {
    bytes[..HEADER_LEN as usize].copy_from_slice(&h.to_bytes());
}
