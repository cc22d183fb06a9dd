//! The `.thin` v0 archive: header, page table, manifest; the streaming writer, the mmap reader and the verifier.
//!
//! Layout: header (88 bytes, little endian) | zero pad to [`PAGE_ALIGN`] = `data_off` | data pages
//! (every page offset a multiple of [`PAGE_ALIGN`]) | pad to 8 | page table (64-byte entries) |
//! manifest JSON (ends the file).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use rayon::prelude::*;

use crate::dtype::DType;
use crate::manifest::{Manifest, TensorEntry, MANIFEST_FORMAT};
use crate::role::Role;
use crate::engine::WeightView;
use crate::tokenizer::{TextTokenizer, TokenizerError};
use crate::weight_format::{ScaleKind, WeightLayout};

#[doc(hidden)]
pub mod testkit;

pub const MAGIC: [u8; 8] = *b"THINv0\0\0";
pub const HEADER_LEN: u32 = 88;
pub const VERSION: u32 = 0;
pub const PAGE_ALIGN: u64 = 4096;
pub const DEFAULT_MAX_PAGE_SIZE: u64 = 64 << 20;
pub const PAGE_ENTRY_LEN: u64 = 64;
/// Largest manifest a reader accepts.
pub const MAX_MANIFEST_LEN: u64 = 256 << 20;
/// Page ids are u32.
pub const MAX_PAGE_COUNT: u64 = u32::MAX as u64;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub header_len: u32,
    pub version: u32,
    pub manifest_off: u64,
    pub manifest_len: u64,
    pub page_table_off: u64,
    pub page_count: u64,
    pub data_off: u64,
    pub archive_hash: [u8; 32],
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageEntry {
    pub page_id: u32,
    pub flags: u32,
    pub offset: u64,
    pub stored_size: u64,
    pub raw_size: u64,
    pub blake3: [u8; 32],
}

