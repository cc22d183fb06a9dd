//! Tensor-name resolution: Hugging Face and GGUF tensor names to roles. The names themselves are
//! data from the archs/ descriptions (`[tensors]`), exported by thin-codegen into
//! `thin_generated::KNOWN_ARCHS` and passed in here; thin-core cannot depend on the generated crate.
//!
//! Patterns use `{l}` for the layer index and `{e}` for the expert index; both match a decimal
//! integer. One matcher ([`match_pattern`]) serves every table, like llama.cpp's `llama-arch.cpp`.

use crate::arch::Family;
use crate::engine::KnownArch;
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
    #[error("no description in archs/ is of family {family}, so its tensor names are unknown (known: {known})")]
    NoDescription { family: &'static str, known: String },
    #[error("the {family} descriptions {first} and {second} name {what} differently; a family has one name table")]
    Disagree { family: &'static str, first: &'static str, second: &'static str, what: String },
}

/// One role's source-name patterns as a description states them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoleNames {
    pub role: Role,
    pub hf: &'static str,
    pub gguf: &'static str,
}

/// A description's `[tensors]` table, as generated data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorNames {
    /// Every role the family's models have; all are required except `lm_head` with tied embeddings.
    pub roles: &'static [RoleNames],
    /// HF names the engine never reads (rotary `inv_freq` buffers).
    pub hf_ignore: &'static [&'static str],
    /// GGUF names the engine never reads (llama.cpp's precomputed `rope_freqs`).
    pub gguf_ignore: &'static [&'static str],
    /// HF name prefixes never read (a multimodal checkpoint's vision side).
    pub hf_ignore_prefixes: &'static [&'static str],
    /// HF prefix rewrites applied before matching (multimodal Gemma 3 nests the text model).
    pub hf_prefix_aliases: &'static [(&'static str, &'static str)],
}

impl TensorNames {
    /// The first thing on which two tables differ, named for an error message; `None` if equal.
    pub fn difference(&self, other: &TensorNames) -> Option<String> {
        for r in self.roles {
            match other.roles.iter().find(|o| o.role == r.role) {
                None => return Some(format!("role {} (absent from one)", r.role.name())),
                Some(o) if o.hf != r.hf => return Some(format!("role {} (hf `{}` vs `{}`)", r.role.name(), r.hf, o.hf)),
                Some(o) if o.gguf != r.gguf => {
                    return Some(format!("role {} (gguf `{}` vs `{}`)", r.role.name(), r.gguf, o.gguf))
                }
                Some(_) => {}
            }
        }
        if let Some(o) = other.roles.iter().find(|o| !self.roles.iter().any(|r| r.role == o.role)) {
            return Some(format!("role {} (absent from one)", o.role.name()));
        }
        if self.hf_ignore != other.hf_ignore {
            return Some("the ignored hf names".into());
        }
        if self.gguf_ignore != other.gguf_ignore {
            return Some("the ignored gguf names".into());
        }
        if self.hf_ignore_prefixes != other.hf_ignore_prefixes {
            return Some("the ignored hf prefixes".into());
        }
        if self.hf_prefix_aliases != other.hf_prefix_aliases {
            return Some("the hf prefix aliases".into());
        }
        None
    }
}

/// The name table of one family: the `[tensors]` of its descriptions, which must agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NameTable {
    pub family: Family,
    pub names: TensorNames,
}

impl NameTable {
    /// The table of `family` from the descriptions in `known` (`thin_generated::KNOWN_ARCHS`).
    pub fn for_family(known: &[KnownArch], family: Family) -> Result<NameTable, NameError> {
        let mut of_family = known.iter().filter(|k| k.family == family);
        let Some(first) = of_family.next() else {
            return Err(NameError::NoDescription {
                family: family.name(),
                known: known.iter().map(|k| k.name).collect::<Vec<_>>().join(", "),
            });
        };
        for k in of_family {
            if let Some(what) = first.tensors.difference(&k.tensors) {
                return Err(NameError::Disagree { family: family.name(), first: first.name, second: k.name, what });
            }
        }
        Ok(NameTable { family, names: first.tensors })
    }

