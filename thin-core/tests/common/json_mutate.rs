//! Structure-aware mutation of JSON documents (an archive manifest, a config.json, an embedded
//! tokenizer.json): pick a node, change it the way a hostile or broken writer would. Shared by
//! thin-core/tests/format_mutation.rs and the root tests/mutation.rs.

use std::collections::BTreeMap;

use serde_json::{Map, Number, Value};

/// splitmix64: tiny, seeded, good enough for fuzzing.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len() as u64) as usize]
    }
}

/// What a mutation did, for the summary a test prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Class {
    /// A number set to 0, ±1, 2^31, 2^32, 2^53, u64::MAX, i64::MIN, ±1e300, 0.5, or scaled.
    NumberExtreme,
    /// A value replaced by one of another JSON type.
    TypeSwap,
    ArrayEmptied,
    /// An array's elements repeated (up to 100 times, at most 20,000 elements).
    ArrayEnlarged,
    /// One array element dropped, or two swapped.
    ArrayReordered,
    /// A string repeated up to 4096 times (at most 2 MB).
    StringLengthened,
    StringEmptied,
    /// One character of a string changed.
    StringEdited,
    KeyRemoved,
    KeyAdded,
    /// A string that is itself JSON (the embedded tokenizer.json) mutated inside, re-serialized.
    NestedJson,
}

pub const EXTREMES: [f64; 8] = [0.0, 1.0, 2.0, 255.0, 4096.0, 65536.0, 2147483648.0, 4294967296.0];

fn extreme(rng: &mut Rng, old: &Number) -> Value {
    match rng.below(12) {
        0..=2 => Value::from(*rng.pick(&EXTREMES) as u64),
        3 => Value::from(u64::MAX),
        4 => Value::from(i64::MIN),
        5 => Value::from(-1i64),
        6 => Value::from(1u64 << 53),
        7 => Value::from(if rng.below(2) == 0 { 1e300 } else { -1e300 }),
        8 => Value::from(0.5),
        9 => Value::from(-0.0),
        10 => old.as_u64().map_or(Value::from(1u64 << 40), |v| Value::from(v.wrapping_add(1))),
        _ => old.as_u64().map_or(Value::from(7u64), |v| Value::from(v.saturating_mul(1 << rng.below(40)))),
    }
}

fn other_type(rng: &mut Rng, v: &Value) -> Value {
    loop {
        let n = match rng.below(7) {
            0 => Value::Null,
            1 => Value::Bool(rng.below(2) == 0),
            2 => Value::from(rng.below(1 << 20)),
            3 => Value::String(if rng.below(2) == 0 { "x".into() } else { "12".into() }),
            4 => Value::Array(vec![]),
            5 => Value::Array(vec![Value::from(1u64), Value::String("a".into())]),
            _ => Value::Object(Map::new()),
        };
        if std::mem::discriminant(&n) != std::mem::discriminant(v) {
            return n;
        }
    }
}

/// One step of a path into a document.
#[derive(Clone)]
enum Step {
    Key(String),
    Index(usize),
}

fn collect(v: &Value, here: &mut Vec<Step>, out: &mut Vec<Vec<Step>>) {
    out.push(here.clone());
    match v {
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                here.push(Step::Index(i));
                collect(x, here, out);
                here.pop();
            }
        }
        Value::Object(o) => {
            for (k, x) in o {
                here.push(Step::Key(k.clone()));
                collect(x, here, out);
                here.pop();
            }
        }
        _ => {}
    }
}

fn at<'a>(v: &'a mut Value, path: &[Step]) -> &'a mut Value {
    path.iter().fold(v, |v, s| match s {
        Step::Key(k) => &mut v[k.as_str()],
        Step::Index(i) => &mut v[*i],
    })
}

/// Mutates one node of `doc`; returns what it did. Strings longer than 64 bytes that parse as a
/// JSON object are mutated inside half the time (the embedded tokenizer.json).
pub fn mutate(doc: &mut Value, rng: &mut Rng) -> Class {
    let mut paths = Vec::new();
    collect(doc, &mut Vec::new(), &mut paths);
    let path = rng.pick(&paths).clone();
    let node = at(doc, &path);
    if let Value::String(s) = node {
        if s.len() > 64 && rng.below(2) == 0 {
            if let Ok(mut inner @ Value::Object(_)) = serde_json::from_str::<Value>(s) {
                mutate(&mut inner, rng);
                *s = inner.to_string();
                return Class::NestedJson;
            }
        }
    }
    if rng.below(8) == 0 {
        let n = other_type(rng, node);
        *node = n;
        return Class::TypeSwap;
    }
    match &mut *node {
        Value::Number(n) => {
            let n = extreme(rng, n);
            *node = n;
            Class::NumberExtreme
        }
        Value::String(s) => match rng.below(4) {
            0 => {
                s.clear();
                Class::StringEmptied
            }
            1 => {
                let pos = rng.below(s.chars().count() as u64) as usize;
                let c = *rng.pick(&['\0', 'é', '"', '\\', '{', '9', '\u{FFFF}', '🙂']);
                *s = s.chars().enumerate().map(|(i, x)| if i == pos { c } else { x }).collect();
                Class::StringEdited
            }
            _ => {
                let times = 1 + rng.below(4096) as usize;
                let times = times.min((2 << 20) / s.len().max(1)).max(2);
                *s = s.repeat(times);
                if s.is_empty() {
                    s.push_str(&"A".repeat(1 + rng.below(100_000) as usize));
                }
                Class::StringLengthened
            }
        },
        Value::Array(a) => match rng.below(3) {
            0 => {
                a.clear();
                Class::ArrayEmptied
            }
            1 if !a.is_empty() => {
                let times = (2 + rng.below(99) as usize).min(20_000 / a.len()).max(1);
                let copy = a.clone();
                for _ in 1..times {
                    a.extend(copy.iter().cloned());
                }
                if times == 1 {
                    a.push(copy[0].clone());
                }
                Class::ArrayEnlarged
            }
            _ if a.len() >= 2 => {
                let i = rng.below(a.len() as u64) as usize;
                if rng.below(2) == 0 {
                    a.remove(i);
                } else {
                    let j = rng.below(a.len() as u64) as usize;
                    a.swap(i, j);
                }
                Class::ArrayReordered
            }
            _ => {
                a.push(Value::from(rng.below(1 << 33)));
                Class::ArrayEnlarged
            }
        },
        Value::Object(o) => {
            let keys: Vec<String> = o.keys().cloned().collect();
            if !keys.is_empty() && rng.below(2) == 0 {
                o.remove(rng.pick(&keys));
                Class::KeyRemoved
            } else {
                let k = if keys.is_empty() || rng.below(2) == 0 { "unknown_key".to_string() } else { format!("{}_", rng.pick(&keys)) };
                o.insert(k, Value::from(rng.below(1 << 33)));
                Class::KeyAdded
            }
        }
        Value::Null | Value::Bool(_) => {
            let n = other_type(rng, node);
            *node = n;
            Class::TypeSwap
        }
    }
}

/// Counts per class, for the summary line.
#[derive(Default)]
pub struct Tally(pub BTreeMap<String, u64>);

impl Tally {
    pub fn add(&mut self, class: impl std::fmt::Debug) {
        *self.0.entry(format!("{class:?}")).or_default() += 1;
    }
    pub fn line(&self) -> String {
        self.0.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join(", ")
    }
}
