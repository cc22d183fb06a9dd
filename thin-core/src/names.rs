//! Name tables: Hugging Face and GGUF tensor names of every role, per family. Data, not code.
//!
//! Patterns use `{L}` for the layer index and `{E}` for the expert index; both match a decimal
//! integer. One matcher ([`match_pattern`]) serves every table, like llama.cpp's `llama-arch.cpp`.

use crate::arch::Family;
use crate::role::Role;
use crate::source::SourceKind;

/// What a source tensor name resolved to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameMatch {
    /// A tensor with a role; `expert` is set for one expert of an unstacked MoE (HF OLMoE).
    Tensor { role: Role, layer: Option<u32>, expert: Option<u32> },
    /// A tensor the engine never reads (rotary `inv_freq` buffers, precomputed rope factors).
    Ignored,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("tensor `{name}` is not a known {family} {kind} tensor name")]
    Unknown { name: String, family: &'static str, kind: &'static str },
    #[error("tensor `{name}`: index `{index}` in the name does not fit in u32")]
    BadIndex { name: String, index: String },
}

type Table = &'static [(&'static str, Role)];

const HF_LLAMA: Table = &[
    ("model.embed_tokens.weight", Role::TokenEmbd),
    ("model.norm.weight", Role::OutputNorm),
    ("lm_head.weight", Role::LmHead),
    ("model.layers.{L}.input_layernorm.weight", Role::AttnNorm),
    ("model.layers.{L}.self_attn.q_proj.weight", Role::AttnQ),
    ("model.layers.{L}.self_attn.k_proj.weight", Role::AttnK),
    ("model.layers.{L}.self_attn.v_proj.weight", Role::AttnV),
    ("model.layers.{L}.self_attn.o_proj.weight", Role::AttnO),
    ("model.layers.{L}.post_attention_layernorm.weight", Role::FfnNorm),
    ("model.layers.{L}.mlp.gate_proj.weight", Role::FfnGate),
    ("model.layers.{L}.mlp.up_proj.weight", Role::FfnUp),
    ("model.layers.{L}.mlp.down_proj.weight", Role::FfnDown),
];

const HF_GEMMA3: Table = &[
    ("model.embed_tokens.weight", Role::TokenEmbd),
    ("model.norm.weight", Role::OutputNorm),
    ("lm_head.weight", Role::LmHead),
    ("model.layers.{L}.input_layernorm.weight", Role::AttnNorm),
    ("model.layers.{L}.self_attn.q_proj.weight", Role::AttnQ),
    ("model.layers.{L}.self_attn.k_proj.weight", Role::AttnK),
    ("model.layers.{L}.self_attn.v_proj.weight", Role::AttnV),
    ("model.layers.{L}.self_attn.o_proj.weight", Role::AttnO),
    ("model.layers.{L}.self_attn.q_norm.weight", Role::AttnQNorm),
    ("model.layers.{L}.self_attn.k_norm.weight", Role::AttnKNorm),
    ("model.layers.{L}.post_attention_layernorm.weight", Role::AttnPostNorm),
    ("model.layers.{L}.pre_feedforward_layernorm.weight", Role::FfnNorm),
    ("model.layers.{L}.post_feedforward_layernorm.weight", Role::FfnPostNorm),
    ("model.layers.{L}.mlp.gate_proj.weight", Role::FfnGate),
    ("model.layers.{L}.mlp.up_proj.weight", Role::FfnUp),
    ("model.layers.{L}.mlp.down_proj.weight", Role::FfnDown),
];

const HF_OLMOE: Table = &[
    ("model.embed_tokens.weight", Role::TokenEmbd),
    ("model.norm.weight", Role::OutputNorm),
    ("lm_head.weight", Role::LmHead),
    ("model.layers.{L}.input_layernorm.weight", Role::AttnNorm),
    ("model.layers.{L}.self_attn.q_proj.weight", Role::AttnQ),
    ("model.layers.{L}.self_attn.k_proj.weight", Role::AttnK),
    ("model.layers.{L}.self_attn.v_proj.weight", Role::AttnV),
    ("model.layers.{L}.self_attn.o_proj.weight", Role::AttnO),
    ("model.layers.{L}.self_attn.q_norm.weight", Role::AttnQNorm),
    ("model.layers.{L}.self_attn.k_norm.weight", Role::AttnKNorm),
    ("model.layers.{L}.post_attention_layernorm.weight", Role::FfnNorm),
    ("model.layers.{L}.mlp.gate.weight", Role::MoeRouter),
    ("model.layers.{L}.mlp.experts.{E}.gate_proj.weight", Role::MoeGate),
    ("model.layers.{L}.mlp.experts.{E}.up_proj.weight", Role::MoeUp),
    ("model.layers.{L}.mlp.experts.{E}.down_proj.weight", Role::MoeDown),
];