    /// The role's pattern in one source format.
    pub fn pattern(&self, kind: SourceKind, role: Role) -> Option<&'static str> {
        let r = self.names.roles.iter().find(|r| r.role == role)?;
        Some(match kind {
            SourceKind::Safetensors => r.hf,
            SourceKind::Gguf => r.gguf,
        })
    }

    /// Roles every model of the family has (`lm_head` is listed; it is required only when untied).
    pub fn roles(&self) -> impl Iterator<Item = Role> + '_ {
        self.names.roles.iter().map(|r| r.role)
    }

    /// Resolve a source tensor name to its role, layer and expert.
    pub fn resolve(&self, kind: SourceKind, name: &str) -> Result<NameMatch, NameError> {
        let n = &self.names;
        let (ignored, canonical): (&[&str], std::borrow::Cow<'_, str>) = match kind {
            SourceKind::Safetensors => {
                if n.hf_ignore_prefixes.iter().any(|p| name.starts_with(p)) {
                    return Ok(NameMatch::Ignored);
                }
                let aliased = n
                    .hf_prefix_aliases
                    .iter()
                    .find_map(|(from, to)| name.strip_prefix(from).map(|r| format!("{to}{r}")));
                (n.hf_ignore, aliased.map_or(std::borrow::Cow::Borrowed(name), std::borrow::Cow::Owned))
            }
            SourceKind::Gguf => (n.gguf_ignore, std::borrow::Cow::Borrowed(name)),
        };
        for r in n.roles {
            let pattern = match kind {
                SourceKind::Safetensors => r.hf,
                SourceKind::Gguf => r.gguf,
            };
            if let Some(c) = match_pattern(pattern, &canonical)? {
                return Ok(NameMatch::Tensor { role: r.role, layer: c.layer, expert: c.expert });
            }
        }
        for pattern in ignored {
            if match_pattern(pattern, &canonical)?.is_some() {
                return Ok(NameMatch::Ignored);
            }
        }
        Err(NameError::Unknown { name: name.to_string(), family: self.family.name(), kind: kind.name() })
    }
}

/// Captured indices of a successful pattern match.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Captures {
    pub layer: Option<u32>,
    pub expert: Option<u32>,
}

