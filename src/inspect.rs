//! `thin inspect`: one summary of an archive, as text or as one JSON object.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde_json::{json, Value};
use thin_core::format::Archive;
use thin_core::manifest::Manifest;

fn hex(b: &[u8]) -> String {
    b.iter().fold(String::with_capacity(b.len() * 2), |mut s, x| {
        let _ = write!(s, "{x:02x}");
        s
    })
}

/// (count, bytes) per key.
fn totals<'a>(
    m: &'a Manifest,
    key: impl Fn(&'a thin_core::manifest::TensorEntry) -> &'a str,
) -> BTreeMap<&'a str, (u64, u64)> {
    let mut out: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for t in &m.tensors {
        let e = out.entry(key(t)).or_default();
        e.0 += 1;
        e.1 += t.byte_len;
    }
    out
}

fn method_counts(m: &Manifest) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for p in &m.quantization.plan {
        *out.entry(p.method.name().to_string()).or_default() += 1;
    }
    out
}

/// One row of the plan table: the tensors of one role stored by one method.
struct PlanRow {
    role: &'static str,
    /// Layer ranges (`0-6, 22-29`), or `-` for tensors outside the layers.
    layers: String,
    method: String,
    tensors: u64,
    bytes: u64,
}

/// `0-6, 9, 22-29` from sorted layer indices.
fn ranges(layers: &[u32]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < layers.len() {
        let mut j = i;
        while j + 1 < layers.len() && layers[j + 1] == layers[j] + 1 {
            j += 1;
        }
        out.push(if i == j { layers[i].to_string() } else { format!("{}-{}", layers[i], layers[j]) });
        i = j + 1;
    }
    if out.is_empty() {
        "-".into()
    } else {
        out.join(", ")
    }
}

/// The quantization plan grouped by role and method, in role order.
fn plan_rows(m: &Manifest) -> Vec<PlanRow> {
    let method_of: BTreeMap<&str, &str> = m.quantization.plan.iter().map(|p| (p.name.as_str(), p.method.name())).collect();
    let mut groups: BTreeMap<(thin_core::role::Role, &str), (Vec<u32>, u64, u64)> = BTreeMap::new();
    for t in &m.tensors {
        let method = method_of.get(t.name.as_str()).copied().unwrap_or(t.dtype.name());
        let g = groups.entry((t.role, method)).or_default();
        g.0.extend(t.layer);
        g.1 += 1;
        g.2 += t.byte_len;
    }
    groups
        .into_iter()
        .map(|((role, method), (mut layers, tensors, bytes))| {
            layers.sort_unstable();
            PlanRow { role: role.name(), layers: ranges(&layers), method: method.to_string(), tensors, bytes }
        })
        .collect()
}

/// The archive's tokenizer as opened (model type, vocabulary, added tokens) and what it is stored as.
fn tokenizer_summary(a: &Archive) -> Value {
    let t = &a.manifest().tokenizer;
    let tok = a.tokenizer();
    json!({
        "model": tok.model_type(),
        "vocab": tok.model_vocab_size(),
        "added_tokens": tok.added_token_count(),
        "stored_as": if t.sentencepiece.is_some() { "sentencepiece vocabulary" } else { "tokenizer.json" },
        "tokenizer_json_bytes": t.tokenizer_json.len(),
        "chat_template_bytes": t.chat_template.as_ref().map(String::len),
        "bos_token_id": t.bos_token_id,
        "eos_token_ids": t.eos_token_ids,
        "add_bos": t.add_bos,
    })
}