#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("file truncated in the {what}: need {need} bytes, have {have}")]
    Truncated { what: &'static str, need: u64, have: u64 },
    #[error("bad magic {found:?}")]
    BadMagic { found: [u8; 8] },
    #[error("unsupported archive version {0}")]
    UnsupportedVersion(u32),
    #[error("header_len is {found}, expected {HEADER_LEN}")]
    HeaderLen { found: u32 },
    #[error("{field} out of bounds: offset {offset} len {len}, file is {file_len} bytes")]
    OutOfBounds { field: &'static str, offset: u64, len: u64, file_len: u64 },
    #[error("page {page} lies outside the data region [{data_start}, {data_end}): offset {offset} len {len}")]
    PageOutOfBounds { page: u64, offset: u64, len: u64, data_start: u64, data_end: u64 },
    #[error("arithmetic overflow computing {field}")]
    Overflow { field: &'static str },
    #[error("{field} is {value}, more than the limit {max}")]
    TooLarge { field: &'static str, value: u64, max: u64 },
    #[error("bad layout: {field}: {reason}")]
    Layout { field: &'static str, reason: String },
    #[error("file has {file_len} bytes but the archive ends at {expected}")]
    TrailingBytes { expected: u64, file_len: u64 },
    #[error("manifest JSON: {0}")]
    ManifestJson(String),
    #[error("manifest format is {found:?}, expected {MANIFEST_FORMAT:?}")]
    ManifestFormat { found: String },
    #[error("pages {a} and {b} overlap")]
    PageOverlap { a: u64, b: u64 },
    #[error("page {page} offset is not a multiple of {PAGE_ALIGN}")]
    PageMisaligned { page: u64 },
    #[error("page table entry {index} has page_id {found}")]
    PageId { index: u64, found: u32 },
    #[error("page {page} has flags {flags:#x}; v0 only knows 0 (raw)")]
    PageFlags { page: u64, flags: u32 },
    #[error("page {page}: stored_size {stored} != raw_size {raw} (v0 pages are raw)")]
    PageSize { page: u64, stored: u64, raw: u64 },
    #[error("page {page} belongs to no tensor")]
    OrphanPage { page: u64 },
    #[error("padding byte at offset {offset} is not zero")]
    NonZeroPadding { offset: u64 },
    #[error("archive hash mismatch (manifest or page table corrupted)")]
    ArchiveHash,
    #[error("page {page} of tensor {tensor} is damaged: its bytes hash to blake3 {found}, the page table records {expected}")]
    PageChecksum { page: u64, tensor: String, expected: String, found: String },
    #[error("tensor {tensor} checksum differs from the manifest's validation entry")]
    TensorChecksum { tensor: String },
    #[error("tensor {tensor}: manifest disagrees with page table: {reason}")]
    ManifestPageMismatch { tensor: String, reason: String },
    #[error("duplicate tensor {0}")]
    DuplicateTensor(String),
    #[error("missing required tensor {role}")]
    MissingRole { role: String },
    #[error("tensor {tensor}: bad shape: {reason}")]
    BadShape { tensor: String, reason: String },
    #[error("tensor {tensor}: layer {layer} is not below num_layers {num_layers}")]
    BadLayer { tensor: String, layer: u32, num_layers: u64 },
    #[error("shape fingerprint {found} does not match the arch's {expected}")]
    FingerprintMismatch { expected: String, found: String },
    #[error("manifest validation section: {0}")]
    Validation(String),
    #[error("no tensor {role} in the archive")]
    TensorNotFound { role: String },
    #[error("tensor {tensor} is {found:?}, asked for {expected:?}")]
    WrongDType { tensor: String, expected: DType, found: DType },
    #[error("tensor {tensor} has bad scales: {reason}")]
    BadScales { tensor: String, reason: String },
    #[error("tensor {tensor} bytes are not aligned for its element type")]
    Unaligned { tensor: String },
    #[error("max page size {0} is not a positive multiple of {PAGE_ALIGN}")]
    InvalidMaxPageSize(u64),
    #[error("unsupported platform: {0}")]
    UnsupportedPlatform(&'static str),
    #[error("checking the pages: {0}")]
    PageCheckThread(String),
    #[error("the archive's tokenizer or chat template: {0}")]
    Tokenizer(#[from] TokenizerError),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> FormatError + '_ {
    move |source| FormatError::Io { path: path.to_path_buf(), source }
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[off..off + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}

impl Header {
    pub fn to_bytes(&self) -> [u8; HEADER_LEN as usize] {
        let mut b = [0u8; HEADER_LEN as usize];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&self.header_len.to_le_bytes());
        b[12..16].copy_from_slice(&self.version.to_le_bytes());
        b[16..24].copy_from_slice(&self.manifest_off.to_le_bytes());
        b[24..32].copy_from_slice(&self.manifest_len.to_le_bytes());
        b[32..40].copy_from_slice(&self.page_table_off.to_le_bytes());
        b[40..48].copy_from_slice(&self.page_count.to_le_bytes());
        b[48..56].copy_from_slice(&self.data_off.to_le_bytes());
        b[56..88].copy_from_slice(&self.archive_hash);
        b
    }

    /// Decodes the fixed header and checks magic, header_len and version (nothing else).
    pub fn parse(b: &[u8]) -> Result<Header, FormatError> {
        if b.len() < HEADER_LEN as usize {
            return Err(FormatError::Truncated { what: "header", need: HEADER_LEN as u64, have: b.len() as u64 });
        }
        let mut magic = [0u8; 8];
        magic.copy_from_slice(&b[0..8]);
        if magic != MAGIC {
            return Err(FormatError::BadMagic { found: magic });
        }
        let header_len = u32_at(b, 8);
        if header_len != HEADER_LEN {
            return Err(FormatError::HeaderLen { found: header_len });
        }
        let version = u32_at(b, 12);
        if version != VERSION {
            return Err(FormatError::UnsupportedVersion(version));
        }
        let mut archive_hash = [0u8; 32];
        archive_hash.copy_from_slice(&b[56..88]);
        Ok(Header {
            header_len,
            version,
            manifest_off: u64_at(b, 16),
            manifest_len: u64_at(b, 24),
            page_table_off: u64_at(b, 32),
            page_count: u64_at(b, 40),
            data_off: u64_at(b, 48),
            archive_hash,
        })
    }
}

impl PageEntry {
    pub fn to_bytes(&self) -> [u8; PAGE_ENTRY_LEN as usize] {
        let mut b = [0u8; PAGE_ENTRY_LEN as usize];
        b[0..4].copy_from_slice(&self.page_id.to_le_bytes());
        b[4..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..16].copy_from_slice(&self.offset.to_le_bytes());
        b[16..24].copy_from_slice(&self.stored_size.to_le_bytes());
        b[24..32].copy_from_slice(&self.raw_size.to_le_bytes());
        b[32..64].copy_from_slice(&self.blake3);
        b
    }

    /// Decodes one 64-byte entry; `b` must hold at least 64 bytes.
    pub fn parse(b: &[u8]) -> Result<PageEntry, FormatError> {
        if b.len() < PAGE_ENTRY_LEN as usize {
            return Err(FormatError::Truncated { what: "page table", need: PAGE_ENTRY_LEN, have: b.len() as u64 });
        }
        let mut blake3 = [0u8; 32];
        blake3.copy_from_slice(&b[32..64]);
        Ok(PageEntry {
            page_id: u32_at(b, 0),
            flags: u32_at(b, 4),
            offset: u64_at(b, 8),
            stored_size: u64_at(b, 16),
            raw_size: u64_at(b, 24),
            blake3,
        })
    }
}

fn encode_page_table(pages: &[PageEntry]) -> Vec<u8> {
    let mut v = Vec::with_capacity(pages.len() * PAGE_ENTRY_LEN as usize);
    for p in pages {
        v.extend_from_slice(&p.to_bytes());
    }
    v
}

fn archive_hash(manifest: &[u8], page_table: &[u8]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(manifest);
    h.update(page_table);
    *h.finalize().as_bytes()
}

fn align_up(x: u64, a: u64) -> Result<u64, FormatError> {
    let r = x % a;
    if r == 0 {
        Ok(x)
    } else {
        x.checked_add(a - r).ok_or(FormatError::Overflow { field: "offset alignment" })
    }
}

fn shape_product(t: &TensorEntry) -> Result<u64, FormatError> {
    t.shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d)).ok_or_else(|| FormatError::BadShape {
        tensor: t.name.clone(),
        reason: format!("product of shape {:?} overflows u64", t.shape),
    })
}

/// The layout `t`'s storage type gives its shape, checked against the entry's block size and
/// scale sections; its `byte_len` is what the tensor's bytes must be.
fn expected_layout(t: &TensorEntry) -> Result<WeightLayout, FormatError> {
    let bad = |reason: String| FormatError::BadShape { tensor: t.name.clone(), reason };
    let postscale = t.dtype == DType::Mxfp4 && t.scales.iter().any(|s| s.kind == ScaleKind::Row);
    let l = WeightLayout::of(t.dtype, &t.shape, postscale).map_err(|e| bad(e.to_string()))?;
    if t.block_size != l.block_size {
        return Err(bad(format!("block_size {} but {} rows of {} values need {}", t.block_size, t.dtype.name(), l.cols, l.block_size)));
    }
    if t.scales != l.scales {
        return Err(bad(format!("scale sections {:?} but {} {:?} needs {:?}", t.scales, t.dtype.name(), t.shape, l.scales)));
    }
    Ok(l)
}

// ---------------------------------------------------------------------------------------------
// Writer

pub struct ArchiveWriter {
    file: Option<BufWriter<File>>,
    tmp_path: PathBuf,
    final_path: PathBuf,
    pos: u64,
    max_page_size: u64,
    pages: Vec<PageEntry>,
    entries: Vec<TensorEntry>,
    hashes: BTreeMap<String, String>,
    finished: bool,
}

/// Temporary archive files being written by this process: what an interrupt handler removes
/// ([`remove_unfinished_temporaries`]) so a killed convert leaves no partial file behind.
static UNFINISHED: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

fn unfinished() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    UNFINISHED.lock().unwrap_or_else(|e| e.into_inner())
}

/// Remove every temporary archive file this process is still writing (for a SIGINT/SIGTERM
/// handler, which then exits); returns them.
pub fn remove_unfinished_temporaries() -> Vec<PathBuf> {
    let paths = std::mem::take(&mut *unfinished());
    for p in &paths {
        let _ = std::fs::remove_file(p);
    }
    paths
}

/// Temporary files `<final_path>.tmp-<pid>` left beside `final_path` by writers that are gone (a
/// killed convert: its process no longer exists), removed; returns them. Linux: liveness from `/proc`.
pub fn remove_stale_temporaries(final_path: &Path) -> Vec<PathBuf> {
    let (Some(dir), Some(name)) = (final_path.parent(), final_path.file_name()) else { return Vec::new() };
    let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
    let prefix = format!("{}.tmp-", name.to_string_lossy());
    let Ok(rd) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut removed = Vec::new();
    for e in rd.flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = file.strip_prefix(&prefix).and_then(|p| p.parse::<u32>().ok()) else { continue };
        let alive = pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists();
        if !alive && std::fs::remove_file(e.path()).is_ok() {
            removed.push(e.path());
        }
    }
    removed
}

impl ArchiveWriter {
    /// Creates `<final_path>.tmp-<pid>` beside final_path, writes a zeroed header placeholder
    /// and pads to PAGE_ALIGN. The temporary file is removed if the writer is dropped unfinished.
    pub fn create(final_path: &Path) -> Result<Self, FormatError> {
        let mut name = final_path.as_os_str().to_owned();
        name.push(format!(".tmp-{}", std::process::id()));
        let tmp_path = PathBuf::from(name);
        let f = File::create(&tmp_path).map_err(io_err(&tmp_path))?;
        unfinished().push(tmp_path.clone());
        let mut w = ArchiveWriter {
            file: Some(BufWriter::with_capacity(1 << 20, f)),
            tmp_path,
            final_path: final_path.to_path_buf(),
            pos: 0,
            max_page_size: DEFAULT_MAX_PAGE_SIZE,
            pages: Vec::new(),
            entries: Vec::new(),
            hashes: BTreeMap::new(),
            finished: false,
        };
        w.write_zeros(PAGE_ALIGN)?;
        Ok(w)
    }

    /// For tests; `n` must be a positive multiple of PAGE_ALIGN (checked by `add_tensor`).
    pub fn with_max_page_size(mut self, n: u64) -> Self {
        self.max_page_size = n;
        self
    }

    fn write_all(&mut self, b: &[u8]) -> Result<(), FormatError> {
        let path = self.tmp_path.clone();
        let f = self.file.as_mut().ok_or_else(|| FormatError::Io {
            path: path.clone(),
            source: std::io::Error::other("writer already closed"),
        })?;
        f.write_all(b).map_err(io_err(&path))?;
        self.pos = self.pos.checked_add(b.len() as u64).ok_or(FormatError::Overflow { field: "file position" })?;
        Ok(())
    }

    fn write_zeros(&mut self, n: u64) -> Result<(), FormatError> {
        const Z: [u8; 4096] = [0u8; 4096];
        let mut left = n;
        while left > 0 {
            let k = left.min(Z.len() as u64);
            self.write_all(&Z[..k as usize])?;
            left -= k;
        }
        Ok(())
    }

    fn pad_to(&mut self, align: u64) -> Result<(), FormatError> {
        let target = align_up(self.pos, align)?;
        self.write_zeros(target - self.pos)
    }

    /// Appends the tensor's bytes as pages and fills entry.first_page/page_count/byte_len.
    pub fn add_tensor(&mut self, mut entry: TensorEntry, bytes: &[u8]) -> Result<(), FormatError> {
        if self.max_page_size == 0 || self.max_page_size % PAGE_ALIGN != 0 {
            return Err(FormatError::InvalidMaxPageSize(self.max_page_size));
        }
        let need = expected_layout(&entry)?.byte_len;
        if need != bytes.len() as u64 {
            return Err(FormatError::BadShape {
                tensor: entry.name.clone(),
                reason: format!("{need} bytes expected from shape {:?} {}, got {}", entry.shape, entry.dtype.name(), bytes.len()),
            });
        }
        if self.hashes.contains_key(&entry.name) {
            return Err(FormatError::DuplicateTensor(entry.name));
        }
        let first_page = u32::try_from(self.pages.len())
            .map_err(|_| FormatError::TooLarge { field: "page_count", value: self.pages.len() as u64, max: MAX_PAGE_COUNT })?;
        self.pad_to(PAGE_ALIGN)?;
        let mut count: u32 = 0;
        for chunk in bytes.chunks(self.max_page_size as usize) {
            let page_id = u32::try_from(self.pages.len())
                .map_err(|_| FormatError::TooLarge { field: "page_count", value: self.pages.len() as u64, max: MAX_PAGE_COUNT })?;
            let offset = self.pos;
            self.write_all(chunk)?;
            self.pages.push(PageEntry {
                page_id,
                flags: 0,
                offset,
                stored_size: chunk.len() as u64,
                raw_size: chunk.len() as u64,
                blake3: *blake3::hash(chunk).as_bytes(),
            });
            count = count.checked_add(1).ok_or(FormatError::Overflow { field: "tensor page_count" })?;
        }
        let mut h = blake3::Hasher::new();
        if bytes.len() >= 1 << 20 {
            h.update_rayon(bytes);
        } else {
            h.update(bytes);
        }
        self.hashes.insert(entry.name.clone(), h.finalize().to_hex().to_string());
        entry.first_page = first_page;
        entry.page_count = count;
        entry.byte_len = need;
        self.entries.push(entry);
        Ok(())
    }

    /// Fills the manifest's tensors, validation and backend hints, validates, writes page table,
    /// manifest and header, fsyncs and renames to the final path.
    pub fn finish(mut self, mut manifest: Manifest) -> Result<PathBuf, FormatError> {
        let mut params: u64 = 0;
        for t in &self.entries {
            params = params.checked_add(shape_product(t)?).ok_or(FormatError::Overflow { field: "parameter_count" })?;
        }
        manifest.tensors = std::mem::take(&mut self.entries);
        manifest.validation.tensor_count = manifest.tensors.len() as u64;
        manifest.validation.parameter_count = params;
        manifest.validation.tensor_blake3 = std::mem::take(&mut self.hashes);
        manifest.backend_hints.alignment = PAGE_ALIGN;
        manifest.backend_hints.max_page_size = self.max_page_size;
        validate_manifest(&manifest, &self.pages)?;

        self.pad_to(8)?;
        let data_end = self.pos;
        let page_table = encode_page_table(&self.pages);
        let json = serde_json::to_vec(&manifest).map_err(|e| FormatError::ManifestJson(e.to_string()))?;
        let page_table_off = data_end;
        self.write_all(&page_table)?;
        let manifest_off = self.pos;
        self.write_all(&json)?;
        let header = Header {
            header_len: HEADER_LEN,
            version: VERSION,
            manifest_off,
            manifest_len: json.len() as u64,
            page_table_off,
            page_count: self.pages.len() as u64,
            data_off: PAGE_ALIGN,
            archive_hash: archive_hash(&json, &page_table),
        };
        let path = self.tmp_path.clone();
        let bw = self.file.take().ok_or_else(|| FormatError::Io {
            path: path.clone(),
            source: std::io::Error::other("writer already closed"),
        })?;
        let mut f = bw.into_inner().map_err(|e| FormatError::Io { path: path.clone(), source: e.into_error() })?;
        f.seek(SeekFrom::Start(0)).map_err(io_err(&path))?;
        f.write_all(&header.to_bytes()).map_err(io_err(&path))?;
        f.sync_all().map_err(io_err(&path))?;
        drop(f);
        std::fs::rename(&self.tmp_path, &self.final_path).map_err(io_err(&self.final_path))?;
        self.finished = true;
        unfinished().retain(|p| p != &self.tmp_path);
        #[cfg(unix)]
        if let Some(dir) = self.final_path.parent() {
            let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(self.final_path.clone())
    }
}

impl Drop for ArchiveWriter {
    fn drop(&mut self) {
        if !self.finished {
            self.file.take();
            let _ = std::fs::remove_file(&self.tmp_path);
            unfinished().retain(|p| p != &self.tmp_path);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Reader

pub struct Archive {
    /// Shared with a [`PageCheck`] hashing the pages on its own thread.
    mmap: std::sync::Arc<memmap2::Mmap>,
    header: Header,
    manifest: Manifest,
    pages: Vec<PageEntry>,
    file_len: u64,
    /// The embedded tokenizer, loaded and exercised at open.
    tokenizer: std::sync::Arc<TextTokenizer>,
}

pub struct VerifyReport {
    pub pages: u64,
    pub bytes: u64,
    pub tensors: u64,
}

/// Checks the header's section offsets against the file length; returns (page table range, manifest range).
/// `(start, end)` byte range in the file.
type Span = (u64, u64);

fn check_layout(h: &Header, file_len: u64) -> Result<(Span, Span), FormatError> {
    if h.manifest_len > MAX_MANIFEST_LEN {
        return Err(FormatError::TooLarge { field: "manifest_len", value: h.manifest_len, max: MAX_MANIFEST_LEN });
    }
    if h.page_count > MAX_PAGE_COUNT {
        return Err(FormatError::TooLarge { field: "page_count", value: h.page_count, max: MAX_PAGE_COUNT });
    }
    let pt_len = h.page_count.checked_mul(PAGE_ENTRY_LEN).ok_or(FormatError::Overflow { field: "page_count" })?;
    let pt_end = h.page_table_off.checked_add(pt_len).ok_or(FormatError::Overflow { field: "page_table_off" })?;
    let m_end = h.manifest_off.checked_add(h.manifest_len).ok_or(FormatError::Overflow { field: "manifest_off" })?;
    // A header laid out the way the writer lays it out, on a file shorter than it claims: truncated.
    let canonical = h.data_off == PAGE_ALIGN && h.page_table_off >= h.data_off && h.manifest_off == pt_end;
    if canonical && m_end > file_len {
        let what = if file_len < h.data_off {
            "header padding"
        } else if file_len < h.page_table_off {
            "data"
        } else if file_len < pt_end {
            "page table"
        } else {
            "manifest"
        };
        return Err(FormatError::Truncated { what, need: m_end, have: file_len });
    }
    let max_pages = file_len / PAGE_ENTRY_LEN;
    if h.page_count > max_pages {
        return Err(FormatError::TooLarge { field: "page_count", value: h.page_count, max: max_pages });
    }
    if h.data_off > file_len {
        return Err(FormatError::OutOfBounds { field: "data_off", offset: h.data_off, len: 0, file_len });
    }
    if pt_end > file_len {
        return Err(FormatError::OutOfBounds { field: "page_table", offset: h.page_table_off, len: pt_len, file_len });
    }
    if m_end > file_len {
        return Err(FormatError::OutOfBounds { field: "manifest", offset: h.manifest_off, len: h.manifest_len, file_len });
    }
    if h.data_off < HEADER_LEN as u64 || h.data_off % PAGE_ALIGN != 0 {
        return Err(FormatError::Layout {
            field: "data_off",
            reason: format!("{} is not a multiple of {PAGE_ALIGN} past the header", h.data_off),
        });
    }
    if h.page_table_off < h.data_off {
        return Err(FormatError::Layout { field: "page_table_off", reason: "page table starts before the data region".into() });
    }
    if h.manifest_off < pt_end {
        return Err(FormatError::Layout { field: "manifest_off", reason: "manifest starts inside the page table".into() });
    }
    if m_end != file_len {
        return Err(FormatError::TrailingBytes { expected: m_end, file_len });
    }
    Ok(((h.page_table_off, pt_end), (h.manifest_off, m_end)))
}

/// Structural page checks: ids, alignment, bounds inside [data_off, data_end), no overlaps.
fn check_pages(pages: &[PageEntry], data_off: u64, data_end: u64) -> Result<(), FormatError> {
    for (i, p) in pages.iter().enumerate() {
        let i = i as u64;
        if p.page_id as u64 != i {
            return Err(FormatError::PageId { index: i, found: p.page_id });
        }
        if p.offset % PAGE_ALIGN != 0 {
            return Err(FormatError::PageMisaligned { page: i });
        }
        let end = p.offset.checked_add(p.stored_size).ok_or(FormatError::Overflow { field: "page offset + stored_size" })?;
        if p.offset < data_off || end > data_end {
            return Err(FormatError::PageOutOfBounds {
                page: i,
                offset: p.offset,
                len: p.stored_size,
                data_start: data_off,
                data_end,
            });
        }
    }
    let mut order: Vec<usize> = (0..pages.len()).collect();
    order.sort_by_key(|&i| (pages[i].offset, i));
    for w in order.windows(2) {
        let (a, b) = (&pages[w[0]], &pages[w[1]]);
        // ends were checked above
        let a_end = a.offset + a.stored_size;
        if a_end > b.offset || (a.offset == b.offset && (a.stored_size > 0 || b.stored_size > 0)) {
            let (x, y) = (w[0].min(w[1]) as u64, w[0].max(w[1]) as u64);
            return Err(FormatError::PageOverlap { a: x, b: y });
        }
    }
    Ok(())
}

/// Element types an archive's bytes are read as in place: every bit pattern is a valid value.
trait Pod {}
impl Pod for f32 {}
impl Pod for half::bf16 {}

/// Tensor `t`'s bytes as elements, zero-copy (pages are aligned; a misaligned one is an error).
fn elements<'a, T: Pod>(t: &TensorEntry, b: &'a [u8]) -> Result<&'a [T], FormatError> {
    // SAFETY: T is f32 or bf16 (a repr(transparent) u16), for which every bit pattern is valid;
    // align_to only yields the aligned middle part, and a non-empty remainder is refused.
    let (pre, mid, post) = unsafe { b.align_to::<T>() };
    if !pre.is_empty() || !post.is_empty() {
        return Err(FormatError::Unaligned { tensor: t.name.clone() });
    }
    Ok(mid)
}

/// Archives this large hash their pages on several threads; below it threads cost more than
/// they save.
const PARALLEL_HASH_BYTES: u64 = 8 << 20;

/// Each tensor's pages (`first_page..first_page + page_count`) and its name: who owns a page.
type PageOwners = Vec<(u64, u64, String)>;

fn page_owners(m: &Manifest) -> PageOwners {
    m.tensors.iter().map(|t| (t.first_page as u64, t.first_page as u64 + t.page_count as u64, t.name.clone())).collect()
}

fn owner_of(owners: &PageOwners, page: usize) -> String {
    let page = page as u64;
    owners.iter().find(|(first, end, _)| (*first..*end).contains(&page)).map_or_else(|| "<none>".to_string(), |(_, _, n)| n.clone())
}

/// The blake3 of every page against its page-table entry (pages in parallel on a large
/// archive, a large page's chunks too). The lowest damaged page is the error, named with its
/// tensor and both hashes. Returns the bytes hashed; once `stop` is set the pages left are
/// skipped (nobody waits for the answer any more).
fn check_page_hashes(data: &[u8], pages: &[PageEntry], owners: &PageOwners, stop: &AtomicBool) -> Result<u64, FormatError> {
    // `Some(found)` for a damaged page.
    let damaged = |p: &PageEntry| -> Option<String> {
        if stop.load(Ordering::Relaxed) {
            return None;
        }
        let bytes = usize::try_from(p.offset).ok().and_then(|s| Some(s..s.checked_add(usize::try_from(p.stored_size).ok()?)?)).and_then(|r| data.get(r));
        let Some(bytes) = bytes else { return Some("<outside the file>".into()) };
        let mut h = blake3::Hasher::new();
        if bytes.len() >= 1 << 20 {
            h.update_rayon(bytes);
        } else {
            h.update(bytes);
        }
        let found = h.finalize();
        (found.as_bytes() != &p.blake3).then(|| found.to_hex().to_string())
    };
    let total: u64 = pages.iter().map(|p| p.stored_size).sum();
    let bad = if total >= PARALLEL_HASH_BYTES {
        pages.par_iter().enumerate().find_map_first(|(i, p)| damaged(p).map(|f| (i, f)))
    } else {
        pages.iter().enumerate().find_map(|(i, p)| damaged(p).map(|f| (i, f)))
    };
    match bad {
        Some((i, found)) => Err(FormatError::PageChecksum {
            page: i as u64,
            tensor: owner_of(owners, i),
            expected: blake3::Hash::from(pages[i].blake3).to_hex().to_string(),
            found,
        }),
        None => Ok(total),
    }
}

/// What a finished page check covered.
#[derive(Debug, Clone, Copy)]
pub struct PagesChecked {
    pub pages: u64,
    pub bytes: u64,
    /// How long the hashing took on its thread.
    pub seconds: f64,
}

/// The blake3 check of every data page of an archive, running on a thread of its own
/// ([`Archive::open_checking_pages`]). Dropped without [`PageCheck::wait`], it stops at the next
/// page.
pub struct PageCheck {
    thread: std::thread::JoinHandle<Result<PagesChecked, FormatError>>,
    _stop_when_dropped: StopFlag,
}

/// Sets its flag when dropped.
struct StopFlag(Arc<AtomicBool>);

impl Drop for StopFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

impl PageCheck {
    fn start(path: &Path, mmap: Arc<memmap2::Mmap>, pages: Vec<PageEntry>, owners: PageOwners) -> Result<PageCheck, FormatError> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("thin-page-check".into())
            .spawn(move || {
                let start = Instant::now();
                let bytes = check_page_hashes(&mmap, &pages, &owners, &flag)?;
                Ok(PagesChecked { pages: pages.len() as u64, bytes, seconds: start.elapsed().as_secs_f64() })
            })
            .map_err(io_err(path))?;
        Ok(PageCheck { thread, _stop_when_dropped: StopFlag(stop) })
    }

    /// Blocks until every page is hashed: `Ok` when all match the page table, else the first
    /// damaged page ([`FormatError::PageChecksum`]).
    pub fn wait(self) -> Result<PagesChecked, FormatError> {
        self.thread.join().map_err(|p| FormatError::PageCheckThread(crate::tokenizer::panic_message(&*p)))?
    }
}

impl Archive {
    /// Reads and validates header, page table and manifest (no page hashing), and loads what the
    /// manifest embeds for other libraries: the tokenizer (parsed, a probe text encoded and
    /// decoded, every id decoded) and the chat template (rendered once), so an archive whose
    /// tokenizer or template fails, loops or crashes its library is refused here, by every command.
    pub fn open(path: &Path) -> Result<Archive, FormatError> {
        Archive::open_inner(path, false).map(|(a, _)| a)
    }

    /// [`Archive::open`], with the blake3 of every data page checked on a thread of its own
    /// from the moment the page table is trusted (its hash is the header's): the hashing runs
    /// while the tokenizer loads here and while the caller goes on (binding an engine,
    /// uploading weights). Nothing may compute from the pages before [`PageCheck::wait`] says
    /// they are whole.
    pub fn open_checking_pages(path: &Path) -> Result<(Archive, PageCheck), FormatError> {
        let (a, check) = Archive::open_inner(path, true)?;
        let check = check.ok_or(FormatError::PageCheckThread("no page check was started".into()))?;
        Ok((a, check))
    }

    fn open_inner(path: &Path, hash_pages: bool) -> Result<(Archive, Option<PageCheck>), FormatError> {
        if cfg!(target_endian = "big") {
            return Err(FormatError::UnsupportedPlatform("big-endian hosts cannot map archives zero-copy"));
        }
        let f = File::open(path).map_err(io_err(path))?;
        let file_len = f.metadata().map_err(io_err(path))?.len();
        if file_len < HEADER_LEN as u64 {
            return Err(FormatError::Truncated { what: "header", need: HEADER_LEN as u64, have: file_len });
        }
        // SAFETY: the archive is treated as immutable while mapped; callers must not modify it concurrently.
        let mmap = unsafe { memmap2::Mmap::map(&f) }.map_err(io_err(path))?;
        let file_len = mmap.len() as u64;
        let header = Header::parse(&mmap)?;
        let ((pt_off, pt_end), (m_off, m_end)) = check_layout(&header, file_len)?;
        // Ranges are inside the file (checked above), so these conversions and slices are in bounds.
        let pt_bytes = &mmap[pt_off as usize..pt_end as usize];
        let m_bytes = &mmap[m_off as usize..m_end as usize];
        if archive_hash(m_bytes, pt_bytes) != header.archive_hash {
            return Err(FormatError::ArchiveHash);
        }
        let mut pages = Vec::with_capacity(header.page_count as usize);
        for chunk in pt_bytes.chunks_exact(PAGE_ENTRY_LEN as usize) {
            pages.push(PageEntry::parse(chunk)?);
        }
        check_pages(&pages, header.data_off, header.page_table_off)?;
        let manifest: Manifest = serde_json::from_slice(m_bytes).map_err(|e| FormatError::ManifestJson(e.to_string()))?;
        validate_manifest(&manifest, &pages)?;
        let mmap = std::sync::Arc::new(mmap);
        let check = if hash_pages { Some(PageCheck::start(path, mmap.clone(), pages.clone(), page_owners(&manifest))?) } else { None };
        let tokenizer = TextTokenizer::from_info(&manifest.tokenizer)?;
        tokenizer.check_chat_template()?;
        Ok((Archive { mmap, header, manifest, pages, file_len, tokenizer: std::sync::Arc::new(tokenizer) }, check))
    }

    /// The embedded tokenizer (checked at open), shared.
    pub fn tokenizer(&self) -> &std::sync::Arc<TextTokenizer> {
        &self.tokenizer
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    pub fn pages(&self) -> &[PageEntry] {
        &self.pages
    }

    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    /// The tensor's bytes, zero-copy. `t` is checked against this archive's page table.
    pub fn tensor_bytes(&self, t: &TensorEntry) -> Result<&[u8], FormatError> {
        let mismatch = |reason: String| FormatError::ManifestPageMismatch { tensor: t.name.clone(), reason };
        let first = t.first_page as usize;
        let end = first.checked_add(t.page_count as usize).ok_or(FormatError::Overflow { field: "first_page + page_count" })?;
        if end > self.pages.len() {
            return Err(mismatch(format!("pages {first}..{end} past the page table ({} pages)", self.pages.len())));
        }
        if t.page_count == 0 {
            return if t.byte_len == 0 { Ok(&[]) } else { Err(mismatch("no pages but byte_len > 0".into())) };
        }
        let start = self.pages[first].offset;
        let stop = start.checked_add(t.byte_len).ok_or(FormatError::Overflow { field: "tensor offset + byte_len" })?;
        let last = &self.pages[end - 1];
        let last_end = last.offset.checked_add(last.raw_size).ok_or(FormatError::Overflow { field: "page end" })?;
        if stop != last_end {
            return Err(mismatch(format!("byte_len {} does not end at the last page's end", t.byte_len)));
        }
        if stop > self.file_len {
            return Err(FormatError::OutOfBounds { field: "tensor", offset: start, len: t.byte_len, file_len: self.file_len });
        }
        Ok(&self.mmap[start as usize..stop as usize])
    }

    fn typed_entry(&self, role: Role, layer: Option<u32>, dtype: DType) -> Result<(&TensorEntry, &[u8]), FormatError> {
        let t = self
            .manifest
            .tensor(role, layer)
            .ok_or_else(|| FormatError::TensorNotFound { role: role.tensor_name(layer) })?;
        if t.dtype != dtype {
            return Err(FormatError::WrongDType { tensor: t.name.clone(), expected: dtype, found: t.dtype });
        }
        Ok((t, self.tensor_bytes(t)?))
    }

    /// The manifest's tensor `index` in its stored format, zero-copy. Cheap (no allocation, no
    /// scan of the values): engines call it per op. [`Archive::check_tensor`] checks the scales.
    pub fn tensor_view(&self, index: usize) -> Result<WeightView<'_>, FormatError> {
        let t = self.manifest.tensors.get(index).ok_or(FormatError::TensorNotFound { role: format!("tensor #{index}") })?;
        let b = self.tensor_bytes(t)?;
        // Open checked that the sections are the layout's (in its order) and inside byte_len.
        let section = |i: usize| t.scales.get(i).map(|s| &b[s.offset as usize..(s.offset + s.byte_len()) as usize]);
        let missing = || FormatError::BadShape { tensor: t.name.clone(), reason: format!("{} without its scale section", t.dtype.name()) };
        let cols = t.shape.last().copied().unwrap_or(1) as usize;
        let values = &b[..t.dtype.bytes_for(t.shape.iter().product()).unwrap_or(0) as usize];
        Ok(match t.dtype {
            DType::F32 => WeightView::F32(elements(t, b)?),
            DType::Bf16 => WeightView::Bf16(elements(t, b)?),
            DType::F8E4m3 => WeightView::F8E4m3 { values, scales: elements(t, section(0).ok_or_else(missing)?)?, cols },
            DType::Mxfp4 => WeightView::Mxfp4 {
                values,
                scales: section(0).ok_or_else(missing)?,
                postscale: section(1).map(|s| elements(t, s)).transpose()?,
                cols,
            },
            DType::Q8_0 => WeightView::Q8_0 { blocks: values, cols },
            DType::Q4_1 => WeightView::Q4_1 { blocks: values, cols },
            DType::F16 => return Err(FormatError::WrongDType { tensor: t.name.clone(), expected: DType::Bf16, found: DType::F16 }),
        })
    }

    /// [`Archive::tensor_view`], with its scales checked: FP8 row scales finite and > 0, no NaN
    /// (0xff) MXFP4 exponent, MXFP4 postscales finite and > 0. Engines call it once per tensor, at load.
    pub fn check_tensor(&self, index: usize) -> Result<WeightView<'_>, FormatError> {
        let v = self.tensor_view(index)?;
        let t = &self.manifest.tensors[index];
        let bad = |e: crate::codecs::CodecError| FormatError::BadScales { tensor: t.name.clone(), reason: e.to_string() };
        match v {
            WeightView::F8E4m3 { scales, .. } => crate::codecs::fp8::check_scales(scales).map_err(bad)?,
            WeightView::Mxfp4 { scales, postscale, .. } => {
                crate::codecs::mxfp4::check_scales(scales, 0).map_err(bad)?;
                if let Some(p) = postscale {
                    crate::codecs::mxfp4::check_postscales(p).map_err(bad)?;
                }
            }
            WeightView::F32(_) | WeightView::Bf16(_) | WeightView::Q8_0 { .. } | WeightView::Q4_1 { .. } => {}
        }
        Ok(v)
    }

    /// F32 tensor by role and layer, zero-copy.
    pub fn tensor_f32(&self, role: Role, layer: Option<u32>) -> Result<&[f32], FormatError> {
        let (t, b) = self.typed_entry(role, layer, DType::F32)?;
        elements(t, b)
    }

    /// BF16 tensor by role and layer, zero-copy.
    pub fn tensor_bf16(&self, role: Role, layer: Option<u32>) -> Result<&[half::bf16], FormatError> {
        let (t, b) = self.typed_entry(role, layer, DType::Bf16)?;
        elements(t, b)
    }

    /// Hashes every page and every tensor and compares with the page table and the manifest.
    pub fn verify(&self) -> Result<VerifyReport, FormatError> {
        // Small archives: threads cost more than they save.
        let parallel = self.file_len >= PARALLEL_HASH_BYTES;
        check_page_hashes(&self.mmap, &self.pages, &page_owners(&self.manifest), &AtomicBool::new(false))?;
        let tensor_bad = |t: &&TensorEntry| -> bool {
            let Ok(b) = self.tensor_bytes(t) else { return true };
            let mut h = blake3::Hasher::new();
            if b.len() >= 1 << 20 {
                h.update_rayon(b);
            } else {
                h.update(b);
            }
            self.manifest.validation.tensor_blake3.get(&t.name).map(|s| s.as_str()) != Some(h.finalize().to_hex().as_str())
        };
        let bad_tensor = if parallel {
            self.manifest.tensors.par_iter().find_first(|t| tensor_bad(t))
        } else {
            self.manifest.tensors.iter().find(|t| tensor_bad(t))
        };
        if let Some(t) = bad_tensor {
            return Err(FormatError::TensorChecksum { tensor: t.name.clone() });
        }
        // Bytes no hash covers (header padding, page tails, gap before the page table) must be zero.
        let mut spans: Vec<(u64, u64)> = self.pages.iter().map(|p| (p.offset, p.offset.saturating_add(p.stored_size))).collect();
        spans.sort_unstable();
        let mut cursor = HEADER_LEN as u64;
        let gap_end = self.header.page_table_off;
        for (s, e) in spans.into_iter().chain(std::iter::once((gap_end, gap_end))) {
            if s > cursor {
                let gap = self.mmap.get(cursor as usize..s as usize).unwrap_or(&[]);
                if let Some(k) = gap.iter().position(|&b| b != 0) {
                    return Err(FormatError::NonZeroPadding { offset: cursor + k as u64 });
                }
            }
            cursor = cursor.max(e);
        }
        let mut bytes: u64 = 0;
        for p in &self.pages {
            bytes = bytes.checked_add(p.stored_size).ok_or(FormatError::Overflow { field: "total bytes" })?;
        }
        Ok(VerifyReport { pages: self.pages.len() as u64, bytes, tensors: self.manifest.tensors.len() as u64 })
    }
}

/// Manifest vs page table consistency (see the module docs and DESIGN.md).
pub fn validate_manifest(m: &Manifest, pages: &[PageEntry]) -> Result<(), FormatError> {
    if m.format != MANIFEST_FORMAT {
        return Err(FormatError::ManifestFormat { found: m.format.clone() });
    }
    let fp = m.arch.shape_fingerprint();
    if m.shape_fingerprint != fp {
        return Err(FormatError::FingerprintMismatch { expected: fp, found: m.shape_fingerprint.clone() });
    }
    let d = &m.arch.dims;
    if m.arch.moe.is_some() != (d.num_experts > 0) || d.top_k > d.num_experts || (d.num_experts > 0 && d.top_k == 0) {
        return Err(FormatError::Validation(format!(
            "num_experts {} and top_k {} do not agree with the routing config ({})",
            d.num_experts,
            d.top_k,
            if m.arch.moe.is_some() { "present" } else { "absent" }
        )));
    }
    for (i, p) in pages.iter().enumerate() {
        if p.flags != 0 {
            return Err(FormatError::PageFlags { page: i as u64, flags: p.flags });
        }
        if p.stored_size != p.raw_size {
            return Err(FormatError::PageSize { page: i as u64, stored: p.stored_size, raw: p.raw_size });
        }
    }
    let mut names: HashSet<&str> = HashSet::with_capacity(m.tensors.len());
    let mut by_role: HashMap<(Role, Option<u32>), &str> = HashMap::with_capacity(m.tensors.len());
    let mut owner: Vec<Option<&str>> = vec![None; pages.len()];
    let mut params: u64 = 0;
    for t in &m.tensors {
        if !names.insert(t.name.as_str()) {
            return Err(FormatError::DuplicateTensor(t.name.clone()));
        }
        by_role.entry((t.role, t.layer)).or_insert(t.name.as_str());
        if let Some(l) = t.layer {
            if l as u64 >= m.arch.dims.num_layers {
                return Err(FormatError::BadLayer { tensor: t.name.clone(), layer: l, num_layers: m.arch.dims.num_layers });
            }
        }
        let n = shape_product(t)?;
        params = params.checked_add(n).ok_or(FormatError::Overflow { field: "parameter_count" })?;
        let need = expected_layout(t)?.byte_len;
        let mismatch = |reason: String| FormatError::ManifestPageMismatch { tensor: t.name.clone(), reason };
        if t.byte_len != need {
            return Err(mismatch(format!("byte_len {} but shape {:?} {} needs {need}", t.byte_len, t.shape, t.dtype.name())));
        }
        let first = t.first_page as u64;
        let end = first.checked_add(t.page_count as u64).ok_or(FormatError::Overflow { field: "first_page + page_count" })?;
        if end > pages.len() as u64 {
            return Err(mismatch(format!("pages {first}..{end} past the page table ({} pages)", pages.len())));
        }
        let range = &pages[first as usize..end as usize];
        let mut sum: u64 = 0;
        for (k, p) in range.iter().enumerate() {
            sum = sum.checked_add(p.raw_size).ok_or(FormatError::Overflow { field: "sum of page raw sizes" })?;
            if k + 1 < range.len() {
                let next = p.offset.checked_add(p.raw_size).ok_or(FormatError::Overflow { field: "page end" })?;
                if range[k + 1].offset != next {
                    return Err(mismatch(format!("page {} does not follow page {} back to back", first + k as u64 + 1, first + k as u64)));
                }
            }
        }
        if sum != t.byte_len {
            return Err(mismatch(format!("byte_len {} but its pages hold {sum} bytes", t.byte_len)));
        }
        for (k, o) in owner[first as usize..end as usize].iter_mut().enumerate() {
            if let Some(other) = o {
                return Err(mismatch(format!("page {} is also owned by {other}", first + k as u64)));
            }
            *o = Some(t.name.as_str());
        }
    }
    let need = |role: Role, layer: Option<u32>| -> Result<(), FormatError> {
        if by_role.contains_key(&(role, layer)) {
            Ok(())
        } else {
            Err(FormatError::MissingRole { role: role.tensor_name(layer) })
        }
    };
    need(Role::TokenEmbd, None)?;
    need(Role::OutputNorm, None)?;
    if !m.arch.dims.tie_word_embeddings {
        need(Role::LmHead, None)?;
    }
    // Terminates at the first missing layer, so a huge num_layers costs at most tensors/5 rounds.
    let mut l: u64 = 0;
    while l < m.arch.dims.num_layers {
        let layer = u32::try_from(l).map_err(|_| FormatError::MissingRole { role: Role::AttnNorm.tensor_name(None) + " (layer index past u32)" })?;
        for r in [Role::AttnNorm, Role::AttnQ, Role::AttnK, Role::AttnV, Role::AttnO] {
            need(r, Some(layer))?;
        }
        l += 1;
    }
    if let Some(i) = owner.iter().position(|o| o.is_none()) {
        return Err(FormatError::OrphanPage { page: i as u64 });
    }
    let v = &m.validation;
    if v.tensor_count != m.tensors.len() as u64 {
        return Err(FormatError::Validation(format!("tensor_count {} but {} tensors", v.tensor_count, m.tensors.len())));
    }
    if v.parameter_count != params {
        return Err(FormatError::Validation(format!("parameter_count {} but the shapes give {params}", v.parameter_count)));
    }
    if v.tensor_blake3.len() != m.tensors.len() || !m.tensors.iter().all(|t| v.tensor_blake3.contains_key(&t.name)) {
        return Err(FormatError::Validation("tensor_blake3 does not list exactly the archive's tensors".into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
