//! Per-tensor weight formats in the archive: the manifest's block size and scale sections are
//! checked at open against the storage type's layout, the scales' values when an engine binds the
//! tensor, and each format's view decodes to what its codec gives.

use half::bf16;
use thin_core::codecs;
use thin_core::dtype::DType;
use thin_core::engine::{EngineError, WeightView, Weights};
use thin_core::format::testkit::{entry, tensor_bytes, tiny_arch, tiny_entries, tiny_manifest};
use thin_core::format::{Archive, ArchiveWriter, FormatError};
use thin_core::manifest::{Manifest, TensorEntry};
use thin_core::role::Role;
use thin_core::weight_format::{ScaleKind, ScaleType, WeightLayout};

/// `rows x cols` f32 values with some spread and sign changes.
fn values(rows: usize, cols: usize, seed: f32) -> Vec<f32> {
    (0..rows * cols).map(|i| (i as f32 * 0.37 + seed).sin() * (1.0 + (i % 7) as f32)).collect()
}

/// A quantized tensor's entry and bytes, laid out by `WeightLayout`.
fn quantized(role: Role, layer: Option<u32>, dtype: DType, rows: usize, cols: usize, postscale: bool, x: &[f32]) -> (TensorEntry, Vec<u8>) {
    let l = WeightLayout::of(dtype, &[rows as u64, cols as u64], postscale).unwrap();
    let bytes = match dtype {
        DType::F8E4m3 => {
            let (mut v, mut s) = (vec![0u8; rows * cols], vec![0f32; rows]);
            codecs::fp8::quantize(x, cols, &mut v, &mut s).unwrap();
            let s: Vec<u8> = s.iter().flat_map(|f| f.to_le_bytes()).collect();
            l.assemble(&v, &[&s])
        }
        DType::Mxfp4 => {
            let (mut v, mut s, mut p) = (vec![0u8; rows * cols / 2], vec![0u8; rows * cols / 32], vec![bf16::ONE; rows]);
            codecs::mxfp4::quantize_with_postscale(x, cols, &mut v, &mut s, &mut p).unwrap();
            let p: Vec<u8> = p.iter().flat_map(|f| f.to_le_bytes()).collect();
            if postscale {
                l.assemble(&v, &[&s, &p])
            } else {
                l.assemble(&v, &[&s])
            }
        }
        DType::Q8_0 => {
            let mut b = vec![0u8; rows * cols / 32 * codecs::q8_0::BLOCK_BYTES];
            for (xr, br) in x.chunks(cols).zip(b.chunks_mut(cols / 32 * codecs::q8_0::BLOCK_BYTES)) {
                codecs::q8_0::quantize_row(xr, br).unwrap();
            }
            b
        }
        DType::Q4_1 => {
            let mut b = vec![0u8; rows * cols / 32 * codecs::q4_1::BLOCK_BYTES];
            for (xr, br) in x.chunks(cols).zip(b.chunks_mut(cols / 32 * codecs::q4_1::BLOCK_BYTES)) {
                codecs::q4_1::quantize_row(xr, br).unwrap();
            }
            b
        }
        other => panic!("{other:?}"),
    };
    let mut e = entry(role, layer, vec![rows as u64, cols as u64], dtype);
    e.block_size = l.block_size;
    e.scales = l.scales;
    (e, bytes)
}

struct Fixture {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
}