pub fn to_json(a: &Archive) -> Value {
    let h = a.header();
    let m = a.manifest();
    let q = &m.quantization;
    let roles: BTreeMap<&str, Value> =
        totals(m, |t| t.role.name()).into_iter().map(|(k, (n, b))| (k, json!({"count": n, "bytes": b}))).collect();
    let dtypes: BTreeMap<&str, Value> =
        totals(m, |t| t.dtype.name()).into_iter().map(|(k, (n, b))| (k, json!({"count": n, "bytes": b}))).collect();
    let tensors: Vec<Value> = m
        .tensors
        .iter()
        .map(|t| {
            json!({
                "name": t.name, "role": t.role.name(), "layer": t.layer, "shape": t.shape,
                "dtype": t.dtype.name(), "bytes": t.byte_len, "first_page": t.first_page,
                "page_count": t.page_count, "source_dtype": t.source_dtype.name(),
                "source_name": t.source_name, "exact_storage_preserved": t.exact_storage_preserved,
            })
        })
        .collect();
    let pages: Vec<Value> = a
        .pages()
        .iter()
        .map(|p| json!({"page_id": p.page_id, "flags": p.flags, "offset": p.offset, "stored_size": p.stored_size, "raw_size": p.raw_size}))
        .collect();
    json!({
        "header": {
            "header_len": h.header_len, "version": h.version, "manifest_off": h.manifest_off,
            "manifest_len": h.manifest_len, "page_table_off": h.page_table_off, "page_count": h.page_count,
            "data_off": h.data_off, "archive_hash": hex(&h.archive_hash), "file_len": a.file_len(),
        },
        "arch": m.arch,
        "shape_fingerprint": m.shape_fingerprint,
        "roles": roles,
        "dtypes": dtypes,
        "tokenizer": tokenizer_summary(a),
        "quantization": {
            "method": q.method, "storage_dtype": q.storage_dtype.name(), "bits": q.bits,
            "group_size": q.group_size, "scale_dtype": q.scale_dtype.map(|d| d.name()), "zero_point": q.zero_point,
            "modules_to_not_convert": q.modules_to_not_convert, "source_config": q.source_config,
            "methods": method_counts(m),
            "plan": plan_rows(m).iter().map(|r| json!({"role": r.role, "layers": r.layers, "method": r.method, "tensors": r.tensors, "bytes": r.bytes})).collect::<Vec<_>>(),
            "bytes_per_token": m.weight_bytes_per_token(),
            "exact_storage_preserved": m.tensors.iter().filter(|t| t.exact_storage_preserved).count(),
        },
        "source": m.source,
        "tensors": tensors,
        "pages": pages,
    })
}

pub fn to_text(a: &Archive) -> String {
    let h = a.header();
    let m = a.manifest();
    let c = &m.arch;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "archive   version {}, {} bytes, {} pages, hash {}",
        h.version,
        a.file_len(),
        h.page_count,
        hex(&h.archive_hash)
    );
    let _ = writeln!(
        s,
        "          manifest {}+{}, page table {}, data {}",
        h.manifest_off, h.manifest_len, h.page_table_off, h.data_off
    );
    let _ = writeln!(s, "arch      {} (fingerprint {})", c.dims.family.name(), m.shape_fingerprint);
    let _ = writeln!(
        s,
        "dims      vocab {} hidden {} layers {} heads {} kv_heads {} head_dim {} intermediate {} tied {}",
        c.dims.vocab_size,
        c.dims.hidden_size,
        c.dims.num_layers,
        c.dims.num_heads,
        c.dims.num_kv_heads,
        c.dims.head_dim,
        c.dims.intermediate_size,
        c.dims.tie_word_embeddings
    );
    if let Some(moe) = &c.moe {
        let _ = writeln!(
            s,
            "moe       experts {} top_k {} norm_topk_prob {}",
            c.dims.num_experts, c.dims.top_k, moe.norm_topk_prob
        );
    }
    let _ = write!(s, "rope      theta {}", c.rope.theta);
    if let Some(l) = c.rope.local_theta {
        let _ = write!(s, " local_theta {l}");
    }
    if let Some(sc) = &c.rope.scaling {
        let _ = write!(s, " scaling {} x{}", sc.rope_type, sc.factor);
    }
    if !c.no_rope_layers.is_empty() {
        let _ = write!(s, " no_rope_layers {:?}", c.no_rope_layers);
    }
    let _ = writeln!(s);
    let tok = tokenizer_summary(a);
    let _ = writeln!(s, "tokenizer {tok}");
    let _ = writeln!(s, "roles");
    for (role, (n, b)) in totals(m, |t| t.role.name()) {
        let _ = writeln!(s, "  {role:<16} {n:>5} tensors {b:>14} bytes");
    }
    let _ = writeln!(s, "dtypes");
    for (d, (n, b)) in totals(m, |t| t.dtype.name()) {
        let _ = writeln!(s, "  {d:<16} {n:>5} tensors {b:>14} bytes");
    }
    let q = &m.quantization;
    let _ = writeln!(
        s,
        "quant     profile {} ({} bits {}), methods {:?}, kept out: {}",
        q.method,
        q.bits,
        q.storage_dtype.name(),
        method_counts(m),
        q.modules_to_not_convert.len()
    );
    let _ = writeln!(s, "plan      {:<16} {:<24} {:<16} {:>7} {:>14}", "role", "layers", "method", "tensors", "bytes");
    for r in plan_rows(m) {
        let _ = writeln!(s, "          {:<16} {:<24} {:<16} {:>7} {:>14}", r.role, r.layers, r.method, r.tensors, r.bytes);
    }
    let per_token = m.weight_bytes_per_token();
    let _ = writeln!(s, "          {per_token} weight bytes read per decode token ({:.1} MiB)", per_token as f64 / (1 << 20) as f64);
    s
}