/// HF names the engine never reads.
const HF_IGNORED: &[&str] = &["model.layers.{L}.self_attn.rotary_emb.inv_freq"];

/// Multimodal Gemma 3 checkpoints nest the text model; these prefixes map back to the text names.
const HF_PREFIX_ALIASES: &[(&str, &str)] = &[
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
];

/// Prefixes of a multimodal checkpoint's vision side, which a text engine does not read.
const HF_IGNORED_PREFIXES: &[&str] =
    &["vision_tower.", "model.vision_tower.", "multi_modal_projector.", "model.multi_modal_projector."];

const GGUF_LLAMA: Table = &[
    ("token_embd.weight", Role::TokenEmbd),
    ("output_norm.weight", Role::OutputNorm),
    ("output.weight", Role::LmHead),
    ("blk.{L}.attn_norm.weight", Role::AttnNorm),
    ("blk.{L}.attn_q.weight", Role::AttnQ),
    ("blk.{L}.attn_k.weight", Role::AttnK),
    ("blk.{L}.attn_v.weight", Role::AttnV),
    ("blk.{L}.attn_output.weight", Role::AttnO),
    ("blk.{L}.ffn_norm.weight", Role::FfnNorm),
    ("blk.{L}.ffn_gate.weight", Role::FfnGate),
    ("blk.{L}.ffn_up.weight", Role::FfnUp),
    ("blk.{L}.ffn_down.weight", Role::FfnDown),
];

const GGUF_GEMMA3: Table = &[
    ("token_embd.weight", Role::TokenEmbd),
    ("output_norm.weight", Role::OutputNorm),
    ("output.weight", Role::LmHead),
    ("blk.{L}.attn_norm.weight", Role::AttnNorm),
    ("blk.{L}.attn_q.weight", Role::AttnQ),
    ("blk.{L}.attn_k.weight", Role::AttnK),
    ("blk.{L}.attn_v.weight", Role::AttnV),
    ("blk.{L}.attn_output.weight", Role::AttnO),
    ("blk.{L}.attn_q_norm.weight", Role::AttnQNorm),
    ("blk.{L}.attn_k_norm.weight", Role::AttnKNorm),
    ("blk.{L}.post_attention_norm.weight", Role::AttnPostNorm),
    ("blk.{L}.ffn_norm.weight", Role::FfnNorm),
    ("blk.{L}.post_ffw_norm.weight", Role::FfnPostNorm),
    ("blk.{L}.ffn_gate.weight", Role::FfnGate),
    ("blk.{L}.ffn_up.weight", Role::FfnUp),
    ("blk.{L}.ffn_down.weight", Role::FfnDown),
];

const GGUF_OLMOE: Table = &[
    ("token_embd.weight", Role::TokenEmbd),
    ("output_norm.weight", Role::OutputNorm),
    ("output.weight", Role::LmHead),
    ("blk.{L}.attn_norm.weight", Role::AttnNorm),
    ("blk.{L}.attn_q.weight", Role::AttnQ),
    ("blk.{L}.attn_k.weight", Role::AttnK),
    ("blk.{L}.attn_v.weight", Role::AttnV),
    ("blk.{L}.attn_output.weight", Role::AttnO),
    ("blk.{L}.attn_q_norm.weight", Role::AttnQNorm),
    ("blk.{L}.attn_k_norm.weight", Role::AttnKNorm),
    ("blk.{L}.ffn_norm.weight", Role::FfnNorm),
    ("blk.{L}.ffn_gate_inp.weight", Role::MoeRouter),
    ("blk.{L}.ffn_gate_exps.weight", Role::MoeGate),
    ("blk.{L}.ffn_up_exps.weight", Role::MoeUp),
    ("blk.{L}.ffn_down_exps.weight", Role::MoeDown),
];

/// GGUF names the engine never reads: llama.cpp's precomputed Llama 3 rope factors (the manifest
/// records `rope_scaling` instead).
const GGUF_IGNORED: &[&str] = &["rope_freqs.weight"];

/// The roles a complete model of a family must have.
#[derive(Debug, Clone, Copy)]
pub struct FamilyRoles {
    /// Model-level tensors; `LmHead` is required only when embeddings are not tied.
    pub global: &'static [Role],
    pub per_layer: &'static [Role],
}