/// The tiny model (untied, one layer) plus four quantized tensors: an fp8 LM head, an mxfp4 gate
/// with postscale, a q8_0 up and a q4_1 down; `edit` may change any (entry, bytes) before writing.
fn write(edit: impl Fn(&mut TensorEntry, &mut Vec<u8>)) -> Result<Fixture, FormatError> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("q.thin");
    let arch = tiny_arch(1, false);
    let mut w = ArchiveWriter::create(&path)?;
    let mut tensors: Vec<(TensorEntry, Vec<u8>)> = tiny_entries(&arch)
        .into_iter()
        .filter(|e| e.role != Role::LmHead)
        .enumerate()
        .map(|(i, e)| {
            let b = tensor_bytes(&e, i as f32);
            (e, b)
        })
        .collect();
    tensors.push(quantized(Role::LmHead, None, DType::F8E4m3, 32, 16, false, &values(32, 16, 0.5)));
    tensors.push(quantized(Role::FfnGate, Some(0), DType::Mxfp4, 8, 64, true, &values(8, 64, 1.5)));
    tensors.push(quantized(Role::FfnUp, Some(0), DType::Q8_0, 8, 64, false, &values(8, 64, 2.5)));
    tensors.push(quantized(Role::FfnDown, Some(0), DType::Q4_1, 8, 64, false, &values(8, 64, 3.5)));
    for (mut e, mut b) in tensors {
        edit(&mut e, &mut b);
        w.add_tensor(e, &b)?;
    }
    w.finish(tiny_manifest(arch))?;
    Ok(Fixture { _dir: dir, path })
}

fn index(a: &Archive, role: Role) -> usize {
    a.find(role, if role == Role::LmHead { None } else { Some(0) }).unwrap()
}

#[test]
fn each_format_opens_and_its_view_decodes_and_multiplies_like_its_codec() {
    let f = write(|_, _| {}).unwrap();
    let a = Archive::open(&f.path).unwrap();
    a.verify().unwrap();
    let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.11).cos()).collect();
    for (role, rows, cols, dtype) in [(Role::LmHead, 32, 16, DType::F8E4m3), (Role::FfnGate, 8, 64, DType::Mxfp4), (Role::FfnUp, 8, 64, DType::Q8_0), (Role::FfnDown, 8, 64, DType::Q4_1)] {
        let v = a.check_tensor(index(&a, role)).unwrap();
        assert_eq!((v.dtype(), v.len(), v.row_len()), (dtype, rows * cols, Some(cols)), "{role:?}");
        // The matvec over the view equals an f64 dot of the decoded rows.
        let dense = v.to_f32_vec();
        let mut out = vec![0f32; rows];
        thin_core::cpu::matvec(v, &x[..cols], &mut out);
        for (r, o) in out.iter().enumerate() {
            let want: f64 = dense[r * cols..(r + 1) * cols].iter().zip(&x[..cols]).map(|(&w, &x)| w as f64 * x as f64).sum();
            assert!((*o as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()), "{role:?} row {r}: {o} vs {want}");
        }
        // Row views are the same rows.
        let mut row = vec![0f32; cols];
        v.row_into(rows - 1, &mut row);
        assert_eq!(row, dense[(rows - 1) * cols..]);
    }
    // The fp8 view's values are the codec's decode of its codes times the row scale.
    let WeightView::F8E4m3 { values, scales, cols } = a.check_tensor(index(&a, Role::LmHead)).unwrap() else { panic!("not fp8") };
    let dense = a.check_tensor(index(&a, Role::LmHead)).unwrap().to_f32_vec();
    assert_eq!(dense[cols + 3], codecs::fp8::decode_e4m3(values[cols + 3]) * scales[1]);
}

