
use super::testkit::*;
use super::*;

#[test]
fn round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.thin");
    let out = write_tiny(&p, 2, false, None).unwrap();
    assert_eq!(out, p);
    let a = Archive::open(&p).unwrap();
    let arch = tiny_arch(2, false);
    let entries = tiny_entries(&arch);
    assert_eq!(a.manifest().tensors.len(), entries.len());
    let emb = a.tensor_f32(Role::TokenEmbd, None).unwrap();
    assert_eq!(emb.len(), 32 * 16);
    assert_eq!(emb[0], 0.0);
    assert_eq!(emb[3], 0.75);
    let norm = a.tensor_f32(Role::AttnNorm, Some(1)).unwrap();
    let idx = entries.iter().position(|e| e.name == "blk.1.attn_norm").unwrap() as f32;
    assert_eq!(norm[2], idx + 0.5);
    let q = a.tensor_bf16(Role::AttnQ, Some(0)).unwrap();
    assert_eq!(q[4].to_f32(), 2.0 + 1.0);
    assert!(matches!(a.tensor_f32(Role::AttnQ, Some(0)), Err(FormatError::WrongDType { .. })));
    assert!(matches!(a.tensor_f32(Role::FfnUp, Some(0)), Err(FormatError::TensorNotFound { .. })));
    for t in &a.manifest().tensors {
        let b = a.tensor_bytes(t).unwrap();
        assert_eq!(b.len() as u64, t.byte_len);
        assert_eq!(b.as_ptr() as usize % PAGE_ALIGN as usize, 0);
    }
    let r = a.verify().unwrap();
    assert_eq!(r.tensors, entries.len() as u64);
    assert_eq!(r.pages, a.pages().len() as u64);
    assert_eq!(a.file_len(), std::fs::metadata(&p).unwrap().len());
    assert_eq!(a.manifest().validation.tensor_count, entries.len() as u64);
    assert_eq!(a.manifest().backend_hints.alignment, PAGE_ALIGN);
    assert_eq!(a.header().data_off, PAGE_ALIGN);
}

#[test]
fn deterministic() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.thin");
    let b = dir.path().join("b.thin");
    write_tiny(&a, 2, false, None).unwrap();
    write_tiny(&b, 2, false, None).unwrap();
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
}

#[test]
fn multi_page_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.thin");
    let mut arch = tiny_arch(1, true);
    arch.dims.vocab_size = 1000;
    let mut w = ArchiveWriter::create(&p).unwrap().with_max_page_size(PAGE_ALIGN);
    for (i, e) in tiny_entries(&arch).into_iter().enumerate() {
        let b = tensor_bytes(&e, i as f32);
        w.add_tensor(e, &b).unwrap();
    }
    w.finish(tiny_manifest(arch)).unwrap();
    let a = Archive::open(&p).unwrap();
    let t = a.manifest().tensor(Role::TokenEmbd, None).unwrap();
    // 1000*16*4 = 64000 bytes = 16 pages of 4096 (last partial)
    assert_eq!(t.page_count, 16);
    assert_eq!(t.byte_len, 64000);
    let emb = a.tensor_f32(Role::TokenEmbd, None).unwrap();
    assert!(emb.iter().enumerate().all(|(i, &v)| v == i as f32 * 0.25));
    a.verify().unwrap();
}

#[test]
fn bad_max_page_size_and_bad_len() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.thin");
    let mut w = ArchiveWriter::create(&p).unwrap().with_max_page_size(1000);
    let e = entry(Role::OutputNorm, None, vec![4], DType::F32);
    assert!(matches!(w.add_tensor(e.clone(), &[0u8; 16]), Err(FormatError::InvalidMaxPageSize(1000))));
    let mut w = w.with_max_page_size(PAGE_ALIGN);
    assert!(matches!(w.add_tensor(e.clone(), &[0u8; 15]), Err(FormatError::BadShape { .. })));
    let big = entry(Role::OutputNorm, None, vec![u64::MAX, 2], DType::F32);
    assert!(matches!(w.add_tensor(big, &[]), Err(FormatError::BadShape { .. })));
    w.add_tensor(e.clone(), &[0u8; 16]).unwrap();
    assert!(matches!(w.add_tensor(e, &[0u8; 16]), Err(FormatError::DuplicateTensor(_))));
}