const LLAMA_LAYER: &[Role] = &[
    Role::AttnNorm,
    Role::AttnQ,
    Role::AttnK,
    Role::AttnV,
    Role::AttnO,
    Role::FfnNorm,
    Role::FfnGate,
    Role::FfnUp,
    Role::FfnDown,
];
const GEMMA3_LAYER: &[Role] = &[
    Role::AttnNorm,
    Role::AttnQ,
    Role::AttnK,
    Role::AttnV,
    Role::AttnO,
    Role::AttnQNorm,
    Role::AttnKNorm,
    Role::AttnPostNorm,
    Role::FfnNorm,
    Role::FfnPostNorm,
    Role::FfnGate,
    Role::FfnUp,
    Role::FfnDown,
];
const OLMOE_LAYER: &[Role] = &[
    Role::AttnNorm,
    Role::AttnQ,
    Role::AttnK,
    Role::AttnV,
    Role::AttnO,
    Role::AttnQNorm,
    Role::AttnKNorm,
    Role::FfnNorm,
    Role::MoeRouter,
    Role::MoeGate,
    Role::MoeUp,
    Role::MoeDown,
];
const GLOBAL: &[Role] = &[Role::TokenEmbd, Role::OutputNorm, Role::LmHead];

pub fn family_roles(family: Family) -> FamilyRoles {
    let per_layer = match family {
        Family::Llama | Family::Smollm3 => LLAMA_LAYER,
        Family::Gemma3 => GEMMA3_LAYER,
        Family::Olmoe => OLMOE_LAYER,
    };
    FamilyRoles { global: GLOBAL, per_layer }
}

/// The name table of one family in one source format.
pub fn table(family: Family, kind: SourceKind) -> Table {
    match (kind, family) {
        (SourceKind::Safetensors, Family::Llama | Family::Smollm3) => HF_LLAMA,
        (SourceKind::Safetensors, Family::Gemma3) => HF_GEMMA3,
        (SourceKind::Safetensors, Family::Olmoe) => HF_OLMOE,
        (SourceKind::Gguf, Family::Llama | Family::Smollm3) => GGUF_LLAMA,
        (SourceKind::Gguf, Family::Gemma3) => GGUF_GEMMA3,
        (SourceKind::Gguf, Family::Olmoe) => GGUF_OLMOE,
    }
}

/// Captured indices of a successful pattern match.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Captures {
    pub layer: Option<u32>,
    pub expert: Option<u32>,
}

/// Match `name` against `pattern` (`{L}` and `{E}` match a decimal integer). `Ok(None)` when it
/// does not match; an error when it matches but an index overflows u32.
pub fn match_pattern(pattern: &str, name: &str) -> Result<Option<Captures>, NameError> {
    let mut caps = Captures::default();
    let mut pat = pattern;
    let mut rest = name;
    loop {
        let next = [("{L}", true), ("{E}", false)]
            .iter()
            .filter_map(|(tok, is_layer)| pat.find(tok).map(|i| (i, *is_layer)))
            .min_by_key(|(i, _)| *i);
        let Some((i, is_layer)) = next else {
            return Ok((pat == rest).then_some(caps));
        };
        let lit = &pat[..i];
        let Some(after) = rest.strip_prefix(lit) else { return Ok(None) };
        let digits = after.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Ok(None);
        }
        let text = &after[..digits];
        // "01" is not a layer index anyone writes; refusing it keeps names one-to-one.
        if digits > 1 && text.starts_with('0') {
            return Ok(None);
        }
        let value: u32 =
            text.parse().map_err(|_| NameError::BadIndex { name: name.to_string(), index: text.to_string() })?;
        if is_layer {
            caps.layer = Some(value);
        } else {
            caps.expert = Some(value);
        }
        pat = &pat[i + 3..];
        rest = &after[digits..];
    }
}

