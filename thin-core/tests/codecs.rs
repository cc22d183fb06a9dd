//! The codecs against independent references: ml_dtypes (e4m3, e2m1, e8m0) and gguf-py (Q8_0,
//! Q4_1, ggml's MXFP4) on seeded random rows with outliers, from
//! `tests/fixtures/codecs/` (written by `scripts/codec_reference.py`, which says how to regenerate).
//!
//! Encodings must equal the reference bytes, decodings its values bit for bit, and each matvec an
//! f64 dot of the reference's dequantized values within `1e-5 * sum_i |w_i x_i|` (the relative
//! error of a dot itself is unbounded under cancellation; this is the bound a float dot meets).

use half::bf16;
use std::collections::HashMap;
use thin_core::codecs::{fp8, mxfp4, q4_1, q8_0};

struct Fixture {
    data: Vec<u8>,
    arrays: HashMap<String, (usize, usize, Vec<usize>)>,
}

impl Fixture {
    fn load() -> Fixture {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/codecs");
        let index: serde_json::Value =
            serde_json::from_slice(&std::fs::read(format!("{dir}/index.json")).expect("index.json")).expect("index json");
        let data = std::fs::read(format!("{dir}/data.bin")).expect("data.bin");
        let mut arrays = HashMap::new();
        for (name, a) in index["arrays"].as_object().expect("arrays") {
            let n = |k: &str| a[k].as_u64().expect(k) as usize;
            let shape = a["shape"].as_array().expect("shape").iter().map(|d| d.as_u64().expect("dim") as usize).collect();
            arrays.insert(name.clone(), (n("offset"), n("len"), shape));
        }
        Fixture { data, arrays }
    }

    fn bytes(&self, name: &str) -> &[u8] {
        let (off, len, _) = &self.arrays[name];
        &self.data[*off..off + len]
    }

    fn shape(&self, name: &str) -> &[usize] {
        &self.arrays[name].2
    }

    fn f32s(&self, name: &str) -> Vec<f32> {
        self.bytes(name).chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    fn bf16s(&self, name: &str) -> Vec<bf16> {
        self.bytes(name).chunks_exact(2).map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]]))).collect()
    }
}

/// Asserts `got == want` element by element, bit for bit (a NaN matches any NaN).
fn assert_same(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()), "{what}[{i}]: {g} vs {w}");
    }
}

/// Asserts every `out[r]` is within `1e-5 * sum |w x|` of the f64 dot of `deq`'s row `r` and `x`.
fn assert_dots(what: &str, out: &[f32], deq: &[f32], x: &[f32]) {
    let cols = x.len();
    for (r, &o) in out.iter().enumerate() {
        let row = &deq[r * cols..(r + 1) * cols];
        let exact: f64 = row.iter().zip(x).map(|(&a, &b)| a as f64 * b as f64).sum();
        let mag: f64 = row.iter().zip(x).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
        let err = (o as f64 - exact).abs();
        assert!(err <= 1e-5 * mag, "{what} row {r}: {o} vs {exact} (err {err:e}, bound {:e})", 1e-5 * mag);
    }
}

#[test]
fn e4m3_and_e2m1_decode_like_ml_dtypes() {
    let f = Fixture::load();
    let e4m3 = f.f32s("e4m3_decoded");
    let ours: Vec<f32> = (0..=255u8).map(fp8::decode_e4m3).collect();
    assert_same("e4m3", &ours, &e4m3);
    let e2m1 = f.f32s("e2m1_decoded");
    let ours: Vec<f32> = (0..16u8).map(mxfp4::decode_e2m1).collect();
    assert_same("e2m1", &ours, &e2m1);
}

#[test]
fn encoders_match_ml_dtypes_on_ties_saturation_and_random_values() {
    let f = Fixture::load();
    let probes = f.f32s("probes");
    let (e4m3, e2m1) = (f.bytes("probes_e4m3"), f.bytes("probes_e2m1"));
    for (i, &p) in probes.iter().enumerate() {
        assert_eq!(fp8::encode_e4m3(p), e4m3[i], "e4m3 of {p:e} (probe {i})");
        assert_eq!(mxfp4::encode_e2m1(p), e2m1[i], "e2m1 of {p:e} (probe {i})");
    }
}

