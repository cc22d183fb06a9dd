//! Quantization: profiles (data: `profiles/*.toml`, or a user's own file), the precision ladder,
//! and the role-aware plan that picks a storage method for every tensor.
//!
//! A profile is a list of rules. A rule names roles (`"ffn_gate"`, ..., or `"*"`), optionally a
//! layer range, and a method; the first rule that matches a tensor decides its method. Norm
//! vectors are always f32 (tiny, and Gemma's `1 + w` folding needs the precision): no rule may
//! name them. Layer ranges are resolved against the model's layer count:
//!
//! | range | layers of an `L`-layer model |
//! |---|---|
//! | `all` | every layer (the default) |
//! | `first`, `last` | `0`, `L - 1` |
//! | `edges` | `0` and `L - 1` |
//! | `middle` | `1/4..3/4`: `floor(L/4) .. floor(3L/4)` |
//! | `a..b` | `a` inclusive to `b` exclusive; each end an index, a negative index from the end (`-2..`), or a fraction `p/q` of `L` (floored); an empty end is `0` or `L` |
//!
//! A rule with a layer range matches only per-layer tensors; one without matches every tensor of
//! its roles. Methods: `f32`, `bf16`, `q8_0`, `fp8` (e4m3, one f32 scale per row), `q4_1`,
//! `mxfp4-postscale` (MXFP4 with a bf16 row postscale), `mxfp4`, and `keep` (the source's own
//! bytes where a kernel reads them: GGUF Q8_0/Q4_1 blocks, f32, bf16; anything else bf16).

use std::path::Path;

use serde::{Deserialize, Deserializer, Serialize};

use crate::dtype::{DType, SourceDType};
use crate::role::Role;
use crate::weight_format::ScaleType;

/// The storage method one tensor gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum QuantMethod {
    #[serde(rename = "f32")]
    F32,
    #[serde(rename = "bf16")]
    Bf16,
    /// GGUF Q8_0 blocks (ggml's layout and rounding).
    #[serde(rename = "q8_0")]
    Q8_0,
    /// FP8 e4m3 with one f32 scale per output row.
    #[serde(rename = "fp8")]
    Fp8RowScale,
    /// GGUF Q4_1 blocks (ggml's layout and rounding).
    #[serde(rename = "q4_1")]
    Q4_1,
    /// MXFP4 (e2m1 values, e8m0 exponent per 32) with a bf16 row postscale.
    #[serde(rename = "mxfp4-postscale")]
    Mxfp4RowScale,
    /// MXFP4 without a postscale.
    #[serde(rename = "mxfp4")]
    Mxfp4,
}

impl QuantMethod {
    pub const ALL: [QuantMethod; 7] = [
        QuantMethod::F32,
        QuantMethod::Bf16,
        QuantMethod::Q8_0,
        QuantMethod::Fp8RowScale,
        QuantMethod::Q4_1,
        QuantMethod::Mxfp4RowScale,
        QuantMethod::Mxfp4,
    ];