fn temp_files(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect()
}

#[test]
fn temp_file_removed_on_drop() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.thin");
    {
        let mut w = ArchiveWriter::create(&p).unwrap();
        let names = temp_files(dir.path());
        assert_eq!(names.len(), 1);
        assert_eq!(names[0], format!("m.thin.tmp-{}", std::process::id()), "one clear temporary name");
        let e = entry(Role::OutputNorm, None, vec![4], DType::F32);
        w.add_tensor(e, &[0u8; 16]).unwrap();
    }
    assert!(temp_files(dir.path()).is_empty());
    assert!(!p.exists());
}

#[test]
fn failed_finish_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.thin");
    let w = ArchiveWriter::create(&p).unwrap();
    // no tensors: required roles missing
    assert!(matches!(w.finish(tiny_manifest(tiny_arch(1, true))), Err(FormatError::MissingRole { .. })));
    assert!(temp_files(dir.path()).is_empty());
}

#[test]
fn open_1000_tensors_is_fast() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.thin");
    let arch = tiny_arch(199, true);
    let mut entries = tiny_entries(&arch);
    // 2 + 199*5 = 997 tensors, plus 3 extra ffn tensors = 1000
    for l in 0..3u32 {
        entries.push(entry(Role::FfnUp, Some(l), vec![4], DType::F32));
    }
    assert_eq!(entries.len(), 1000);
    let mut w = ArchiveWriter::create(&p).unwrap();
    for e in entries {
        let b = vec![0u8; e.dtype.bytes_for(e.shape.iter().product()).unwrap() as usize];
        w.add_tensor(e, &b).unwrap();
    }
    w.finish(tiny_manifest(arch)).unwrap();
    let _ = Archive::open(&p).unwrap();
    let t0 = std::time::Instant::now();
    let a = Archive::open(&p).unwrap();
    let dt = t0.elapsed();
    assert_eq!(a.manifest().tensors.len(), 1000);
    eprintln!("open of 1000-tensor archive: {dt:?}");
    assert!(dt < std::time::Duration::from_millis(if cfg!(debug_assertions) { 200 } else { 50 }), "{dt:?}");
}

#[test]
fn empty_tensor_and_bad_manifest_at_finish() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.thin");
    let arch = tiny_arch(1, true);
    let mut w = ArchiveWriter::create(&p).unwrap();
    for (i, e) in tiny_entries(&arch).into_iter().enumerate() {
        let b = tensor_bytes(&e, i as f32);
        w.add_tensor(e, &b).unwrap();
    }
    w.add_tensor(entry(Role::FfnUp, Some(0), vec![0, 16], DType::F32), &[]).unwrap();
    w.finish(tiny_manifest(arch.clone())).unwrap();
    let a = Archive::open(&p).unwrap();
    assert!(a.tensor_f32(Role::FfnUp, Some(0)).unwrap().is_empty());
    a.verify().unwrap();

    let q = dir.path().join("bad.thin");
    let mut w = ArchiveWriter::create(&q).unwrap();
    for (i, e) in tiny_entries(&arch).into_iter().enumerate() {
        let b = tensor_bytes(&e, i as f32);
        w.add_tensor(e, &b).unwrap();
    }
    let mut m = tiny_manifest(arch);
    m.shape_fingerprint = "x".into();
    assert!(matches!(w.finish(m), Err(FormatError::FingerprintMismatch { .. })));
    assert!(!q.exists());
    assert_eq!(temp_files(dir.path()), vec!["m.thin".to_string()]);
}