#[test]
fn fp8_matches_reference() {
    let f = Fixture::load();
    let (w, x) = (f.f32s("w"), f.f32s("x"));
    let (rows, cols) = (f.shape("w")[0], f.shape("w")[1]);
    let mut values = vec![0u8; rows * cols];
    let mut scales = vec![0f32; rows];
    fp8::quantize(&w, cols, &mut values, &mut scales).unwrap();
    assert_same("fp8 scales", &scales, &f.f32s("fp8_scales"));
    assert_eq!(values, f.bytes("fp8_values"), "fp8 values");
    let want = f.f32s("fp8_dequant");
    let mut deq = vec![0f32; rows * cols];
    fp8::dequantize(&values, &scales, cols, &mut deq).unwrap();
    assert_same("fp8 dequant", &deq, &want);
    let mut out = vec![0f32; rows];
    fp8::matvec_rows(&values, &scales, &x, &mut out).unwrap();
    assert_dots("fp8", &out, &want, &x);
}

#[test]
fn mxfp4_matches_ocp_reference() {
    let f = Fixture::load();
    let (w, x) = (f.f32s("w"), f.f32s("x"));
    let (rows, cols) = (f.shape("w")[0], f.shape("w")[1]);
    let sizes = mxfp4::sizes(rows as u64, cols as u64).unwrap();
    let mut values = vec![0u8; sizes.values as usize];
    let mut scales = vec![0u8; sizes.scales as usize];
    let mut post = vec![bf16::ZERO; rows];
    mxfp4::quantize_with_postscale(&w, cols, &mut values, &mut scales, &mut post).unwrap();
    assert_eq!(values, f.bytes("mxfp4_values"), "mxfp4 values");
    assert_eq!(scales, f.bytes("mxfp4_scales"), "mxfp4 e8m0 scales");
    assert_eq!(post, f.bf16s("mxfp4_postscale"), "mxfp4 postscales");
    // Without the fit the values and scales are the same.
    let (mut v2, mut s2) = (vec![0u8; values.len()], vec![0u8; scales.len()]);
    mxfp4::quantize(&w, cols, &mut v2, &mut s2).unwrap();
    assert_eq!((&v2, &s2), (&values, &scales));

    let mut deq = vec![0f32; rows * cols];
    mxfp4::dequantize(&values, &scales, None, cols, &mut deq).unwrap();
    let want = f.f32s("mxfp4_dequant");
    assert_same("mxfp4 dequant", &deq, &want);
    let want_post = f.f32s("mxfp4_dequant_post");
    mxfp4::dequantize(&values, &scales, Some(&post), cols, &mut deq).unwrap();
    assert_same("mxfp4 dequant with postscale", &deq, &want_post);

    let mut out = vec![0f32; rows];
    mxfp4::matvec_rows(&values, &scales, None, &x, &mut out).unwrap();
    assert_dots("mxfp4", &out, &want, &x);
    mxfp4::matvec_rows(&values, &scales, Some(&post), &x, &mut out).unwrap();
    assert_dots("mxfp4 with postscale", &out, &want_post, &x);

    // The postscale fit lowers every row's squared error against w.
    for r in 0..rows {
        let err = |d: &[f32]| -> f64 { (0..cols).map(|c| (w[r * cols + c] as f64 - d[r * cols + c] as f64).powi(2)).sum() };
        assert!(err(&want_post) <= err(&want) * (1.0 + 1e-3), "row {r}");
    }
}

#[test]
fn mxfp4_agrees_with_ggml_layout_and_scale_rule() {
    let f = Fixture::load();
    let w = f.f32s("w");
    let (rows, cols) = (f.shape("w")[0], f.shape("w")[1]);
    let blocks = f.bytes("ggml_mxfp4_blocks");
    let n_blocks = rows * cols / 32;
    // gguf-py's dequantization of its blocks, through our repack and decoder: bit for bit.
    let (mut values, mut scales) = (vec![0u8; rows * cols / 2], vec![0u8; n_blocks]);
    mxfp4::from_ggml_blocks(blocks, &mut values, &mut scales).unwrap();
    let mut deq = vec![0f32; rows * cols];
    mxfp4::dequantize(&values, &scales, None, cols, &mut deq).unwrap();
    assert_same("ggml mxfp4 dequant", &deq, &f.f32s("ggml_mxfp4_dequant"));
    // Same shared exponents; the codes differ only on exact ties (none in this data) and on the
    // sign of zeros, so the dequantized values are equal.
    let (mut ours_v, mut ours_s) = (vec![0u8; values.len()], vec![0u8; n_blocks]);
    mxfp4::quantize(&w, cols, &mut ours_v, &mut ours_s).unwrap();
    assert_eq!(ours_s, scales, "e8m0 scales vs ggml");
    let mut ours = vec![0f32; rows * cols];
    mxfp4::dequantize(&ours_v, &ours_s, None, cols, &mut ours).unwrap();
    for (i, (a, b)) in ours.iter().zip(&deq).enumerate() {
        assert_eq!(a, b, "element {i}");
    }
}