    pub fn name(self) -> &'static str {
        match self {
            QuantMethod::F32 => "f32",
            QuantMethod::Bf16 => "bf16",
            QuantMethod::Q8_0 => "q8_0",
            QuantMethod::Fp8RowScale => "fp8",
            QuantMethod::Q4_1 => "q4_1",
            QuantMethod::Mxfp4RowScale => "mxfp4-postscale",
            QuantMethod::Mxfp4 => "mxfp4",
        }
    }

    pub fn parse(s: &str) -> Option<QuantMethod> {
        QuantMethod::ALL.into_iter().find(|m| m.name() == s)
    }

    pub fn storage_dtype(self) -> DType {
        match self {
            QuantMethod::F32 => DType::F32,
            QuantMethod::Bf16 => DType::Bf16,
            QuantMethod::Q8_0 => DType::Q8_0,
            QuantMethod::Fp8RowScale => DType::F8E4m3,
            QuantMethod::Q4_1 => DType::Q4_1,
            QuantMethod::Mxfp4RowScale | QuantMethod::Mxfp4 => DType::Mxfp4,
        }
    }

    /// Whether the stored tensor carries an MXFP4 row postscale.
    pub fn postscale(self) -> bool {
        self == QuantMethod::Mxfp4RowScale
    }

    /// Bits per value of a `[rows, cols]` matrix, scales included, for long rows: f32 32,
    /// bf16 16, q8_0 8.5, fp8 8 (+ 32 per row), q4_1 5, mxfp4 4.25 (+ 16 per row with postscale).
    pub fn bits_per_value(self) -> f64 {
        match self {
            QuantMethod::F32 => 32.0,
            QuantMethod::Bf16 => 16.0,
            QuantMethod::Q8_0 => 8.5,
            QuantMethod::Fp8RowScale => 8.0,
            QuantMethod::Q4_1 => 5.0,
            QuantMethod::Mxfp4RowScale | QuantMethod::Mxfp4 => 4.25,
        }
    }

    /// Values per scale block along a row, where blocks are fixed (MXFP4 and GGUF blocks).
    fn block(self) -> Option<u64> {
        match self {
            QuantMethod::Q8_0 | QuantMethod::Q4_1 | QuantMethod::Mxfp4RowScale | QuantMethod::Mxfp4 => Some(32),
            QuantMethod::F32 | QuantMethod::Bf16 | QuantMethod::Fp8RowScale => None,
        }
    }
}

/// How a method stands on the precision ladder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// The source's values unchanged.
    Exact,
    /// Rounding well below what changes a token: every profile may use it.
    Safe,
    /// Measurable but small loss: worth it on the roles that tolerate it; chosen on purpose.
    OptIn,
    /// Clear loss; only on roles shown to tolerate it (see `thin eval`).
    Lossy,
}

/// One rung of the ladder.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Rung {
    pub method: QuantMethod,
    pub tier: Tier,
    pub note: &'static str,
}

/// Methods from most to least faithful.
pub fn precision_ladder() -> &'static [Rung] {
    const LADDER: [Rung; 7] = [
        Rung { method: QuantMethod::F32, tier: Tier::Exact, note: "the source's values" },
        Rung { method: QuantMethod::Bf16, tier: Tier::Safe, note: "8-bit mantissa rounding, the reference of every eval" },
        Rung { method: QuantMethod::Q8_0, tier: Tier::Safe, note: "int8 with an f16 scale per 32 values" },
        Rung { method: QuantMethod::Fp8RowScale, tier: Tier::OptIn, note: "e4m3 with an f32 scale per row" },
        Rung { method: QuantMethod::Q4_1, tier: Tier::Lossy, note: "4-bit with an f16 scale and minimum per 32 values" },
        Rung { method: QuantMethod::Mxfp4RowScale, tier: Tier::Lossy, note: "e2m1 with an e8m0 exponent per 32 and a bf16 scale per row" },
        Rung { method: QuantMethod::Mxfp4, tier: Tier::Lossy, note: "e2m1 with an e8m0 exponent per 32" },
    ];
    &LADDER
}

/// What a rule asks for: a method, or the source's own storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleMethod {
    Store(QuantMethod),
    Keep,
}

impl RuleMethod {
    pub fn name(self) -> &'static str {
        match self {
            RuleMethod::Store(m) => m.name(),
            RuleMethod::Keep => "keep",
        }
    }
}

impl<'de> Deserialize<'de> for RuleMethod {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s == "keep" {
            return Ok(RuleMethod::Keep);
        }
        QuantMethod::parse(&s).map(RuleMethod::Store).ok_or_else(|| {
            let names: Vec<&str> = QuantMethod::ALL.iter().map(|m| m.name()).chain(["keep"]).collect();
            serde::de::Error::custom(format!("unknown method `{s}` (one of {})", names.join(", ")))
        })
    }
}

/// One end of a layer range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Index(i64),
    Fraction(u64, u64),
}

