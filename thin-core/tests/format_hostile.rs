//! Hostile archives: each test crafts one defect and asserts the specific typed error.

use std::path::PathBuf;

use thin_core::format::testkit::{rebuild, set_header, split, write_tiny, Parts};
use thin_core::format::{Archive, FormatError, Header, HEADER_LEN, PAGE_ALIGN, PAGE_ENTRY_LEN};
use thin_core::manifest::Manifest;

struct Base {
    _dir: tempfile::TempDir,
    path: PathBuf,
    bytes: Vec<u8>,
}

fn base() -> Base {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("base.thin");
    write_tiny(&path, 2, false, None).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    Base { _dir: dir, path, bytes }
}

impl Base {
    fn header(&self) -> Header {
        Header::parse(&self.bytes).unwrap()
    }
    fn open(&self, bytes: &[u8]) -> Result<Archive, FormatError> {
        std::fs::write(&self.path, bytes).unwrap();
        Archive::open(&self.path)
    }
    fn open_truncated(&self, len: u64) -> FormatError {
        self.open(&self.bytes[..len as usize]).err().expect("truncated archive opened")
    }
    fn with_header(&self, f: impl FnOnce(&mut Header)) -> FormatError {
        let mut h = self.header();
        f(&mut h);
        let mut b = self.bytes.clone();
        set_header(&mut b, &h);
        self.open(&b).err().expect("hostile header accepted")
    }
    /// Rewrites page table and/or manifest (archive hash recomputed).
    fn with_parts(&self, f: impl FnOnce(&mut Parts)) -> Result<Archive, FormatError> {
        let mut p = split(&self.bytes);
        f(&mut p);
        let json = serde_json::to_vec(&p.manifest).unwrap();
        let b = rebuild(&self.bytes, &p.header, &p.pages, &json);
        self.open(&b)
    }
    fn with_manifest(&self, f: impl FnOnce(&mut Manifest)) -> Result<Archive, FormatError> {
        self.with_parts(|p| {
            let mut m: Manifest = serde_json::from_value(p.manifest.clone()).unwrap();
            f(&mut m);
            p.manifest = serde_json::to_value(&m).unwrap();
        })
    }
}

fn tensor_index(m: &Manifest, name: &str) -> usize {
    m.tensors.iter().position(|t| t.name == name).unwrap()
}

#[test]
fn base_is_valid() {
    let b = base();
    let a = b.open(&b.bytes.clone()).unwrap();
    a.verify().unwrap();
}

#[test]
fn empty_file() {
    let b = base();
    assert!(matches!(b.open_truncated(0), FormatError::Truncated { what: "header", need: 88, have: 0 }));
}

#[test]
fn truncated_inside_header() {
    let b = base();
    assert!(matches!(b.open_truncated(40), FormatError::Truncated { what: "header", have: 40, .. }));
}

#[test]
fn truncated_at_header_len_minus_1() {
    let b = base();
    let e = b.open_truncated(HEADER_LEN as u64 - 1);
    assert!(matches!(e, FormatError::Truncated { what: "header", need: 88, have: 87 }), "{e:?}");
}

#[test]
fn truncated_at_header_end() {
    let b = base();
    let e = b.open_truncated(HEADER_LEN as u64);
    assert!(matches!(e, FormatError::Truncated { what: "header padding", have: 88, .. }), "{e:?}");
}

#[test]
fn truncated_at_data_start() {
    let b = base();
    let e = b.open_truncated(PAGE_ALIGN);
    assert!(matches!(e, FormatError::Truncated { what: "data", .. }), "{e:?}");
}

#[test]
fn truncated_inside_data() {
    let b = base();
    let e = b.open_truncated(PAGE_ALIGN + 1000);
    let need = b.bytes.len() as u64;
    assert!(matches!(e, FormatError::Truncated { what: "data", need: n, have: 5096 } if n == need), "{e:?}");
}

#[test]
fn truncated_at_page_table_start() {
    let b = base();
    let e = b.open_truncated(b.header().page_table_off);
    assert!(matches!(e, FormatError::Truncated { what: "page table", .. }), "{e:?}");
}