#[test]
fn q8_0_matches_gguf_py() {
    let f = Fixture::load();
    let (w, x) = (f.f32s("w"), f.f32s("x"));
    let (rows, cols) = (f.shape("w")[0], f.shape("w")[1]);
    let mut blocks = vec![0u8; q8_0::sizes(rows as u64, cols as u64).unwrap().values as usize];
    q8_0::quantize_row(&w, &mut blocks).unwrap();
    assert_eq!(blocks, f.bytes("q8_0_blocks"), "Q8_0 blocks");
    let want = f.f32s("q8_0_dequant");
    let mut deq = vec![0f32; rows * cols];
    q8_0::dequantize(&blocks, cols, &mut deq).unwrap();
    assert_same("Q8_0 dequant", &deq, &want);
    let mut out = vec![0f32; rows];
    q8_0::matvec_rows(&blocks, &x, &mut out).unwrap();
    assert_dots("Q8_0", &out, &want, &x);
}

#[test]
fn q4_1_matches_gguf_py() {
    let f = Fixture::load();
    let (w, x) = (f.f32s("w"), f.f32s("x"));
    let (rows, cols) = (f.shape("w")[0], f.shape("w")[1]);
    let mut blocks = vec![0u8; q4_1::sizes(rows as u64, cols as u64).unwrap().values as usize];
    q4_1::quantize_row(&w, &mut blocks).unwrap();
    assert_eq!(blocks, f.bytes("q4_1_blocks"), "Q4_1 blocks");
    let want = f.f32s("q4_1_dequant");
    let mut deq = vec![0f32; rows * cols];
    q4_1::dequantize(&blocks, cols, &mut deq).unwrap();
    assert_same("Q4_1 dequant", &deq, &want);
    let mut out = vec![0f32; rows];
    q4_1::matvec_rows(&blocks, &x, &mut out).unwrap();
    assert_dots("Q4_1", &out, &want, &x);
}

/// Every kernel level this CPU runs (portable, AVX2, AVX-512) gives the portable loop's bits on
/// the reference rows, and each is within the dot bound of the reference's dequantized values.
#[test]
fn every_kernel_level_gives_the_same_bits() {
    use thin_core::codecs::Isa;
    let f = Fixture::load();
    let (w, x) = (f.f32s("w"), f.f32s("x"));
    let (rows, cols) = (f.shape("w")[0], f.shape("w")[1]);
    let (mut v8, mut s8) = (vec![0u8; rows * cols], vec![0f32; rows]);
    fp8::quantize(&w, cols, &mut v8, &mut s8).unwrap();
    let (mut v4, mut s4, mut p4) = (vec![0u8; rows * cols / 2], vec![0u8; rows * cols / 32], vec![bf16::ONE; rows]);
    mxfp4::quantize_with_postscale(&w, cols, &mut v4, &mut s4, &mut p4).unwrap();
    let (b8, b41) = (f.bytes("q8_0_blocks"), f.bytes("q4_1_blocks"));
    let run = |isa: Isa| -> Vec<Vec<f32>> {
        let mut outs = vec![vec![0f32; rows]; 5];
        fp8::matvec_rows_on(isa, &v8, &s8, &x, &mut outs[0]).unwrap();
        mxfp4::matvec_rows_on(isa, &v4, &s4, None, &x, &mut outs[1]).unwrap();
        mxfp4::matvec_rows_on(isa, &v4, &s4, Some(&p4), &x, &mut outs[2]).unwrap();
        q8_0::matvec_rows_on(isa, b8, &x, &mut outs[3]).unwrap();
        q4_1::matvec_rows_on(isa, b41, &x, &mut outs[4]).unwrap();
        outs
    };
    let portable = run(Isa::Portable);
    assert_dots("Q8_0 portable", &portable[3], &f.f32s("q8_0_dequant"), &x);
    assert_dots("Q4_1 portable", &portable[4], &f.f32s("q4_1_dequant"), &x);
    for isa in Isa::supported() {
        for (k, (got, want)) in run(isa).iter().zip(&portable).enumerate() {
            assert_same(&format!("{isa:?} kernel {k}"), got, want);
        }
    }

    // FP8: rows holding every finite code (subnormals, both zeros, ±448) over 301 columns (nine
    // 32-element chunks and a 13-element tail), 9 rows.
    let (rows, cols) = (9usize, 301usize);
    let finite: Vec<u8> = (0..=255u8).filter(|c| c & 0x7F != 0x7F).collect();
    let values: Vec<u8> = (0..rows * cols).map(|i| finite[(i * 97 + i / cols) % finite.len()]).collect();
    let scales: Vec<f32> = (0..rows).map(|r| 0.5 + r as f32 * 0.25).collect();
    let x: Vec<f32> = (0..cols).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013).collect();
    let mut want = vec![0f32; rows];
    fp8::matvec_rows_on(Isa::Portable, &values, &scales, &x, &mut want).unwrap();
    let mut deq = vec![0f32; rows * cols];
    fp8::dequantize(&values, &scales, cols, &mut deq).unwrap();
    assert_dots("fp8 every code", &want, &deq, &x);
    for isa in Isa::supported() {
        let mut got = vec![0f32; rows];
        fp8::matvec_rows_on(isa, &values, &scales, &x, &mut got).unwrap();
        assert_same(&format!("{isa:?} fp8 every code"), &got, &want);
        // A NaN code in a chunk, and one in the tail, is an error naming it on every level.
        for at in [5 * cols + 40, 7 * cols + 295] {
            let mut bad = values.clone();
            bad[at] = 0xFF;
            let e = fp8::matvec_rows_on(isa, &bad, &scales, &x, &mut got).unwrap_err();
            assert_eq!(
                e,
                thin_core::codecs::CodecError::NanE4m3 { dtype: "f8_e4m3", index: at as u64, code: 0xFF },
                "{isa:?}"
            );
        }
    }
}

