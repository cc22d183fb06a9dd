//! Mutation fuzzing of a valid small GGUF: byte flips, truncations and random extensions; and
//! structure-aware mutations of its metadata values (types swapped, integers to extremes, arrays
//! emptied, enlarged or retyped, strings lengthened, keys dropped or duplicated). Every case must
//! return Ok or a typed error from open, source_model, the tokenizer it builds and decode; never
//! panic.

use std::panic::{catch_unwind, AssertUnwindSafe};

use thin_core::codec::decode_to_f32;
use thin_core::gguf::GgufFile;
use w::*;

struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
}

/// Runs the whole read path; Err is fine, panics are what we look for.
fn exercise(bytes: Vec<u8>) -> (bool, bool) {
    let Ok(f) = GgufFile::from_bytes(bytes) else {
        return (false, false);
    };
    let _ = f.source_model("fuzz.gguf");
    let mut out = Vec::new();
    for t in f.tensor_infos() {
        let n = t.elements() as usize;
        out.clear();
        out.resize(n, 0f32);
        let _ = decode_to_f32(t.dtype, f.tensor_data(t), &mut out);
    }
    (true, f.source_model("fuzz.gguf").is_ok())
}

fn mutate(base: &[u8], rng: &mut SplitMix64, header_len: usize) -> Vec<u8> {
    let mut b = base.to_vec();
    let kind = rng.below(6);
    match kind {
        // Flip 1..8 random bits anywhere.
        0 => {
            for _ in 0..1 + rng.below(8) {
                let i = rng.below(b.len() as u64) as usize;
                b[i] ^= 1 << rng.below(8);
            }
        }
        // Overwrite bytes in the header (counts, lengths, types, dims, offsets live there).
        1 => {
            for _ in 0..1 + rng.below(4) {
                let i = rng.below(header_len as u64) as usize;
                b[i] = rng.next() as u8;
            }
        }
        // Write an interesting little-endian integer at a random header position.
        2 => {
            let vals = [
                0u64,
                1,
                2,
                3,
                4,
                9,
                31,
                32,
                33,
                255,
                256,
                0xFFFF,
                u32::MAX as u64,
                1 << 32,
                i64::MAX as u64,
                u64::MAX,
            ];
            let v = vals[rng.below(vals.len() as u64) as usize];
            let w = [1usize, 2, 4, 8][rng.below(4) as usize];
            let i = rng.below(header_len.saturating_sub(w) as u64) as usize;
            b[i..i + w].copy_from_slice(&v.to_le_bytes()[..w]);
        }
        // Truncate.
        3 => {
            let n = rng.below(b.len() as u64) as usize;
            b.truncate(n);
        }
        // Extend with random bytes.
        4 => {
            for _ in 0..rng.below(300) {
                b.push(rng.next() as u8);
            }
        }
        // Corrupt the data section (scales become NaN/Inf, etc.).
        _ => {
            for _ in 0..1 + rng.below(16) {
                let i = header_len + rng.below((b.len() - header_len) as u64) as usize;
                b[i] = rng.next() as u8;
            }
        }
    }
    b
}

#[test]
fn mutations_never_panic() {
    let g = valid();
    let base = g.build();
    assert!(base.len() > 2000 && base.len() < 16_000, "base is {} bytes", base.len());
    let f = GgufFile::from_bytes(base.clone()).expect("base file is valid");
    f.source_model("base.gguf").expect("base source model");
    let header_len = f.data_offset() as usize;
    drop(f);

    let seed: u64 = std::env::var("THIN_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x7417_5EED);
    let cases: u64 = std::env::var("THIN_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(12_000);
    // Silence the default hook's per-panic output; failures are reported below with their seed.
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let start = std::time::Instant::now();
    let (mut opened, mut modeled, mut failures) = (0u64, 0u64, Vec::new());
    for case in 0..cases {
        let case_seed = seed ^ case.wrapping_mul(0xA24B_AED4_963E_E407);
        let mut rng = SplitMix64(case_seed);
        let bytes = mutate(&base, &mut rng, header_len);
        match catch_unwind(AssertUnwindSafe(|| exercise(bytes))) {
            Ok((o, m)) => {
                opened += o as u64;
                modeled += m as u64;
            }
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                failures.push(format!("case {case} (case seed {case_seed:#x}): {msg}"));
            }
        }
    }
    std::panic::set_hook(prev);
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "{cases} cases in {secs:.2}s: {opened} opened, {modeled} gave a source model, {} panics",
        failures.len()
    );
    assert!(failures.is_empty(), "panics (seed {seed:#x}):\n{}", failures.join("\n"));
    assert!(opened > cases / 10, "mutations too destructive: only {opened} opened");
    // The time budget is for the default case count; THIN_FUZZ_CASES runs longer on purpose.
    assert!(secs < 30.0 || cases > 12_000, "took {secs:.1}s");
}