impl End {
    fn parse(s: &str) -> Option<End> {
        match s.split_once('/') {
            Some((p, q)) => {
                let (p, q) = (p.trim().parse::<u64>().ok()?, q.trim().parse::<u64>().ok()?);
                (q > 0 && p <= q).then_some(End::Fraction(p, q))
            }
            None => s.trim().parse::<i64>().ok().map(End::Index),
        }
    }

    fn resolve(self, layers: u64) -> u64 {
        match self {
            End::Index(i) if i < 0 => layers.saturating_sub(i.unsigned_abs()),
            End::Index(i) => (i as u64).min(layers),
            End::Fraction(p, q) => ((layers as u128 * p as u128) / q as u128) as u64,
        }
    }
}

/// A rule's layers, before the layer count is known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerRange {
    text: String,
    spans: Vec<(End, Option<End>)>,
}

impl LayerRange {
    pub fn parse(s: &str) -> Result<LayerRange, String> {
        let span = |a: &str, b: &str| -> Result<(End, Option<End>), String> {
            let a = if a.trim().is_empty() { End::Index(0) } else { End::parse(a).ok_or_else(|| format!("bad range start `{a}`"))? };
            let b = if b.trim().is_empty() { None } else { Some(End::parse(b).ok_or_else(|| format!("bad range end `{b}`"))?) };
            Ok((a, b))
        };
        let spans = match s.trim() {
            "all" => vec![(End::Index(0), None)],
            "first" => vec![(End::Index(0), Some(End::Index(1)))],
            "last" => vec![(End::Index(-1), None)],
            "edges" => vec![(End::Index(0), Some(End::Index(1))), (End::Index(-1), None)],
            "middle" => vec![(End::Fraction(1, 4), Some(End::Fraction(3, 4)))],
            t => match t.split_once("..") {
                Some((a, b)) => vec![span(a, b)?],
                None => return Err(format!("layers `{t}`: expected all, first, last, edges, middle or a..b")),
            },
        };
        Ok(LayerRange { text: s.trim().to_string(), spans })
    }

    /// The half-open spans this range covers in a model of `layers` layers.
    pub fn resolve(&self, layers: u64) -> Vec<(u64, u64)> {
        self.spans.iter().map(|&(a, b)| (a.resolve(layers), b.map_or(layers, |b| b.resolve(layers)))).filter(|(a, b)| a < b).collect()
    }

    fn contains(&self, layers: u64, l: u64) -> bool {
        self.resolve(layers).iter().any(|&(a, b)| (a..b).contains(&l))
    }

    fn describe(&self, layers: u64) -> String {
        let spans: Vec<String> = self.resolve(layers).iter().map(|(a, b)| format!("{a}..{b}")).collect();
        let spans = if spans.is_empty() { "none".to_string() } else { spans.join(", ") };
        format!("layers {} = {spans} of {layers}", self.text)
    }
}

impl<'de> Deserialize<'de> for LayerRange {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        LayerRange::parse(&String::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

/// Which roles a rule names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Roles {
    Any,
    These(Vec<Role>),
}

impl<'de> Deserialize<'de> for Roles {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let names = Vec::<String>::deserialize(d)?;
        if names.iter().any(|n| n == "*") {
            return if names.len() == 1 { Ok(Roles::Any) } else { Err(serde::de::Error::custom("`*` stands alone in roles")) };
        }
        if names.is_empty() {
            return Err(serde::de::Error::custom("roles is empty"));
        }
        let roles = names
            .iter()
            .map(|n| Role::from_name(n).ok_or_else(|| serde::de::Error::custom(format!("unknown role `{n}`"))))
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(r) = roles.iter().find(|r| r.is_norm()) {
            return Err(serde::de::Error::custom(format!("role `{}` is a norm vector: norms are always f32", r.name())));
        }
        Ok(Roles::These(roles))
    }
}

/// One rule of a profile.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    pub roles: Roles,
    #[serde(default)]
    pub layers: Option<LayerRange>,
    pub method: RuleMethod,
}