/// Match `name` against `pattern` (`{l}` and `{e}` match a decimal integer). `Ok(None)` when it
/// does not match; an error when it matches but an index overflows u32.
pub fn match_pattern(pattern: &str, name: &str) -> Result<Option<Captures>, NameError> {
    let mut caps = Captures::default();
    let mut pat = pattern;
    let mut rest = name;
    loop {
        let next = [("{l}", true), ("{e}", false)]
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{KnownArch, MathConstants};

    const MATH: MathConstants = MathConstants {
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_local_theta: None,
        rope_scaling: None,
        no_rope_layers: &[],
        attn_logit_softcap: None,
        final_logit_softcap: None,
        sliding_window: None,
        embedding_scale: 1.0,
        attention_scale: 0.125,
    };

    /// A cut-down description table: enough roles to exercise globals, layers, experts and ignores.
    const NAMES: TensorNames = TensorNames {
        roles: &[
            RoleNames { role: Role::TokenEmbd, hf: "model.embed_tokens.weight", gguf: "token_embd.weight" },
            RoleNames { role: Role::LmHead, hf: "lm_head.weight", gguf: "output.weight" },
            RoleNames {
                role: Role::AttnQ,
                hf: "model.layers.{l}.self_attn.q_proj.weight",
                gguf: "blk.{l}.attn_q.weight",
            },
            RoleNames {
                role: Role::AttnQNorm,
                hf: "model.layers.{l}.self_attn.q_norm.weight",
                gguf: "blk.{l}.attn_q_norm.weight",
            },
            RoleNames {
                role: Role::MoeGate,
                hf: "model.layers.{l}.mlp.experts.{e}.gate_proj.weight",
                gguf: "blk.{l}.ffn_gate_exps.weight",
            },
        ],
        hf_ignore: &["model.layers.{l}.self_attn.rotary_emb.inv_freq"],
        gguf_ignore: &["rope_freqs.weight"],
        hf_ignore_prefixes: &["vision_tower."],
        hf_prefix_aliases: &[("model.language_model.", "model."), ("language_model.model.", "model.")],
    };

    fn known(name: &'static str, family: Family, tensors: TensorNames) -> KnownArch {
        KnownArch { name, family, fingerprint: "", math: MATH, tensors }
    }

    fn table() -> NameTable {
        NameTable::for_family(&[known("a", Family::Olmoe, NAMES)], Family::Olmoe).expect("table")
    }

    #[test]
    fn roles_layers_and_experts_resolve() {
        let t = table();
        let m = |kind, name| t.resolve(kind, name).expect(name);
        use SourceKind::{Gguf, Safetensors as Hf};
        assert_eq!(m(Hf, "lm_head.weight"), NameMatch::Tensor { role: Role::LmHead, layer: None, expert: None });
        assert_eq!(m(Gguf, "output.weight"), NameMatch::Tensor { role: Role::LmHead, layer: None, expert: None });
        assert_eq!(
            m(Hf, "model.layers.17.mlp.experts.5.gate_proj.weight"),
            NameMatch::Tensor { role: Role::MoeGate, layer: Some(17), expert: Some(5) }
        );
        assert_eq!(
            m(Gguf, "blk.17.ffn_gate_exps.weight"),
            NameMatch::Tensor { role: Role::MoeGate, layer: Some(17), expert: None }
        );
        assert_eq!(t.pattern(Gguf, Role::AttnQ), Some("blk.{l}.attn_q.weight"));
        assert_eq!(t.pattern(Hf, Role::FfnUp), None);
        assert_eq!(t.roles().count(), 5);
    }

    #[test]
    fn unknown_name_is_an_error_naming_the_tensor() {
        let t = table();
        let e = t.resolve(SourceKind::Safetensors, "model.layers.0.mlp.gate_proj.weight").unwrap_err();
        assert_eq!(
            e.to_string(),
            "tensor `model.layers.0.mlp.gate_proj.weight` is not a known olmoe safetensors tensor name"
        );
        assert!(t.resolve(SourceKind::Gguf, "blk.x.attn_q.weight").is_err());
        assert!(t.resolve(SourceKind::Gguf, "blk.1.attn_q.weight.extra").is_err());
        assert!(t.resolve(SourceKind::Gguf, "blk.01.attn_q.weight").is_err());
        let big = t.resolve(SourceKind::Gguf, "blk.99999999999.attn_q.weight").unwrap_err();
        assert!(matches!(big, NameError::BadIndex { .. }));
    }

    #[test]
    fn ignorable_names() {
        let t = table();
        assert_eq!(
            t.resolve(SourceKind::Safetensors, "model.layers.3.self_attn.rotary_emb.inv_freq"),
            Ok(NameMatch::Ignored)
        );
        assert_eq!(t.resolve(SourceKind::Gguf, "rope_freqs.weight"), Ok(NameMatch::Ignored));
        assert!(t.resolve(SourceKind::Safetensors, "rope_freqs.weight").is_err(), "ignores are per format");
        assert_eq!(
            t.resolve(SourceKind::Safetensors, "vision_tower.vision_model.embeddings.patch_embedding.weight"),
            Ok(NameMatch::Ignored)
        );
    }

    #[test]
    fn prefix_aliases_map_to_text_names() {
        let t = table();
        for name in ["language_model.model.layers.2.self_attn.q_norm.weight", "model.language_model.layers.2.self_attn.q_norm.weight"] {
            assert_eq!(
                t.resolve(SourceKind::Safetensors, name),
                Ok(NameMatch::Tensor { role: Role::AttnQNorm, layer: Some(2), expert: None })
            );
        }
    }

    #[test]
    fn a_family_has_one_table() {
        let mut other_roles = NAMES.roles.to_vec();
        other_roles[2].gguf = "blk.{l}.attn_query.weight";
        let other = TensorNames { roles: Box::leak(other_roles.into_boxed_slice()), ..NAMES };
        let e = NameTable::for_family(
            &[known("a", Family::Olmoe, NAMES), known("b", Family::Olmoe, other), known("c", Family::Llama, other)],
            Family::Olmoe,
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            e,
            "the olmoe descriptions a and b name role attn_q (gguf `blk.{l}.attn_q.weight` vs `blk.{l}.attn_query.weight`) \
             differently; a family has one name table"
        );
        // Other families' descriptions do not count.
        assert!(NameTable::for_family(&[known("a", Family::Olmoe, NAMES), known("c", Family::Llama, other)], Family::Olmoe).is_ok());
        let fewer = TensorNames { roles: &NAMES.roles[..4], ..NAMES };
        assert_eq!(NAMES.difference(&fewer).as_deref(), Some("role moe_gate (absent from one)"));
        assert_eq!(fewer.difference(&NAMES).as_deref(), Some("role moe_gate (absent from one)"));
        let no_ignore = TensorNames { gguf_ignore: &[], ..NAMES };
        assert_eq!(NAMES.difference(&no_ignore).as_deref(), Some("the ignored gguf names"));

        let e = NameTable::for_family(&[known("c", Family::Llama, NAMES)], Family::Gemma3).unwrap_err().to_string();
        assert!(e.contains("family gemma3") && e.contains("known: c"), "{e}");
    }
}