#[test]
fn truncated_inside_page_table() {
    let b = base();
    let e = b.open_truncated(b.header().page_table_off + PAGE_ENTRY_LEN + 3);
    assert!(matches!(e, FormatError::Truncated { what: "page table", .. }), "{e:?}");
}

#[test]
fn truncated_at_manifest_start() {
    let b = base();
    let e = b.open_truncated(b.header().manifest_off);
    assert!(matches!(e, FormatError::Truncated { what: "manifest", .. }), "{e:?}");
}

#[test]
fn truncated_one_byte_short() {
    let b = base();
    let e = b.open_truncated(b.bytes.len() as u64 - 1);
    assert!(matches!(e, FormatError::Truncated { what: "manifest", .. }), "{e:?}");
}

#[test]
fn trailing_bytes() {
    let b = base();
    let mut v = b.bytes.clone();
    v.extend_from_slice(&[0u8; 10]);
    let e = b.open(&v).err().unwrap();
    assert!(matches!(e, FormatError::TrailingBytes { .. }), "{e:?}");
}

#[test]
fn bad_magic() {
    let b = base();
    let mut v = b.bytes.clone();
    v[0] = b'X';
    let e = b.open(&v).err().unwrap();
    assert!(matches!(e, FormatError::BadMagic { found } if &found[..5] == b"XHINv"), "{e:?}");
}

#[test]
fn unknown_version() {
    let b = base();
    let e = b.with_header(|h| h.version = 7);
    assert!(matches!(e, FormatError::UnsupportedVersion(7)), "{e:?}");
}

#[test]
fn header_len_mismatch() {
    let b = base();
    let e = b.with_header(|h| h.header_len = 96);
    assert!(matches!(e, FormatError::HeaderLen { found: 96 }), "{e:?}");
    let e = b.with_header(|h| h.header_len = 87);
    assert!(matches!(e, FormatError::HeaderLen { found: 87 }), "{e:?}");
}

#[test]
fn manifest_off_past_eof() {
    let b = base();
    let len = b.bytes.len() as u64;
    let e = b.with_header(|h| h.manifest_off = len + 10);
    assert!(matches!(e, FormatError::OutOfBounds { field: "manifest", .. }), "{e:?}");
}

#[test]
fn page_table_off_past_eof() {
    let b = base();
    let len = b.bytes.len() as u64;
    let e = b.with_header(|h| h.page_table_off = len + 64);
    assert!(matches!(e, FormatError::OutOfBounds { field: "page_table", .. }), "{e:?}");
}

#[test]
fn data_off_past_eof() {
    let b = base();
    let len = b.bytes.len() as u64;
    let e = b.with_header(|h| h.data_off = len + PAGE_ALIGN);
    assert!(matches!(e, FormatError::OutOfBounds { field: "data_off", .. }), "{e:?}");
}

#[test]
fn manifest_len_past_eof_reads_as_truncation() {
    // The writer's canonical layout with a longer manifest is indistinguishable from a cut file.
    let b = base();
    let e = b.with_header(|h| h.manifest_len += 100);
    assert!(matches!(e, FormatError::Truncated { what: "manifest", .. }), "{e:?}");
}

#[test]
fn manifest_len_huge() {
    let b = base();
    let e = b.with_header(|h| h.manifest_len = u64::MAX - 3);
    assert!(matches!(e, FormatError::TooLarge { field: "manifest_len", .. }), "{e:?}");
    let e = b.with_header(|h| h.manifest_len = 1 << 40);
    assert!(matches!(e, FormatError::TooLarge { field: "manifest_len", .. }), "{e:?}");
}

#[test]
fn page_count_huge() {
    let b = base();
    let e = b.with_header(|h| h.page_count = u64::MAX);
    assert!(matches!(e, FormatError::TooLarge { field: "page_count", .. }), "{e:?}");
    let len = b.bytes.len() as u64;
    let e = b.with_header(|h| h.page_count = 1 << 20);
    assert!(
        matches!(e, FormatError::TooLarge { field: "page_count", value, max } if value == 1 << 20 && max == len / 64),
        "{e:?}"
    );
}