impl Rule {
    fn matches(&self, role: Role, layer: Option<u32>, layers: u64) -> bool {
        let role_ok = match &self.roles {
            Roles::Any => true,
            Roles::These(r) => r.contains(&role),
        };
        role_ok
            && match (&self.layers, layer) {
                (None, _) => true,
                (Some(range), Some(l)) => range.contains(layers, l as u64),
                (Some(_), None) => false,
            }
    }

    fn describe(&self, profile: &str, index: usize, layers: u64) -> String {
        let roles = match &self.roles {
            Roles::Any => "*".to_string(),
            Roles::These(r) => r.iter().map(|r| r.name()).collect::<Vec<_>>().join(", "),
        };
        let at = self.layers.as_ref().map_or(String::new(), |l| format!(", {}", l.describe(layers)));
        format!("{profile} rule {} ({roles}{at}: {})", index + 1, self.method.name())
    }
}

/// A conversion profile (`--profile`): rules, first match wins.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// The shipped name, or the file stem of a user's profile.
    #[serde(skip)]
    pub name: String,
    pub description: String,
    #[serde(rename = "rule")]
    pub rules: Vec<Rule>,
}

/// The profiles shipped in `profiles/`, by name.
pub const SHIPPED: [(&str, &str); 6] = [
    ("bf16", include_str!("../../profiles/bf16.toml")),
    ("f32", include_str!("../../profiles/f32.toml")),
    ("bf16-f32edges", include_str!("../../profiles/bf16-f32edges.toml")),
    ("fp8", include_str!("../../profiles/fp8.toml")),
    ("mxfp4", include_str!("../../profiles/mxfp4.toml")),
    ("native", include_str!("../../profiles/native.toml")),
];

#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    #[error("profile {name}: {reason}")]
    Profile { name: String, reason: String },
    #[error("no shipped profile `{name}` ({}) and no file of that name", SHIPPED.iter().map(|s| s.0).collect::<Vec<_>>().join(", "))]
    UnknownProfile { name: String },
    #[error("{tensor}: {rule} asks to requantize its {stored} blocks to {method}; that rounds values that were already rounded (pass --allow-requantize to do it anyway, or use `keep` or bf16)")]
    Requantize { tensor: String, rule: String, stored: &'static str, method: &'static str },
    #[error("{tensor}: {rule} asks for {method}, but its rows of {cols} values are not whole blocks of 32")]
    PartialBlock { tensor: String, rule: String, method: &'static str, cols: u64 },
    #[error("{tensor}: no rule of profile {profile} matches it (end a profile with a rule for roles = [\"*\"])")]
    NoRule { tensor: String, profile: String },
}

impl Profile {
    /// Parses a profile's TOML text.
    pub fn parse(name: &str, text: &str) -> Result<Profile, QuantError> {
        let mut p: Profile = toml::from_str(text).map_err(|e| QuantError::Profile { name: name.to_string(), reason: e.message().to_string() })?;
        if p.rules.is_empty() {
            return Err(QuantError::Profile { name: name.to_string(), reason: "no [[rule]]".into() });
        }
        p.name = name.to_string();
        Ok(p)
    }

    /// A shipped profile by name.
    pub fn shipped(name: &str) -> Option<Profile> {
        SHIPPED.iter().find(|s| s.0 == name).map(|s| Profile::parse(s.0, s.1).expect("shipped profiles parse (tested)"))
    }

    /// `--profile NAME|PATH`: a shipped name, else a TOML file (read at most 1 MiB).
    pub fn load(arg: &str) -> Result<Profile, QuantError> {
        if let Some(p) = Profile::shipped(arg) {
            return Ok(p);
        }
        let path = Path::new(arg);
        let meta = std::fs::metadata(path).map_err(|_| QuantError::UnknownProfile { name: arg.to_string() })?;
        if !meta.is_file() || meta.len() > 1 << 20 {
            return Err(QuantError::Profile { name: arg.to_string(), reason: "not a file of at most 1 MiB".into() });
        }
        let text = std::fs::read_to_string(path).map_err(|e| QuantError::Profile { name: arg.to_string(), reason: e.to_string() })?;
        let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or(arg);
        Profile::parse(stem, &text)
    }
}