/// Resolve a source tensor name to its role, layer and expert.
pub fn resolve(family: Family, kind: SourceKind, name: &str) -> Result<NameMatch, NameError> {
    let (ignored, canonical): (&[&str], std::borrow::Cow<'_, str>) = match kind {
        SourceKind::Safetensors => {
            if HF_IGNORED_PREFIXES.iter().any(|p| name.starts_with(p)) {
                return Ok(NameMatch::Ignored);
            }
            let aliased =
                HF_PREFIX_ALIASES.iter().find_map(|(from, to)| name.strip_prefix(from).map(|r| format!("{to}{r}")));
            (HF_IGNORED, aliased.map_or(std::borrow::Cow::Borrowed(name), std::borrow::Cow::Owned))
        }
        SourceKind::Gguf => (GGUF_IGNORED, std::borrow::Cow::Borrowed(name)),
    };
    for (pattern, role) in table(family, kind) {
        if let Some(c) = match_pattern(pattern, &canonical)? {
            return Ok(NameMatch::Tensor { role: *role, layer: c.layer, expert: c.expert });
        }
    }
    for pattern in ignored {
        if match_pattern(pattern, &canonical)?.is_some() {
            return Ok(NameMatch::Ignored);
        }
    }
    Err(NameError::Unknown { name: name.to_string(), family: family.name(), kind: kind.name() })
}

#[cfg(test)]
mod tests {
    use super::*;

    const FAMILIES: [Family; 4] = [Family::Llama, Family::Smollm3, Family::Gemma3, Family::Olmoe];
    const KINDS: [SourceKind; 2] = [SourceKind::Safetensors, SourceKind::Gguf];

    fn fill(pattern: &str, l: u32, e: u32) -> String {
        pattern.replace("{L}", &l.to_string()).replace("{E}", &e.to_string())
    }

    #[test]
    fn every_role_of_every_family_resolves() {
        for family in FAMILIES {
            let roles = family_roles(family);
            for kind in KINDS {
                let t = table(family, kind);
                for role in roles.global.iter().chain(roles.per_layer) {
                    let (pattern, _) = t
                        .iter()
                        .find(|(_, r)| r == role)
                        .unwrap_or_else(|| panic!("{family:?} {kind:?} has no name for {role:?}"));
                    let name = fill(pattern, 17, 5);
                    let m = resolve(family, kind, &name).expect("resolves");
                    let NameMatch::Tensor { role: got, layer, expert } = m else { panic!("{name} ignored") };
                    assert_eq!(got, *role, "{name}");
                    assert_eq!(layer, role.is_per_layer().then_some(17), "{name}");
                    let unstacked_expert =
                        kind == SourceKind::Safetensors && matches!(got, Role::MoeGate | Role::MoeUp | Role::MoeDown);
                    assert_eq!(expert, unstacked_expert.then_some(5), "{name}");
                }
                // Nothing in a table is outside the family's role set.
                for (pattern, role) in t {
                    assert!(roles.global.contains(role) || roles.per_layer.contains(role), "{pattern}");
                }
            }
        }
    }

    #[test]
    fn unknown_name_is_an_error_naming_the_tensor() {
        let e = resolve(Family::Llama, SourceKind::Safetensors, "model.layers.0.mlp.experts.0.gate_proj.weight")
            .unwrap_err();
        assert!(e.to_string().contains("model.layers.0.mlp.experts.0.gate_proj.weight"), "{e}");
        assert!(resolve(Family::Gemma3, SourceKind::Gguf, "blk.x.attn_q.weight").is_err());
        assert!(resolve(Family::Llama, SourceKind::Gguf, "blk.1.attn_q.weight.extra").is_err());
        assert!(resolve(Family::Llama, SourceKind::Gguf, "blk.01.attn_q.weight").is_err());
        let big = resolve(Family::Llama, SourceKind::Gguf, "blk.99999999999.attn_q.weight").unwrap_err();
        assert!(matches!(big, NameError::BadIndex { .. }));
    }

    #[test]
    fn ignorable_names() {
        assert_eq!(
            resolve(Family::Llama, SourceKind::Safetensors, "model.layers.3.self_attn.rotary_emb.inv_freq"),
            Ok(NameMatch::Ignored)
        );
        assert_eq!(resolve(Family::Llama, SourceKind::Gguf, "rope_freqs.weight"), Ok(NameMatch::Ignored));
        assert_eq!(
            resolve(
                Family::Gemma3,
                SourceKind::Safetensors,
                "vision_tower.vision_model.embeddings.patch_embedding.weight"
            ),
            Ok(NameMatch::Ignored)
        );
    }

    #[test]
    fn multimodal_gemma_prefixes_map_to_text_names() {
        for name in [
            "language_model.model.layers.2.self_attn.q_norm.weight",
            "model.language_model.layers.2.self_attn.q_norm.weight",
        ] {
            assert_eq!(
                resolve(Family::Gemma3, SourceKind::Safetensors, name),
                Ok(NameMatch::Tensor { role: Role::AttnQNorm, layer: Some(2), expert: None })
            );
        }
    }
}