#[test]
fn offsets_overflow() {
    let b = base();
    let e = b.with_header(|h| h.manifest_off = u64::MAX - 5);
    assert!(matches!(e, FormatError::Overflow { field: "manifest_off" }), "{e:?}");
    let e = b.with_header(|h| h.page_table_off = u64::MAX - 5);
    assert!(matches!(e, FormatError::Overflow { field: "page_table_off" }), "{e:?}");
}

#[test]
fn data_off_misaligned() {
    let b = base();
    let e = b.with_header(|h| h.data_off = 100);
    assert!(matches!(e, FormatError::Layout { field: "data_off", .. }), "{e:?}");
}

#[test]
fn page_table_before_data() {
    let b = base();
    let pt = b.header().page_table_off;
    let e = b.with_header(|h| h.data_off = (pt / PAGE_ALIGN + 1) * PAGE_ALIGN);
    assert!(matches!(e, FormatError::Layout { field: "page_table_off", .. }), "{e:?}");
}

#[test]
fn archive_hash_mismatch_header() {
    let b = base();
    let e = b.with_header(|h| h.archive_hash[5] ^= 1);
    assert!(matches!(e, FormatError::ArchiveHash), "{e:?}");
}

#[test]
fn archive_hash_mismatch_manifest_byte() {
    let b = base();
    let mut v = b.bytes.clone();
    let m = b.header().manifest_off as usize;
    v[m + 20] ^= 0x20;
    let e = b.open(&v).err().unwrap();
    assert!(matches!(e, FormatError::ArchiveHash), "{e:?}");
}

#[test]
fn archive_hash_mismatch_page_table_byte() {
    let b = base();
    let mut v = b.bytes.clone();
    let p = b.header().page_table_off as usize;
    v[p + 40] ^= 1;
    let e = b.open(&v).err().unwrap();
    assert!(matches!(e, FormatError::ArchiveHash), "{e:?}");
}

#[test]
fn page_checksum_mismatch_names_page_and_tensor() {
    let b = base();
    let a = b.open(&b.bytes.clone()).unwrap();
    let t = a.manifest().tensors[tensor_index(a.manifest(), "blk.1.attn_v")].clone();
    let page = t.first_page as u64;
    let off = a.pages()[page as usize].offset as usize;
    drop(a);
    let mut v = b.bytes.clone();
    v[off + 3] ^= 0xff;
    let a = b.open(&v).unwrap(); // open does not hash pages
    let e = a.verify().err().unwrap();
    let p = &a.pages()[page as usize];
    let expected = blake3::Hash::from(p.blake3).to_hex().to_string();
    let found = blake3::hash(&v[off..off + p.stored_size as usize]).to_hex().to_string();
    assert_ne!(expected, found);
    assert!(
        matches!(&e, FormatError::PageChecksum { page: p, tensor, expected: x, found: f }
            if *p == page && tensor == "blk.1.attn_v" && *x == expected && *f == found),
        "{e:?}"
    );
    assert_eq!(e.to_string(), format!("page {page} of tensor blk.1.attn_v is damaged: its bytes hash to blake3 {found}, the page table records {expected}"));
}