/// One tensor's entry in the plan, with the rule that chose its method.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedTensor {
    pub name: String,
    pub method: QuantMethod,
    /// The rule that chose the method, resolved (`fp8 rule 2 (ffn_down, layers middle = 7..22 of 30: fp8)`),
    /// and what happened to the source's storage where that is not plain.
    #[serde(alias = "reason")]
    pub rule: String,
}

/// What the planner needs to know about one tensor.
#[derive(Debug, Clone)]
pub struct PlanInput<'a> {
    pub name: &'a str,
    pub role: Role,
    pub layer: Option<u32>,
    pub source_dtype: SourceDType,
    /// Values per row (the last dimension).
    pub cols: u64,
}

/// The rule for norm vectors, which no profile overrides.
pub const NORM_RULE: &str = "norm vectors are always f32";

/// Assigns a method to every tensor of a `num_layers`-layer model from `profile`'s rules.
pub fn plan_quantization(profile: &Profile, num_layers: u64, tensors: &[PlanInput<'_>], allow_requantize: bool) -> Result<Vec<PlannedTensor>, QuantError> {
    tensors
        .iter()
        .map(|t| {
            if t.role.is_norm() {
                return Ok(PlannedTensor { name: t.name.to_string(), method: QuantMethod::F32, rule: NORM_RULE.to_string() });
            }
            let (i, rule) = profile
                .rules
                .iter()
                .enumerate()
                .find(|(_, r)| r.matches(t.role, t.layer, num_layers))
                .ok_or_else(|| QuantError::NoRule { tensor: t.name.to_string(), profile: profile.name.clone() })?;
            let label = rule.describe(&profile.name, i, num_layers);
            let src = t.source_dtype;
            let (method, label) = match rule.method {
                RuleMethod::Keep => match src {
                    SourceDType::F32 => (QuantMethod::F32, label),
                    SourceDType::Bf16 => (QuantMethod::Bf16, label),
                    SourceDType::Q8_0 => (QuantMethod::Q8_0, format!("{label}; Q8_0 blocks kept as stored")),
                    SourceDType::Q4_1 => (QuantMethod::Q4_1, format!("{label}; Q4_1 blocks kept as stored")),
                    other => (QuantMethod::Bf16, format!("{label}; {} has no kernel here: stored as bf16", other.name())),
                },
                RuleMethod::Store(m) => {
                    let requantizes = src.is_block_quantized() && !matches!(m, QuantMethod::F32 | QuantMethod::Bf16);
                    let same_blocks = matches!((src, m), (SourceDType::Q8_0, QuantMethod::Q8_0) | (SourceDType::Q4_1, QuantMethod::Q4_1));
                    if requantizes && !same_blocks && !allow_requantize {
                        return Err(QuantError::Requantize { tensor: t.name.to_string(), rule: label, stored: src.name(), method: m.name() });
                    }
                    let label = match () {
                        _ if same_blocks => format!("{label}; {} blocks kept as stored", src.name()),
                        _ if requantizes => format!("{label}; {} blocks requantized (--allow-requantize)", src.name()),
                        _ if src.is_block_quantized() => format!("{label}; {} blocks dequantized", src.name()),
                        _ => label,
                    };
                    (m, label)
                }
            };
            if let Some(b) = method.block() {
                if t.cols % b != 0 {
                    return Err(QuantError::PartialBlock { tensor: t.name.to_string(), rule: label, method: method.name(), cols: t.cols });
                }
            }
            Ok(PlannedTensor { name: t.name.to_string(), method, rule: label })
        })
        .collect()
}

/// The quantization metadata recorded in a manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuantizationDescriptor {
    /// Profile name (`bf16`, `fp8`, or a user file's stem).
    pub method: String,
    /// Storage type of most of the weights' values.
    pub storage_dtype: DType,
    /// Bits per value of that storage.
    pub bits: u32,
    /// Values per scale block of that storage, where it has blocks.
    pub group_size: Option<u64>,
    /// Scale type of that storage, where its scales are a section of their own.
    pub scale_dtype: Option<ScaleType>,
    pub zero_point: bool,
    /// Tensors stored otherwise than the dominant storage.
    pub modules_to_not_convert: Vec<String>,
    /// The source's own quantization: GGUF file type and tensor types, or HF `quantization_config`.
    pub source_config: serde_json::Value,
    pub plan: Vec<PlannedTensor>,
}