/// One structure-aware change to `g`'s metadata; returns its class.
fn mutate_metadata(g: &mut Gguf, rng: &mut SplitMix64) -> &'static str {
    let i = rng.below(g.kvs.len() as u64) as usize;
    let extremes = [0u64, 1, 2, 255, 4096, 1 << 31, u32::MAX as u64, 1 << 40, i64::MAX as u64, u64::MAX];
    let (_, ty, payload) = &mut g.kvs[i];
    match rng.below(8) {
        0 => {
            // Integer value at an extreme, in its own width or as u64.
            let v = extremes[rng.below(extremes.len() as u64) as usize];
            if rng.below(2) == 0 {
                *ty = T_U64;
                *payload = v.to_le_bytes().to_vec();
            } else {
                *ty = T_U32;
                *payload = (v as u32).to_le_bytes().to_vec();
            }
            "integer extreme"
        }
        1 => {
            // Another type, with a payload of that type.
            match rng.below(4) {
                0 => {
                    *ty = T_STRING;
                    *payload = s("x");
                }
                1 => {
                    *ty = T_F32;
                    *payload = [f32::NAN, f32::INFINITY, -1.0, 1e30][rng.below(4) as usize].to_le_bytes().to_vec();
                }
                2 => {
                    *ty = T_BOOL;
                    *payload = vec![1];
                }
                _ => {
                    *ty = T_ARRAY;
                    *payload = [T_U32.to_le_bytes().to_vec(), 1u64.to_le_bytes().to_vec(), 7u32.to_le_bytes().to_vec()].concat();
                }
            }
            "type swapped"
        }
        2 if *ty == T_ARRAY => {
            let ety = payload[..4].to_vec();
            *payload = [ety, 0u64.to_le_bytes().to_vec()].concat();
            "array emptied"
        }
        3 if *ty == T_ARRAY => {
            // Elements repeated: the count scaled and the element bytes copied.
            let n = u64::from_le_bytes(payload[4..12].try_into().unwrap());
            let times = 2 + rng.below(30);
            let body = payload[12..].to_vec();
            let mut p = payload[..4].to_vec();
            p.extend_from_slice(&(n * times).to_le_bytes());
            for _ in 0..times {
                p.extend_from_slice(&body);
            }
            *payload = p;
            "array enlarged"
        }
        4 if *ty == T_ARRAY => {
            // Element type changed, count kept (the bytes now mean something else).
            let t = [0u32, 4, 5, 6, 7, 8, 10, 12][rng.below(8) as usize];
            payload[..4].copy_from_slice(&t.to_le_bytes());
            "array retyped"
        }
        5 if *ty == T_STRING => {
            let body = payload[8..].to_vec();
            let times = 2 + rng.below(2000) as usize;
            let mut v: Vec<u8> = body.repeat(times);
            if v.is_empty() || rng.below(4) == 0 {
                v.push(0xff); // not UTF-8
            }
            *payload = [(v.len() as u64).to_le_bytes().to_vec(), v].concat();
            "string lengthened"
        }
        6 => {
            g.kvs.remove(i);
            "key removed"
        }
        _ => {
            let kv = g.kvs[i].clone();
            g.kvs.push(kv);
            "key duplicated"
        }
    }
}

/// Metadata values mutated as values: every result goes through the whole read path, and a
/// model that comes out has its tokenizer loaded (and probed) as convert does.
#[test]
fn metadata_mutations_never_panic() {
    let base = valid();
    let seed: u64 = std::env::var("THIN_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x6d65_7461);
    let cases: u64 = std::env::var("THIN_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(6_000);
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let start = std::time::Instant::now();
    let mut classes: std::collections::BTreeMap<&str, u64> = Default::default();
    let (mut modeled, mut tokenized, mut failures, mut slow) = (0u64, 0u64, Vec::new(), Vec::new());
    for case in 0..cases {
        let case_seed = seed ^ case.wrapping_mul(0xA24B_AED4_963E_E407);
        let mut rng = SplitMix64(case_seed);
        let mut g = base.clone();
        let mut class = mutate_metadata(&mut g, &mut rng);
        if rng.below(3) == 0 {
            mutate_metadata(&mut g, &mut rng);
            class = "two changes";
        }
        *classes.entry(class).or_default() += 1;
        let t = std::time::Instant::now();
        let r = catch_unwind(AssertUnwindSafe(|| {
            let Ok(f) = GgufFile::from_bytes(g.build()) else { return (false, false) };
            match f.source_model("fuzz.gguf") {
                Ok(m) => (true, thin_core::tokenizer::TextTokenizer::from_info(&m.tokenizer).is_ok()),
                Err(e) => {
                    let _ = e.to_string();
                    (false, false)
                }
            }
        }));
        match r {
            Ok((m, t)) => {
                modeled += m as u64;
                tokenized += t as u64;
            }
            Err(p) => failures.push(format!("case {case} (case seed {case_seed:#x}, {class}): {}", thin_core::tokenizer::panic_message(&*p))),
        }
        if t.elapsed() > std::time::Duration::from_secs(2) {
            slow.push(format!("case {case} (case seed {case_seed:#x}, {class}): {:?}", t.elapsed()));
        }
    }
    std::panic::set_hook(prev);
    eprintln!(
        "{cases} metadata mutations in {:.2}s: {modeled} gave a source model, {tokenized} a working tokenizer; {} panics, {} over 2 s; classes: {classes:?}",
        start.elapsed().as_secs_f64(),
        failures.len(),
        slow.len()
    );
    assert!(failures.is_empty(), "panics (seed {seed:#x}):\n{}", failures.join("\n"));
    assert!(slow.is_empty(), "{slow:#?}");
    assert!(modeled > cases / 10 && modeled < cases, "{modeled} of {cases} gave a model");
}

// The synthetic GGUF writer lives in tests/common/gguf_writer.rs.
#[allow(dead_code)]
#[path = "common/gguf_writer.rs"]
mod w;