/// The check `run` makes while it loads: the whole archive's pages hashed on their own thread,
/// the same error as `verify` for a damaged page.
#[test]
fn the_background_page_check_covers_every_page_and_names_a_damaged_one() {
    let b = base();
    let (a, check) = Archive::open_checking_pages(&b.path).unwrap();
    let r = check.wait().unwrap();
    assert_eq!(r.pages, a.pages().len() as u64);
    assert_eq!(r.bytes, a.pages().iter().map(|p| p.stored_size).sum::<u64>());
    let last = a.pages().len() - 1;
    let (off, len) = (a.pages()[last].offset as usize, a.pages()[last].stored_size as usize);
    let expected = blake3::Hash::from(a.pages()[last].blake3).to_hex().to_string();
    let owner = a.manifest().tensors.iter().find(|t| t.first_page as usize <= last && last < (t.first_page + t.page_count) as usize).unwrap().name.clone();
    drop(a);
    let mut v = b.bytes.clone();
    v[off + len - 1] ^= 0x01;
    std::fs::write(&b.path, &v).unwrap();
    let (_a, check) = Archive::open_checking_pages(&b.path).unwrap();
    let e = check.wait().err().unwrap();
    let found = blake3::hash(&v[off..off + len]).to_hex().to_string();
    assert!(
        matches!(&e, FormatError::PageChecksum { page, tensor, expected: x, found: f }
            if *page == last as u64 && *tensor == owner && *x == expected && *f == found),
        "{e:?}"
    );
    // Dropped unwaited: the thread stops by itself, nothing blocks.
    let (_a, check) = Archive::open_checking_pages(&b.path).unwrap();
    drop(check);
}

#[test]
fn tensor_checksum_mismatch() {
    let b = base();
    let a = b
        .with_manifest(|m| {
            m.validation.tensor_blake3.insert("blk.0.attn_q".into(), "00".repeat(32));
        })
        .unwrap();
    let e = a.verify().err().unwrap();
    assert!(matches!(&e, FormatError::TensorChecksum { tensor } if tensor == "blk.0.attn_q"), "{e:?}");
}

#[test]
fn overlapping_pages() {
    let b = base();
    let e = b.with_parts(|p| p.pages[1].offset = p.pages[0].offset).err().unwrap();
    assert!(matches!(e, FormatError::PageOverlap { a: 0, b: 1 }), "{e:?}");
}

#[test]
fn misaligned_page() {
    let b = base();
    let e = b.with_parts(|p| p.pages[2].offset += 8).err().unwrap();
    assert!(matches!(e, FormatError::PageMisaligned { page: 2 }), "{e:?}");
}

#[test]
fn page_outside_data_region() {
    let b = base();
    let e = b.with_parts(|p| p.pages[3].offset = 0).err().unwrap();
    assert!(matches!(e, FormatError::PageOutOfBounds { page: 3, .. }), "{e:?}");
    let e = b.with_parts(|p| p.pages[3].stored_size = 1 << 30).err().unwrap();
    assert!(matches!(e, FormatError::PageOutOfBounds { page: 3, .. }), "{e:?}");
    let e = b.with_parts(|p| p.pages[3].stored_size = u64::MAX).err().unwrap();
    assert!(matches!(e, FormatError::Overflow { .. }), "{e:?}");
}

#[test]
fn page_id_mismatch() {
    let b = base();
    let e = b.with_parts(|p| p.pages[4].page_id = 9).err().unwrap();
    assert!(matches!(e, FormatError::PageId { index: 4, found: 9 }), "{e:?}");
}

#[test]
fn page_flags_and_sizes() {
    let b = base();
    let e = b.with_parts(|p| p.pages[1].flags = 1).err().unwrap();
    assert!(matches!(e, FormatError::PageFlags { page: 1, flags: 1 }), "{e:?}");
    let e = b.with_parts(|p| p.pages[1].raw_size += 4).err().unwrap();
    assert!(matches!(e, FormatError::PageSize { page: 1, .. }), "{e:?}");
}

#[test]
fn overflowing_shape_product() {
    let b = base();
    let e = b.with_manifest(|m| m.tensors[1].shape = vec![u64::MAX / 2, 3]).err().unwrap();
    assert!(matches!(e, FormatError::BadShape { .. }), "{e:?}");
    // element count fits but byte size overflows
    let e = b.with_manifest(|m| m.tensors[0].shape = vec![1 << 62, 1]).err().unwrap();
    assert!(matches!(e, FormatError::BadShape { .. }), "{e:?}");
}

#[test]
fn manifest_byte_len_disagrees() {
    let b = base();
    let e = b.with_manifest(|m| m.tensors[2].byte_len += 2).err().unwrap();
    assert!(matches!(e, FormatError::ManifestPageMismatch { .. }), "{e:?}");
}