impl QuantizationDescriptor {
    /// The descriptor of `plan`; `values[i]` is the value count of `plan[i]`'s tensor.
    pub fn from_plan(profile: &str, plan: Vec<PlannedTensor>, values: &[u64], source_config: serde_json::Value) -> Self {
        let mut by_method: Vec<(QuantMethod, u64)> = Vec::new();
        for (p, &n) in plan.iter().zip(values) {
            match by_method.iter_mut().find(|(m, _)| *m == p.method) {
                Some((_, total)) => *total += n,
                None => by_method.push((p.method, n)),
            }
        }
        let main = by_method.iter().max_by_key(|(_, n)| *n).map_or(QuantMethod::Bf16, |(m, _)| *m);
        let modules_to_not_convert = plan.iter().filter(|p| p.method != main).map(|p| p.name.clone()).collect();
        let (scale_dtype, zero_point) = match main {
            QuantMethod::Fp8RowScale => (Some(ScaleType::F32), false),
            QuantMethod::Mxfp4 | QuantMethod::Mxfp4RowScale => (Some(ScaleType::E8m0), false),
            QuantMethod::Q4_1 => (None, true),
            QuantMethod::F32 | QuantMethod::Bf16 | QuantMethod::Q8_0 => (None, false),
        };
        QuantizationDescriptor {
            method: profile.to_string(),
            storage_dtype: main.storage_dtype(),
            bits: main.bits_per_value().floor() as u32,
            group_size: main.block(),
            scale_dtype,
            zero_point,
            modules_to_not_convert,
            source_config,
            plan,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(name: &'static str, role: Role, layer: Option<u32>, src: SourceDType) -> PlanInput<'static> {
        PlanInput { name, role, layer, source_dtype: src, cols: 64 }
    }

    fn methods(p: &Profile, layers: u64, inputs: &[PlanInput<'_>]) -> Vec<QuantMethod> {
        plan_quantization(p, layers, inputs, false).unwrap().iter().map(|p| p.method).collect()
    }

    #[test]
    fn every_shipped_profile_parses_and_ends_with_a_catch_all() {
        for (name, _) in SHIPPED {
            let p = Profile::shipped(name).unwrap();
            assert_eq!(p.name, name);
            let last = p.rules.last().unwrap();
            assert!(last.roles == Roles::Any && last.layers.is_none(), "{name}: last rule is not a catch-all");
        }
    }

    #[test]
    fn ladder_runs_from_exact_to_lossy_by_bits() {
        let l = precision_ladder();
        assert_eq!(l.len(), QuantMethod::ALL.len());
        assert_eq!((l[0].method, l[0].tier), (QuantMethod::F32, Tier::Exact));
        assert!(l.windows(2).all(|w| w[0].method.bits_per_value() >= w[1].method.bits_per_value()));
        let tiers: Vec<Tier> = l.iter().map(|r| r.tier).collect();
        assert!(tiers.windows(2).all(|w| w[0] as u8 <= w[1] as u8), "{tiers:?}");
    }

    #[test]
    fn layer_ranges_resolve_against_the_layer_count() {
        let r = |s: &str, l: u64| LayerRange::parse(s).unwrap().resolve(l);
        assert_eq!(r("all", 30), vec![(0, 30)]);
        assert_eq!(r("middle", 30), vec![(7, 22)]);
        assert_eq!(r("middle", 36), vec![(9, 27)]);
        assert_eq!(r("edges", 30), vec![(0, 1), (29, 30)]);
        assert_eq!(r("0..2/3", 36), vec![(0, 24)]);
        assert_eq!(r("-2..", 30), vec![(28, 30)]);
        assert_eq!(r("..3", 30), vec![(0, 3)]);
        assert_eq!(r("5..100", 30), vec![(5, 30)]);
        assert_eq!(r("20..10", 30), vec![]);
        for bad in ["", "x", "1..y", "1/0..", "3/2..", "1-3"] {
            assert!(LayerRange::parse(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn norms_are_f32_whatever_the_profile_and_no_rule_may_name_them() {
        let inputs = [input("blk.0.attn_norm", Role::AttnNorm, Some(0), SourceDType::F32), input("blk.0.attn_q", Role::AttnQ, Some(0), SourceDType::Bf16)];
        let p = Profile::shipped("bf16").unwrap();
        let plan = plan_quantization(&p, 1, &inputs, false).unwrap();
        assert_eq!((plan[0].method, plan[0].rule.as_str()), (QuantMethod::F32, NORM_RULE));
        assert_eq!(plan[1].method, QuantMethod::Bf16);
        assert_eq!(plan[1].rule, "bf16 rule 1 (*: bf16)");
        let e = Profile::parse("mine", "description = \"x\"\n[[rule]]\nroles = [\"attn_norm\"]\nmethod = \"fp8\"\n").unwrap_err();
        assert!(e.to_string().contains("norm vector"), "{e}");
    }

    #[test]
    fn fp8_profile_quantizes_gate_up_of_the_first_two_thirds_and_down_in_the_middle() {
        let p = Profile::shipped("fp8").unwrap();
        let inputs = [
            input("token_embd", Role::TokenEmbd, None, SourceDType::Bf16),
            input("blk.0.ffn_gate", Role::FfnGate, Some(0), SourceDType::Bf16),
            input("blk.0.ffn_down", Role::FfnDown, Some(0), SourceDType::Bf16),
            input("blk.15.ffn_down", Role::FfnDown, Some(15), SourceDType::Bf16),
            input("blk.15.attn_o", Role::AttnO, Some(15), SourceDType::Bf16),
            input("blk.19.ffn_up", Role::FfnUp, Some(19), SourceDType::Bf16),
            input("blk.20.ffn_up", Role::FfnUp, Some(20), SourceDType::Bf16),
        ];
        use QuantMethod::*;
        assert_eq!(methods(&p, 30, &inputs), [Bf16, Fp8RowScale, Bf16, Fp8RowScale, Bf16, Fp8RowScale, Bf16]);
        let plan = plan_quantization(&p, 30, &inputs, false).unwrap();
        assert!(plan[3].rule.contains("layers middle = 7..22 of 30"), "{}", plan[3].rule);
    }

    #[test]
    fn mxfp4_profile_and_native_profile() {
        use QuantMethod::*;
        let p = Profile::shipped("mxfp4").unwrap();
        let inputs = [
            input("token_embd", Role::TokenEmbd, None, SourceDType::Bf16),
            input("blk.0.ffn_up", Role::FfnUp, Some(0), SourceDType::Bf16),
            input("blk.29.ffn_up", Role::FfnUp, Some(29), SourceDType::Bf16),
            input("blk.0.attn_q", Role::AttnQ, Some(0), SourceDType::Bf16),
        ];
        assert_eq!(methods(&p, 30, &inputs), [Fp8RowScale, Mxfp4RowScale, Bf16, Bf16]);
        let n = Profile::shipped("native").unwrap();
        let gguf = [
            input("token_embd", Role::TokenEmbd, None, SourceDType::Q8_0),
            input("blk.0.ffn_up", Role::FfnUp, Some(0), SourceDType::Q4_1),
            input("blk.0.attn_q", Role::AttnQ, Some(0), SourceDType::Q6K),
            input("blk.0.attn_k", Role::AttnK, Some(0), SourceDType::F16),
            input("blk.0.attn_v", Role::AttnV, Some(0), SourceDType::Q5_0),
        ];
        let plan = plan_quantization(&n, 30, &gguf, false).unwrap();
        assert_eq!(plan.iter().map(|p| p.method).collect::<Vec<_>>(), [Q8_0, Q4_1, Bf16, Bf16, Bf16]);
        assert!(plan[4].rule.ends_with("Q5_0 has no kernel here: stored as bf16"), "{}", plan[4].rule);
        assert!(plan[1].rule.ends_with("Q4_1 blocks kept as stored"), "{}", plan[1].rule);
        assert!(plan[2].rule.ends_with("Q6_K has no kernel here: stored as bf16"), "{}", plan[2].rule);
    }

    #[test]
    fn requantizing_blocks_needs_the_flag() {
        let p = Profile::shipped("fp8").unwrap();
        let inputs = [input("blk.0.ffn_gate", Role::FfnGate, Some(0), SourceDType::Q4_1)];
        let e = plan_quantization(&p, 30, &inputs, false).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, QuantError::Requantize { .. }));
        assert!(msg.contains("blk.0.ffn_gate") && msg.contains("fp8 rule 1") && msg.contains("Q4_1") && msg.contains("--allow-requantize"), "{msg}");
        let plan = plan_quantization(&p, 30, &inputs, true).unwrap();
        assert_eq!(plan[0].method, QuantMethod::Fp8RowScale);
        assert!(plan[0].rule.ends_with("Q4_1 blocks requantized (--allow-requantize)"));
        // Dequantizing to bf16 is not requantizing.
        let b = Profile::shipped("bf16").unwrap();
        assert!(plan_quantization(&b, 30, &inputs, false).unwrap()[0].rule.ends_with("Q4_1 blocks dequantized"));
    }

    #[test]
    fn bad_profiles_and_partial_blocks_are_typed_errors() {
        let bad = |text: &str| Profile::parse("mine", text).unwrap_err().to_string();
        assert!(bad("description = \"x\"\n[[rule]]\nroles = [\"attn_x\"]\nmethod = \"fp8\"").contains("unknown role `attn_x`"));
        assert!(bad("description = \"x\"\n[[rule]]\nroles = [\"*\"]\nmethod = \"int3\"").contains("unknown method `int3`"));
        assert!(bad("description = \"x\"\n[[rule]]\nroles = [\"*\"]\nlayers = \"mid\"\nmethod = \"bf16\"").contains("layers `mid`"));
        assert!(bad("description = \"x\"\n[[rule]]\nroles = [\"*\"]\nmethod = \"bf16\"\nbits = 3").contains("unknown field"));
        assert!(bad("description = \"x\"").contains("rule"));
        let p = Profile::parse("mine", "description = \"x\"\n[[rule]]\nroles = [\"ffn_up\"]\nmethod = \"mxfp4\"\n").unwrap();
        let e = plan_quantization(&p, 1, &[PlanInput { cols: 48, ..input("blk.0.ffn_up", Role::FfnUp, Some(0), SourceDType::Bf16) }], false).unwrap_err();
        assert!(matches!(e, QuantError::PartialBlock { cols: 48, .. }), "{e}");
        let e = plan_quantization(&p, 1, &[input("blk.0.attn_q", Role::AttnQ, Some(0), SourceDType::Bf16)], false).unwrap_err();
        assert!(matches!(e, QuantError::NoRule { .. }), "{e}");
        assert!(matches!(Profile::load("/nonexistent/p.toml"), Err(QuantError::UnknownProfile { .. })));
    }

    #[test]
    fn descriptor_names_the_dominant_storage() {
        let plan = vec![
            PlannedTensor { name: "a".into(), method: QuantMethod::Fp8RowScale, rule: String::new() },
            PlannedTensor { name: "b".into(), method: QuantMethod::Bf16, rule: String::new() },
            PlannedTensor { name: "n".into(), method: QuantMethod::F32, rule: NORM_RULE.into() },
        ];
        let d = QuantizationDescriptor::from_plan("fp8", plan, &[1000, 300, 10], serde_json::Value::Null);
        assert_eq!((d.storage_dtype, d.bits, d.scale_dtype), (DType::F8E4m3, 8, Some(ScaleType::F32)));
        assert_eq!(d.modules_to_not_convert, vec!["b".to_string(), "n".to_string()]);
    }
}
