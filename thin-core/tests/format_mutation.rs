//! Mutation fuzzing of a small valid archive: byte flips, truncations, extensions, and flips with
//! the archive hash recomputed (so the page-table and manifest validators see the damage); and
//! structure-aware mutations of the manifest's JSON fields (common/json_mutate.rs), re-signed.
//! `Archive::open` (+ `verify` when it opens) must return Ok or Err, never panic.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use thin_core::format::testkit::{rebuild, split, write_tiny};
use thin_core::format::{Archive, Header, HEADER_LEN};

/// splitmix64: tiny, seeded, good enough for fuzzing.
struct Rng(u64);

impl Rng {
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

#[derive(Clone, Copy, Debug)]
enum Kind {
    Flip,
    Truncate,
    Extend,
    /// Flip inside page table or manifest, then recompute the archive hash.
    FlipRehash,
}

const SEED: u64 = 0x7417_7e45_0000_0001;
const CASES_PER_KIND: u64 = 3000;

fn flip(rng: &mut Rng, v: &mut [u8], meta_ranges: &[(usize, usize)]) {
    let n = 1 + rng.below(8);
    for _ in 0..n {
        let pos = if rng.below(2) == 0 {
            // biased: header, page table or manifest
            let (s, e) = meta_ranges[rng.below(meta_ranges.len() as u64) as usize];
            s + rng.below((e - s) as u64) as usize
        } else {
            rng.below(v.len() as u64) as usize
        };
        let bit = rng.next() as u8;
        v[pos] ^= if bit == 0 { 1 } else { bit };
    }
}

fn mutate(kind: Kind, rng: &mut Rng, base: &[u8], header: &Header) -> Vec<u8> {
    let pt = header.page_table_off as usize;
    let mo = header.manifest_off as usize;
    let meta = [(0usize, HEADER_LEN as usize), (pt, mo), (mo, base.len())];
    match kind {
        Kind::Flip => {
            let mut v = base.to_vec();
            flip(rng, &mut v, &meta);
            v
        }
        Kind::Truncate => {
            let len = if rng.below(2) == 0 {
                rng.below(base.len() as u64) as usize
            } else {
                // near the metadata
                let (s, e) = meta[rng.below(3) as usize];
                (s + rng.below((e - s) as u64) as usize).min(base.len() - 1)
            };
            base[..len].to_vec()
        }
        Kind::Extend => {
            let mut v = base.to_vec();
            let cap = if rng.below(2) == 0 { 16 } else { 8192 };
            let extra = 1 + rng.below(cap);
            for _ in 0..extra {
                v.push(rng.next() as u8);
            }
            v
        }
        Kind::FlipRehash => {
            let parts = split(base);
            let mut pt_bytes = base[pt..mo].to_vec();
            let mut m_bytes = base[mo..].to_vec();
            let n = 1 + rng.below(8);
            for _ in 0..n {
                let target = if rng.below(2) == 0 { &mut pt_bytes } else { &mut m_bytes };
                let pos = rng.below(target.len() as u64) as usize;
                let bit = rng.next() as u8;
                target[pos] ^= if bit == 0 { 1 } else { bit };
            }
            let pages: Vec<_> = pt_bytes
                .chunks_exact(64)
                .map(|c| thin_core::format::PageEntry::parse(c).unwrap())
                .collect();
            rebuild(base, &parts.header, &pages, &m_bytes)
        }
    }
}

fn check(path: &Path) -> Result<bool, String> {
    match Archive::open(path) {
        Ok(a) => match a.verify() {
            Ok(_) => Ok(true),
            Err(e) => {
                let _ = e.to_string();
                Ok(false)
            }
        },
        Err(e) => {
            let _ = e.to_string();
            Ok(false)
        }
    }
}

#[test]
fn mutations_never_panic() {
    let dir = tempfile::tempdir().unwrap();
    let base_path = dir.path().join("base.thin");
    write_tiny(&base_path, 1, true, None).unwrap();
    let base = std::fs::read(&base_path).unwrap();
    let header = Header::parse(&base).unwrap();
    assert!(base.len() < 40 << 10, "base archive is {} bytes", base.len());
    // tmpfs when there is one: 12k rewrites of a disk file are slow on a busy machine.
    let shm = Path::new("/dev/shm");
    let case_dir = if shm.is_dir() { tempfile::tempdir_in(shm).ok() } else { None };
    let case_path = case_dir.as_ref().map_or_else(|| dir.path().to_path_buf(), |d| d.path().to_path_buf()).join("case.thin");
    let t0 = std::time::Instant::now();
    let mut panics = Vec::new();
    let mut opened = [0u64; 4];
    let mut total = 0u64;
    let mut write_time = std::time::Duration::ZERO;
    for (ki, kind) in [Kind::Flip, Kind::Truncate, Kind::Extend, Kind::FlipRehash].into_iter().enumerate() {
        for case in 0..CASES_PER_KIND {
            let case_seed = SEED ^ ((ki as u64) << 56) ^ case.wrapping_mul(0x1000_0000_01B3);
            let mut rng = Rng(case_seed);
            let bytes = mutate(kind, &mut rng, &base, &header);
            let tw = std::time::Instant::now();
            std::fs::write(&case_path, &bytes).unwrap();
            write_time += tw.elapsed();
            total += 1;
            match catch_unwind(AssertUnwindSafe(|| check(&case_path))) {
                Ok(Ok(true)) => opened[ki] += 1,
                Ok(_) => {}
                Err(_) => panics.push(format!("{kind:?} case {case} seed {case_seed:#x}")),
            }
        }
    }
    eprintln!(
        "{total} mutation cases in {:?} (file writes {write_time:?}); verified ok per kind (flip, truncate, extend, flip+rehash): {opened:?}",
        t0.elapsed()
    );
    assert!(total >= 10_000);
    assert!(panics.is_empty(), "{} panics: {:?}", panics.len(), &panics[..panics.len().min(20)]);
}

#[allow(dead_code)]
#[path = "common/json_mutate.rs"]
mod json_mutate;

/// Manifest fields mutated (numbers to extremes, types swapped, arrays emptied or enlarged,
/// strings lengthened, keys removed or added, the embedded tokenizer.json mutated inside) and the
/// header re-signed, so every check past the archive hash sees them: `Archive::open` (which loads
/// the tokenizer and renders the chat template), `verify` and the manifest's JSON (what `inspect`
/// prints) must give Ok or a typed error in bounded time, never panic.
#[test]
fn manifest_field_mutations_never_panic() {
    use json_mutate::{mutate, Rng as JRng, Tally};
    let dir = tempfile::tempdir().unwrap();
    let base_path = dir.path().join("base.thin");
    write_tiny(&base_path, 2, false, None).unwrap();
    let base = std::fs::read(&base_path).unwrap();
    let parts = split(&base);
    let shm = Path::new("/dev/shm");
    let case_dir = if shm.is_dir() { tempfile::tempdir_in(shm).ok() } else { None };
    let case_path = case_dir.as_ref().map_or_else(|| dir.path().to_path_buf(), |d| d.path().to_path_buf()).join("case.thin");
    let cases: u64 = std::env::var("THIN_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(10_000);
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let t0 = std::time::Instant::now();
    let (mut tally, mut opened, mut verified) = (Tally::default(), 0u64, 0u64);
    let (mut panics, mut slow) = (Vec::new(), Vec::new());
    for case in 0..cases {
        let seed = SEED ^ 0x4a53_4f4e ^ case.wrapping_mul(0x1000_0000_01B3);
        let mut rng = JRng(seed);
        let mut m = parts.manifest.clone();
        // A quarter of the cases go into what other libraries parse (tokenizer, chat template).
        let target = if case % 4 == 0 { m.pointer_mut("/tokenizer").unwrap() } else { &mut m };
        let class = mutate(target, &mut rng);
        tally.add(class);
        let json = serde_json::to_vec(&m).unwrap();
        std::fs::write(&case_path, rebuild(&base, &parts.header, &parts.pages, &json)).unwrap();
        let t = std::time::Instant::now();
        let r = catch_unwind(AssertUnwindSafe(|| match Archive::open(&case_path) {
            Ok(a) => {
                let _ = serde_json::to_string(a.manifest()).map(|s| s.len());
                (true, a.verify().is_ok())
            }
            Err(e) => {
                let _ = e.to_string();
                (false, false)
            }
        }));
        let took = t.elapsed();
        match r {
            Ok((o, v)) => {
                opened += o as u64;
                verified += v as u64;
            }
            Err(p) => panics.push(format!("case {case} seed {seed:#x} ({class:?}): {}", thin_core::tokenizer::panic_message(&*p))),
        }
        if took > std::time::Duration::from_secs(2) {
            slow.push(format!("case {case} seed {seed:#x} ({class:?}): {took:?}"));
        }
    }
    std::panic::set_hook(prev);
    eprintln!(
        "{cases} manifest mutations in {:?}: {opened} opened, {verified} verified; {} panics, {} over 2 s; classes: {}",
        t0.elapsed(),
        panics.len(),
        slow.len(),
        tally.line()
    );
    assert!(panics.is_empty(), "{} panics: {:#?}", panics.len(), &panics[..panics.len().min(20)]);
    assert!(slow.is_empty(), "{slow:#?}");
    assert!(opened > 0 && opened < cases, "mutations must both pass and fail: {opened} of {cases} opened");
}