#[test]
fn manifest_shape_disagrees_with_pages() {
    let b = base();
    let e = b.with_manifest(|m| {
        m.tensors[2].shape[0] += 1;
        let n: u64 = m.tensors[2].shape.iter().product();
        m.tensors[2].byte_len = m.tensors[2].dtype.bytes_for(n).unwrap();
    });
    let e = e.err().unwrap();
    assert!(matches!(e, FormatError::ManifestPageMismatch { .. }), "{e:?}");
}

#[test]
fn manifest_page_range_past_table() {
    let b = base();
    let e = b.with_manifest(|m| m.tensors[0].first_page = 1000).err().unwrap();
    assert!(matches!(&e, FormatError::ManifestPageMismatch { tensor, .. } if tensor == "token_embd"), "{e:?}");
    let e = b.with_manifest(|m| m.tensors[0].first_page = u32::MAX).err().unwrap();
    assert!(matches!(e, FormatError::ManifestPageMismatch { .. }), "{e:?}");
}

#[test]
fn page_owned_twice() {
    let b = base();
    // blk.0.attn_norm and output_norm have the same size; point the first at the second's page
    let e = b
        .with_manifest(|m| {
            let on = tensor_index(m, "output_norm");
            let an = tensor_index(m, "blk.0.attn_norm");
            m.tensors[an].first_page = m.tensors[on].first_page;
        })
        .err()
        .unwrap();
    assert!(matches!(&e, FormatError::ManifestPageMismatch { reason, .. } if reason.contains("also owned")), "{e:?}");
}

#[test]
fn duplicate_tensor_names() {
    let b = base();
    let e = b.with_manifest(|m| m.tensors[3].name = m.tensors[2].name.clone()).err().unwrap();
    assert!(matches!(&e, FormatError::DuplicateTensor(n) if n == "blk.0.attn_q"), "{e:?}");
}

#[test]
fn missing_required_role() {
    let b = base();
    let e = b
        .with_manifest(|m| {
            let i = tensor_index(m, "blk.1.attn_v");
            let t = m.tensors.remove(i);
            m.validation.tensor_blake3.remove(&t.name);
            m.validation.tensor_count -= 1;
        })
        .err()
        .unwrap();
    assert!(matches!(&e, FormatError::MissingRole { role } if role == "blk.1.attn_v"), "{e:?}");
}

#[test]
fn missing_lm_head_when_untied() {
    let b = base();
    let e = b.with_manifest(|m| {
        let i = tensor_index(m, "lm_head");
        m.tensors.remove(i);
    });
    let e = e.err().unwrap();
    assert!(matches!(&e, FormatError::MissingRole { role } if role == "lm_head"), "{e:?}");
}

#[test]
fn fingerprint_mismatch() {
    let b = base();
    let e = b.with_manifest(|m| m.shape_fingerprint = "0".repeat(64)).err().unwrap();
    assert!(matches!(e, FormatError::FingerprintMismatch { .. }), "{e:?}");
    // arch changed without updating the fingerprint
    let e = b.with_manifest(|m| m.arch.dims.hidden_size = 17).err().unwrap();
    assert!(matches!(e, FormatError::FingerprintMismatch { .. }), "{e:?}");
}

#[test]
fn huge_num_layers_is_cheap() {
    let b = base();
    let e = b
        .with_manifest(|m| {
            m.arch.dims.num_layers = u64::MAX;
            m.shape_fingerprint = m.arch.shape_fingerprint();
        })
        .err()
        .unwrap();
    assert!(matches!(&e, FormatError::MissingRole { role } if role == "blk.2.attn_norm"), "{e:?}");
}

#[test]
fn layer_past_num_layers() {
    let b = base();
    let e = b.with_manifest(|m| m.tensors[1].layer = Some(5)).err().unwrap();
    assert!(matches!(e, FormatError::BadLayer { layer: 5, .. }), "{e:?}");
}

#[test]
fn wrong_manifest_format() {
    let b = base();
    let e = b.with_manifest(|m| m.format = "thin-manifest/9".into()).err().unwrap();
    assert!(matches!(e, FormatError::ManifestFormat { .. }), "{e:?}");
}