#[test]
fn the_manifest_must_carry_the_storage_types_layout() {
    let f = write(|_, _| {}).unwrap();
    let base = std::fs::read(&f.path).unwrap();
    let open_with = |edit: &dyn Fn(&mut Manifest)| -> FormatError {
        let mut p = thin_core::format::testkit::split(&base);
        let mut m: Manifest = serde_json::from_value(p.manifest.clone()).unwrap();
        edit(&mut m);
        p.manifest = serde_json::to_value(&m).unwrap();
        let b = thin_core::format::testkit::rebuild(&base, &p.header, &p.pages, &serde_json::to_vec(&p.manifest).unwrap());
        std::fs::write(&f.path, b).unwrap();
        Archive::open(&f.path).err().expect("a hostile manifest opened")
    };
    let t = |m: &mut Manifest, role: Role| -> usize { m.tensors.iter().position(|t| t.role == role && t.dtype != DType::F32 && t.dtype != DType::Bf16).unwrap() };
    let cases: Vec<(&str, Box<dyn Fn(&mut Manifest)>)> = vec![
        ("block_size", Box::new(move |m| { let i = t(m, Role::LmHead); m.tensors[i].block_size = 32; })),
        ("scale sections", Box::new(move |m| { let i = t(m, Role::LmHead); m.tensors[i].scales.clear(); })),
        ("scale sections", Box::new(move |m| { let i = t(m, Role::LmHead); m.tensors[i].scales[0].offset += 64; })),
        ("scale sections", Box::new(move |m| { let i = t(m, Role::LmHead); m.tensors[i].scales[0].count = u64::MAX; })),
        ("scale sections", Box::new(move |m| { let i = t(m, Role::LmHead); m.tensors[i].scales[0].dtype = ScaleType::Bf16; })),
        ("scale sections", Box::new(move |m| { let i = t(m, Role::FfnGate); m.tensors[i].scales[0].kind = ScaleKind::Row; })),
        ("scale sections", Box::new(move |m| { let (i, j) = (t(m, Role::FfnUp), t(m, Role::LmHead)); let s = m.tensors[j].scales[0]; m.tensors[i].scales.push(s); })),
        ("not a whole number of blocks", Box::new(move |m| { let i = t(m, Role::FfnDown); m.tensors[i].shape = vec![16, 32 + 8]; })),
        ("byte_len", Box::new(move |m| { let i = t(m, Role::FfnGate); m.tensors[i].scales.pop(); })),
        ("mxfp4", Box::new(move |m| { let i = t(m, Role::FfnUp); m.tensors[i].dtype = DType::Mxfp4; })),
    ];
    for (want, edit) in cases {
        let e = open_with(&*edit).to_string();
        assert!(e.contains(want), "expected `{want}` in: {e}");
    }
}

#[test]
fn bad_scale_values_are_refused_when_an_engine_binds_the_tensor() {
    // An fp8 row scale of NaN, 0 or -1, and an e8m0 exponent of 0xff: the archive opens (scales are
    // data), check_tensor and Weights::bind refuse the tensor by name.
    let nan_scale = |role: Role, at: usize, bytes: Vec<u8>| {
        move |e: &mut TensorEntry, b: &mut Vec<u8>| {
            if e.role == role && !e.scales.is_empty() {
                let off = e.scales[0].offset as usize + at;
                b[off..off + bytes.len()].copy_from_slice(&bytes);
            }
        }
    };
    for (role, at, bytes, want) in [
        (Role::LmHead, 4, f32::NAN.to_le_bytes().to_vec(), "row 1"),
        (Role::LmHead, 0, 0f32.to_le_bytes().to_vec(), "row 0"),
        (Role::LmHead, 8, (-1f32).to_le_bytes().to_vec(), "row 2"),
        (Role::FfnGate, 3, vec![0xff], "e8m0"),
    ] {
        let f = write(nan_scale(role, at, bytes)).unwrap();
        let a = Archive::open(&f.path).unwrap();
        let e = a.check_tensor(index(&a, role)).unwrap_err();
        assert!(matches!(&e, FormatError::BadScales { .. }) && e.to_string().contains(want), "{role:?}: {e}");
        let layer = if role == Role::LmHead { None } else { Some(0) };
        let e = a.bind(role, layer, 0).unwrap_err();
        assert!(matches!(e, EngineError::BadWeight { .. }), "{e}");
    }
}

#[test]
fn a_quantized_norm_is_refused_at_bind() {
    let f = write(|e, b| {
        if e.role == Role::OutputNorm {
            // [16] f32 -> fp8 codes of one row of 16 with its scale section.
            let (q, qb) = quantized(Role::OutputNorm, None, DType::F8E4m3, 1, 16, false, &vec![1.0; 16]);
            *e = q;
            *b = qb;
        }
    })
    .unwrap();
    let a = Archive::open(&f.path).unwrap();
    let e = a.bind(Role::OutputNorm, None, 16).unwrap_err();
    assert!(matches!(e, EngineError::NormType { dtype: "f8_e4m3", .. }), "{e}");
}