/// Single-thread matvec speed of every codec on every kernel level this CPU runs, next to the
/// bf16 one, at SmolLM2's gate/up shape (weights in L2, as a thread's share of a layer is);
/// the best of 40 batches of 20 calls (each a millisecond or two, shorter than a scheduler slice),
/// so other load on the machine shows less:
/// `cargo test --release -p thin-core --test codecs throughput -- --ignored --nocapture`
#[test]
#[ignore]
fn throughput() {
    use thin_core::codecs::Isa;
    use thin_core::engine::WeightView;
    let rows: usize = std::env::var("THROUGHPUT_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(1536);
    let cols = 576usize;
    let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 2654435761usize % 1000) as f32 - 500.0) * 1e-3).collect();
    let x: Vec<f32> = (0..cols).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1).collect();
    let mut out = vec![0f32; rows];
    let elems = rows * cols;
    let mut time = |name: &str, isa: Isa, bytes: usize, f: &mut dyn FnMut(&mut [f32])| {
        f(&mut out);
        let mut best = f64::INFINITY;
        for _ in 0..40 {
            let reps = 20;
            let t = std::time::Instant::now();
            for _ in 0..reps {
                f(&mut out);
            }
            best = best.min(t.elapsed().as_secs_f64() / reps as f64);
        }
        let s = best;
        eprintln!(
            "{name:6} {:8} {:7.1} us  {:6.2} GB/s weights  {:6.2} Gelem/s",
            isa.name(),
            s * 1e6,
            bytes as f64 / s / 1e9,
            elems as f64 / s / 1e9
        );
        std::hint::black_box(&out);
    };
    let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    pool.install(|| {
        time("bf16", Isa::best(), rows * cols * 2, &mut |o| thin_core::cpu::matvec(WeightView::Bf16(&wb), &x, o));
    });
    let (mut v8, mut s8) = (vec![0u8; rows * cols], vec![0f32; rows]);
    fp8::quantize(&w, cols, &mut v8, &mut s8).unwrap();
    let (mut v4, mut s4, mut p4) = (vec![0u8; rows * cols / 2], vec![0u8; rows * cols / 32], vec![bf16::ONE; rows]);
    mxfp4::quantize_with_postscale(&w, cols, &mut v4, &mut s4, &mut p4).unwrap();
    let mut b8 = vec![0u8; rows * cols / 32 * 34];
    q8_0::quantize_row(&w, &mut b8).unwrap();
    let mut b41 = vec![0u8; rows * cols / 32 * 20];
    q4_1::quantize_row(&w, &mut b41).unwrap();
    for isa in Isa::supported() {
        time("fp8", isa, rows * cols + rows * 4, &mut |o| fp8::matvec_rows_on(isa, &v8, &s8, &x, o).unwrap());
        time("mxfp4", isa, rows * cols / 2 + rows * cols / 32 + rows * 2, &mut |o| {
            mxfp4::matvec_rows_on(isa, &v4, &s4, Some(&p4), &x, o).unwrap()
        });
        time("q8_0", isa, b8.len(), &mut |o| q8_0::matvec_rows_on(isa, &b8, &x, o).unwrap());
        time("q4_1", isa, b41.len(), &mut |o| q4_1::matvec_rows_on(isa, &b41, &x, o).unwrap());
    }
}