#[test]
fn manifest_not_json() {
    let b = base();
    let p = split(&b.bytes);
    let v = rebuild(&b.bytes, &p.header, &p.pages, b"{\"format\": ");
    let e = b.open(&v).err().unwrap();
    assert!(matches!(e, FormatError::ManifestJson(_)), "{e:?}");
    let e = b.with_parts(|p| p.manifest["tensors"] = serde_json::json!(7)).err().unwrap();
    assert!(matches!(e, FormatError::ManifestJson(_)), "{e:?}");
}

#[test]
fn validation_counts_disagree() {
    let b = base();
    let e = b.with_manifest(|m| m.validation.tensor_count += 1).err().unwrap();
    assert!(matches!(e, FormatError::Validation(_)), "{e:?}");
    let e = b.with_manifest(|m| m.validation.parameter_count += 1).err().unwrap();
    assert!(matches!(e, FormatError::Validation(_)), "{e:?}");
}

#[test]
fn tensor_bytes_rejects_foreign_entry() {
    let b = base();
    let a = b.open(&b.bytes.clone()).unwrap();
    let mut t = a.manifest().tensors[0].clone();
    t.first_page = u32::MAX;
    t.page_count = u32::MAX;
    assert!(a.tensor_bytes(&t).is_err());
    let mut t = a.manifest().tensors[0].clone();
    t.byte_len = u64::MAX;
    assert!(a.tensor_bytes(&t).is_err());
}

#[test]
fn nonzero_padding_fails_verify() {
    let b = base();
    let mut v = b.bytes.clone();
    v[200] = 1; // header padding
    let a = b.open(&v).unwrap();
    assert!(matches!(a.verify(), Err(FormatError::NonZeroPadding { offset: 200 })));
    drop(a);
    let mut v = b.bytes.clone();
    let pt = b.header().page_table_off as usize;
    v[pt - 1] = 9; // tail of the last page's 4 KiB slot / gap before the page table
    let a = b.open(&v).unwrap();
    let e = a.verify().err().unwrap();
    assert!(matches!(e, FormatError::NonZeroPadding { .. } | FormatError::PageChecksum { .. }), "{e:?}");
}

#[test]
fn expert_dims_must_agree_with_the_routing_config() {
    let b = base();
    let refit = |m: &mut Manifest| m.shape_fingerprint = m.arch.shape_fingerprint();
    // Routing config on a dense shape.
    let e = b.with_manifest(|m| m.arch.moe = Some(thin_core::arch::MoeConfig { norm_topk_prob: true })).err().unwrap();
    assert!(matches!(&e, FormatError::Validation(s) if s.contains("num_experts 0 and top_k 0")), "{e}");
    // Experts without a routing config, and top_k past the expert count.
    let e = b
        .with_manifest(|m| {
            m.arch.dims.num_experts = 4;
            m.arch.dims.top_k = 2;
            refit(m);
        })
        .err()
        .unwrap();
    assert!(matches!(&e, FormatError::Validation(s) if s.contains("(absent)")), "{e}");
    let e = b
        .with_manifest(|m| {
            m.arch.dims.num_experts = 4;
            m.arch.dims.top_k = 5;
            m.arch.moe = Some(thin_core::arch::MoeConfig { norm_topk_prob: false });
            refit(m);
        })
        .err()
        .unwrap();
    assert!(matches!(&e, FormatError::Validation(s) if s.contains("top_k 5")), "{e}");
}

#[test]
fn manifest_keeps_the_dims_at_the_top_level_of_arch() {
    // The manifest JSON of `arch` is flat: `ShapeDims` is flattened into it.
    let b = base();
    let p = split(&b.bytes);
    let arch = &p.manifest["arch"];
    for key in ["family", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "num_experts", "top_k", "tie_word_embeddings", "rms_norm_eps"] {
        assert!(arch.get(key).is_some(), "arch.{key} missing in {arch}");
    }
    assert!(arch.get("dims").is_none());
}
