//! GGUF v2/v3 reader: metadata, tensor infos, block dequantization, tokenizer and arch config from metadata.
//!
//! Nothing in the file is trusted: every count is capped (and bounded by the bytes left) before
//! anything is allocated, all offset arithmetic is checked, tensors must lie inside the data
//! section without overlapping, and names/keys must be unique.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::arch::{ArchConfig, Family, LayerAttention, MoeConfig, RopeConfig, RopeScaling, ShapeDims};
use crate::codec::CodecError;
use crate::dtype::SourceDType;
use crate::source::{SourceKind, SourceModel, SourceTensor};

mod tokenizer;
pub use tokenizer::tokenizer_from_gguf;

pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Most tensors a file may declare.
pub const MAX_TENSORS: u64 = 1 << 20;
/// Most metadata key/value pairs a file may declare.
pub const MAX_KVS: u64 = 1 << 16;
/// Longest string (key, value or tensor name) in bytes.
pub const MAX_STRING: u64 = 64 << 20;
/// Longest metadata array (Gemma 3's vocab is 262,144 tokens; merges run to ~500k).
pub const MAX_ARRAY: u64 = 1 << 22;
/// Most metadata array elements in the whole file (bounds memory: a 1-byte element in the file
/// becomes a 32-byte `GgufValue`).
pub const MAX_ARRAY_ELEMENTS_TOTAL: u64 = 1 << 23;
/// Deepest nesting of metadata arrays.
pub const MAX_ARRAY_DEPTH: u32 = 4;
pub const MAX_DIMS: u32 = 4;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("not a GGUF file (magic {found:?})")]
    BadMagic { found: [u8; 4] },
    #[error("unsupported GGUF version {0} (2 and 3 are supported)")]
    UnsupportedVersion(u32),
    #[error("file truncated reading {what} at offset {offset}")]
    Truncated { what: String, offset: u64 },
    #[error("too many {what}: {count} (at most {max})")]
    TooMany { what: &'static str, count: u64, max: u64 },
    #[error("general.alignment {0} is not a nonzero power of two")]
    BadAlignment(u64),
    #[error("tensor {tensor}: unknown or unsupported ggml type {ggml_type}")]
    UnknownType { tensor: String, ggml_type: u32 },
    #[error("tensor {tensor}: dims overflow")]
    DimOverflow { tensor: String },
    #[error("tensor {tensor}: {n_dims} dims (at most {max})")]
    TooManyDims { tensor: String, n_dims: u32, max: u32 },
    #[error("tensor {tensor}: innermost dim {dim} is not a multiple of the {dtype} block size {block}")]
    PartialBlock {
        tensor: String,
        dtype: &'static str,
        dim: u64,
        block: u64,
    },
    #[error("tensor {tensor}: offset {offset} is not aligned to {alignment}")]
    MisalignedTensor {
        tensor: String,
        offset: u64,
        alignment: u64,
    },
    #[error("tensor {tensor}: data {offset}..+{len} is outside the data section ({data_len} bytes)")]
    DataOutOfBounds {
        tensor: String,
        offset: u64,
        len: u64,
        data_len: u64,
    },
    #[error("tensors {first} and {second} overlap")]
    TensorOverlap { first: String, second: String },
    #[error("duplicate tensor name {0}")]
    DuplicateTensor(String),
    #[error("duplicate metadata key {0}")]
    DuplicateKey(String),
    #[error("string at offset {offset} is not valid UTF-8 ({what})")]
    BadString { what: String, offset: u64 },
    #[error("metadata key {key}: unknown value type {value_type}")]
    UnknownValueType { key: String, value_type: u32 },
    #[error("metadata key {key}: arrays nested deeper than {max}")]
    ArrayTooDeep { key: String, max: u32 },
    #[error("missing metadata key {0}")]
    MissingKey(String),
    #[error("metadata key {key}: expected {expected}, found {found}")]
    WrongKeyType {
        key: String,
        expected: &'static str,
        found: String,
    },
    #[error("metadata key {key}: bad value: {reason}")]
    BadValue { key: String, reason: String },
    #[error("metadata key {key} declares {declared}, but the file's tensors hold {present} {what}")]
    Unbacked { key: String, declared: u64, present: u64, what: &'static str },
    #[error("unsupported architecture {0:?} (llama, smollm3, gemma3, olmoe are supported)")]
    UnsupportedArch(String),
    #[error("unsupported tokenizer model {0:?} (\"gpt2\" byte-level BPE and \"llama\" SentencePiece are supported)")]
    UnsupportedTokenizer(String),
    #[error("building tokenizer.json: {0}")]
    TokenizerJson(String),
    #[error(transparent)]
    Codec(#[from] CodecError),
}

#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    pub fn type_name(&self) -> &'static str {
        match self {
            GgufValue::U8(_) => "u8",
            GgufValue::I8(_) => "i8",
            GgufValue::U16(_) => "u16",
            GgufValue::I16(_) => "i16",
            GgufValue::U32(_) => "u32",
            GgufValue::I32(_) => "i32",
            GgufValue::F32(_) => "f32",
            GgufValue::Bool(_) => "bool",
            GgufValue::String(_) => "string",
            GgufValue::Array(_) => "array",
            GgufValue::U64(_) => "u64",
            GgufValue::I64(_) => "i64",
            GgufValue::F64(_) => "f64",
        }
    }

    /// Any integer type that holds a non-negative value.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v as u64),
            GgufValue::U16(v) => Some(v as u64),
            GgufValue::U32(v) => Some(v as u64),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any numeric type, as f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v as f64),
            GgufValue::F64(v) => Some(v),
            GgufValue::U8(v) => Some(v as f64),
            GgufValue::U16(v) => Some(v as f64),
            GgufValue::U32(v) => Some(v as f64),
            GgufValue::U64(v) => Some(v as f64),
            GgufValue::I8(v) => Some(v as f64),
            GgufValue::I16(v) => Some(v as f64),
            GgufValue::I32(v) => Some(v as f64),
            GgufValue::I64(v) => Some(v as f64),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// As stored, innermost first.
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    pub dtype: SourceDType,
    /// Relative to the data section.
    pub offset: u64,
    pub byte_len: u64,
}

impl GgufTensorInfo {
    /// Row-major shape, outermost first (the stored dims reversed).
    pub fn shape(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }

    /// Number of elements (checked at open, so it cannot overflow here).
    pub fn elements(&self) -> u64 {
        self.dims.iter().copied().fold(1u64, |a, d| a.saturating_mul(d))
    }
}

/// ggml type id to source dtype, for the types thin-core decodes.
pub fn dtype_from_ggml(t: u32) -> Option<SourceDType> {
    Some(match t {
        0 => SourceDType::F32,
        1 => SourceDType::F16,
        2 => SourceDType::Q4_0,
        3 => SourceDType::Q4_1,
        6 => SourceDType::Q5_0,
        7 => SourceDType::Q5_1,
        8 => SourceDType::Q8_0,
        12 => SourceDType::Q4K,
        13 => SourceDType::Q5K,
        14 => SourceDType::Q6K,
        30 => SourceDType::Bf16,
        _ => return None,
    })
}

enum Storage {
    Mmap(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mmap(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

pub struct GgufFile {
    storage: Storage,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: BTreeMap<String, GgufValue>,
    tensors: Vec<GgufTensorInfo>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .field("kv_count", &self.metadata.len())
            .field("tensor_count", &self.tensors.len())
            .finish()
    }
}

struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
    /// Array elements still allowed in this file.
    elems_left: u64,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.b.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                what: what(),
                offset: self.pos as u64,
            });
        }
        let n = n as usize;
        let s = &self.b[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn arr<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        if len > MAX_STRING {
            return Err(GgufError::TooMany {
                what: "string bytes",
                count: len,
                max: MAX_STRING,
            });
        }
        let at = self.pos as u64;
        let s = self.take(len, what)?;
        match std::str::from_utf8(s) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(GgufError::BadString {
                what: what(),
                offset: at,
            }),
        }
    }

    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<GgufValue, GgufError> {
        let w = || format!("value of {key}");
        Ok(match ty {
            0 => GgufValue::U8(self.arr::<1>(&w)?[0]),
            1 => GgufValue::I8(self.arr::<1>(&w)?[0] as i8),
            2 => GgufValue::U16(u16::from_le_bytes(self.arr(&w)?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.arr(&w)?)),
            4 => GgufValue::U32(u32::from_le_bytes(self.arr(&w)?)),
            5 => GgufValue::I32(i32::from_le_bytes(self.arr(&w)?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.arr(&w)?)),
            7 => GgufValue::Bool(self.arr::<1>(&w)?[0] != 0),
            8 => GgufValue::String(self.string(&w)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::ArrayTooDeep {
                        key: key.to_owned(),
                        max: MAX_ARRAY_DEPTH,
                    });
                }
                let ety = self.u32(&w)?;
                let count = self.u64(&w)?;
                let min = match ety {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10 | 11 | 12 => 8,
                    9 => 12,
                    _ => {
                        return Err(GgufError::UnknownValueType {
                            key: key.to_owned(),
                            value_type: ety,
                        })
                    }
                };
                if count > MAX_ARRAY {
                    return Err(GgufError::TooMany {
                        what: "array elements",
                        count,
                        max: MAX_ARRAY,
                    });
                }
                if count > self.elems_left {
                    return Err(GgufError::TooMany {
                        what: "array elements in the file",
                        count,
                        max: MAX_ARRAY_ELEMENTS_TOTAL,
                    });
                }
                self.elems_left -= count;
                if count > self.remaining() / min {
                    return Err(GgufError::Truncated {
                        what: format!("array {key}"),
                        offset: self.pos as u64,
                    });
                }
                let mut v = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    v.push(self.value(ety, key, depth + 1)?);
                }
                GgufValue::Array(v)
            }
            10 => GgufValue::U64(u64::from_le_bytes(self.arr(&w)?)),
            11 => GgufValue::I64(i64::from_le_bytes(self.arr(&w)?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.arr(&w)?)),
            _ => {
                return Err(GgufError::UnknownValueType {
                    key: key.to_owned(),
                    value_type: ty,
                })
            }
        })
    }
}

/// (version, alignment, data offset, metadata, tensor infos).
type Parsed = (u32, u64, u64, BTreeMap<String, GgufValue>, Vec<GgufTensorInfo>);

fn parse(b: &[u8]) -> Result<Parsed, GgufError> {
    let mut c = Cursor {
        b,
        pos: 0,
        elems_left: MAX_ARRAY_ELEMENTS_TOTAL,
    };
    if b.len() < 4 {
        let mut found = [0u8; 4];
        found[..b.len()].copy_from_slice(b);
        return Err(GgufError::BadMagic { found });
    }
    let magic: [u8; 4] = c.arr(&|| "magic".into())?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = c.u32(&|| "version".into())?;
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion(version));
    }
    let n_tensors = c.u64(&|| "tensor count".into())?;
    let n_kv = c.u64(&|| "metadata count".into())?;
    if n_tensors > MAX_TENSORS {
        return Err(GgufError::TooMany {
            what: "tensors",
            count: n_tensors,
            max: MAX_TENSORS,
        });
    }
    if n_kv > MAX_KVS {
        return Err(GgufError::TooMany {
            what: "metadata keys",
            count: n_kv,
            max: MAX_KVS,
        });
    }
    // Smallest possible encodings: kv = key len + type + 1 byte; tensor info = name len + n_dims + type + offset.
    if n_kv > c.remaining() / 13 {
        return Err(GgufError::Truncated {
            what: format!("{n_kv} metadata entries"),
            offset: c.pos as u64,
        });
    }
    let mut meta = BTreeMap::new();
    for i in 0..n_kv {
        let key = c.string(&|| format!("metadata key {i}"))?;
        let ty = c.u32(&|| format!("type of {key}"))?;
        let v = c.value(ty, &key, 0)?;
        if meta.contains_key(&key) {
            return Err(GgufError::DuplicateKey(key));
        }
        meta.insert(key, v);
    }
    let alignment = match meta.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => {
            let a = v.as_u64().ok_or_else(|| GgufError::WrongKeyType {
                key: "general.alignment".into(),
                expected: "unsigned integer",
                found: v.type_name().into(),
            })?;
            if a == 0 || !a.is_power_of_two() {
                return Err(GgufError::BadAlignment(a));
            }
            a
        }
    };
    if n_tensors > c.remaining() / 24 {
        return Err(GgufError::Truncated {
            what: format!("{n_tensors} tensor infos"),
            offset: c.pos as u64,
        });
    }
    let mut tensors = Vec::with_capacity(n_tensors as usize);
    let mut names = std::collections::HashSet::new();
    for i in 0..n_tensors {
        let name = c.string(&|| format!("tensor {i} name"))?;
        let n_dims = c.u32(&|| format!("tensor {name} n_dims"))?;
        if n_dims > MAX_DIMS {
            return Err(GgufError::TooManyDims {
                tensor: name,
                n_dims,
                max: MAX_DIMS,
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64(&|| format!("tensor {name} dims"))?);
        }
        let ggml_type = c.u32(&|| format!("tensor {name} type"))?;
        let offset = c.u64(&|| format!("tensor {name} offset"))?;
        let Some(dtype) = dtype_from_ggml(ggml_type) else {
            return Err(GgufError::UnknownType {
                tensor: name,
                ggml_type,
            });
        };
        let mut n: u64 = 1;
        for &d in &dims {
            // ggml stores dims as int64.
            if d > i64::MAX as u64 {
                return Err(GgufError::DimOverflow { tensor: name });
            }
            n = match n.checked_mul(d) {
                Some(n) if n <= i64::MAX as u64 => n,
                _ => return Err(GgufError::DimOverflow { tensor: name }),
            };
        }
        let (per, _) = dtype.block();
        let inner = dims.first().copied().unwrap_or(1);
        if inner % per != 0 {
            return Err(GgufError::PartialBlock {
                tensor: name,
                dtype: dtype.name(),
                dim: inner,
                block: per,
            });
        }
        let Some(byte_len) = dtype.bytes_for(n) else {
            return Err(GgufError::DimOverflow { tensor: name });
        };
        if offset % alignment != 0 {
            return Err(GgufError::MisalignedTensor {
                tensor: name,
                offset,
                alignment,
            });
        }
        if !names.insert(name.clone()) {
            return Err(GgufError::DuplicateTensor(name));
        }
        tensors.push(GgufTensorInfo {
            name,
            dims,
            ggml_type,
            dtype,
            offset,
            byte_len,
        });
    }
    let header_end = c.pos as u64;
    let data_offset = header_end
        .checked_add(alignment - 1)
        .map(|v| v / alignment * alignment)
        .ok_or(GgufError::BadAlignment(alignment))?;
    let data_len = (b.len() as u64).saturating_sub(data_offset);
    for t in &tensors {
        match t.offset.checked_add(t.byte_len) {
            Some(end) if end <= data_len => {}
            _ => {
                return Err(GgufError::DataOutOfBounds {
                    tensor: t.name.clone(),
                    offset: t.offset,
                    len: t.byte_len,
                    data_len,
                })
            }
        }
    }
    let mut order: Vec<usize> = (0..tensors.len()).filter(|&i| tensors[i].byte_len > 0).collect();
    order.sort_by_key(|&i| tensors[i].offset);
    for w in order.windows(2) {
        let (a, b2) = (&tensors[w[0]], &tensors[w[1]]);
        // In bounds was checked above, so the sum cannot overflow.
        if b2.offset < a.offset.saturating_add(a.byte_len) {
            return Err(GgufError::TensorOverlap {
                first: a.name.clone(),
                second: b2.name.clone(),
            });
        }
    }
    Ok((version, alignment, data_offset, meta, tensors))
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<GgufFile, GgufError> {
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let storage = if len < 4096 {
            Storage::Owned(std::fs::read(path).map_err(io)?)
        } else {
            // SAFETY: the map is read-only; like every mmap reader we rely on the file not being
            // truncated underneath us while it is open.
            Storage::Mmap(unsafe { memmap2::Mmap::map(&file) }.map_err(io)?)
        };
        Self::from_storage(storage)
    }

    /// Parses a GGUF image held in memory (tests, fuzzing, small files).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
        Self::from_storage(Storage::Owned(bytes))
    }

    fn from_storage(storage: Storage) -> Result<GgufFile, GgufError> {
        let (version, alignment, data_offset, metadata, tensors) = parse(storage.bytes())?;
        Ok(GgufFile {
            storage,
            version,
            alignment,
            data_offset,
            metadata,
            tensors,
        })
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute file offset of the data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    pub fn metadata(&self) -> &BTreeMap<String, GgufValue> {
        &self.metadata
    }

    pub fn tensor_infos(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The tensor's bytes. Infos from this file are always in bounds (checked at open); an info
    /// that does not belong to this file and lies out of bounds gives an empty slice.
    pub fn tensor_data(&self, t: &GgufTensorInfo) -> &[u8] {
        let b = self.storage.bytes();
        let start = self.data_offset.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(t.byte_len));
        match (start, end) {
            (Some(s), Some(e)) if e <= b.len() as u64 => &b[s as usize..e as usize],
            _ => &[],
        }
    }

    /// The whole model: arch config, tokenizer and tensors (shapes row-major, outermost first).
    pub fn source_model(&self, file_name: &str) -> Result<SourceModel<'_>, GgufError> {
        let arch = arch_from_gguf(&self.metadata, &self.tensors)?;
        let tokenizer = tokenizer_from_gguf(&self.metadata)?;
        let tensors = self
            .tensors
            .iter()
            .map(|t| SourceTensor {
                name: t.name.clone(),
                shape: t.shape(),
                dtype: t.dtype,
                bytes: self.tensor_data(t),
            })
            .collect();
        let mut details = BTreeMap::new();
        details.insert("gguf_version".to_string(), self.version.to_string());
        details.insert("alignment".to_string(), self.alignment.to_string());
        if let Some(n) = self.metadata.get("general.name").and_then(|v| v.as_str()) {
            details.insert("general.name".to_string(), n.to_string());
        }
        let file_type = self.metadata.get("general.file_type").and_then(|v| v.as_u64());
        if let Some(ft) = file_type {
            details.insert("general.file_type".to_string(), ft.to_string());
        }
        details.insert("general.architecture".to_string(), arch.dims.family.name().to_string());
        let mut counts = serde_json::Map::new();
        for t in &self.tensors {
            let e = counts.entry(t.dtype.name()).or_insert(serde_json::Value::from(0u64));
            *e = serde_json::Value::from(e.as_u64().unwrap_or(0) + 1);
        }
        let source_config = serde_json::json!({
            "format": "gguf",
            "gguf_version": self.version,
            "file_type": file_type,
            "tensor_types": counts,
        });
        Ok(SourceModel {
            kind: SourceKind::Gguf,
            arch,
            tokenizer,
            tensors,
            files: vec![file_name.to_string()],
            details,
            source_config,
        })
    }
}

fn wrong(key: &str, expected: &'static str, v: &GgufValue) -> GgufError {
    GgufError::WrongKeyType {
        key: key.to_string(),
        expected,
        found: v.type_name().to_string(),
    }
}

pub(crate) fn get_u64(meta: &BTreeMap<String, GgufValue>, key: &str) -> Result<Option<u64>, GgufError> {
    match meta.get(key) {
        None => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| wrong(key, "unsigned integer", v)),
    }
}

fn get_f64(meta: &BTreeMap<String, GgufValue>, key: &str) -> Result<Option<f64>, GgufError> {
    match meta.get(key) {
        None => Ok(None),
        Some(v) => v.as_f64().map(Some).ok_or_else(|| wrong(key, "number", v)),
    }
}

pub(crate) fn get_str<'m>(meta: &'m BTreeMap<String, GgufValue>, key: &str) -> Result<Option<&'m str>, GgufError> {
    match meta.get(key) {
        None => Ok(None),
        Some(v) => v.as_str().map(Some).ok_or_else(|| wrong(key, "string", v)),
    }
}

fn req_u64(meta: &BTreeMap<String, GgufValue>, key: &str) -> Result<u64, GgufError> {
    get_u64(meta, key)?.ok_or_else(|| GgufError::MissingKey(key.to_string()))
}

/// `ArchConfig` from GGUF metadata (llama.cpp key names) and the tensor list (tied LM head =
/// no `output.weight`).
pub fn arch_from_gguf(meta: &BTreeMap<String, GgufValue>, tensors: &[GgufTensorInfo]) -> Result<ArchConfig, GgufError> {
    let arch =
        get_str(meta, "general.architecture")?.ok_or_else(|| GgufError::MissingKey("general.architecture".into()))?;
    let family = match arch {
        "llama" => Family::Llama,
        "smollm3" => Family::Smollm3,
        "gemma3" => Family::Gemma3,
        "olmoe" => Family::Olmoe,
        other => return Err(GgufError::UnsupportedArch(other.to_string())),
    };
    let k = |s: &str| format!("{arch}.{s}");
    let hidden_size = req_u64(meta, &k("embedding_length"))?;
    let num_layers = req_u64(meta, &k("block_count"))?;
    // Declared counts are bounded by the tensors present before anything is sized by them.
    let layers_present = distinct_layers(tensors);
    if num_layers > layers_present {
        return Err(GgufError::Unbacked { key: k("block_count"), declared: num_layers, present: layers_present, what: "layers (distinct blk.N)" });
    }
    let intermediate_size = match meta.get(&k("feed_forward_length")) {
        // Some converters write one length per layer; all equal for the supported families.
        Some(GgufValue::Array(a)) => {
            let vals: Option<Vec<u64>> = a.iter().map(|v| v.as_u64()).collect();
            let vals = vals.ok_or_else(|| GgufError::WrongKeyType {
                key: k("feed_forward_length"),
                expected: "unsigned integer or array of unsigned integer",
                found: "array with other values".to_string(),
            })?;
            match vals.first() {
                Some(&f) if vals.iter().all(|&x| x == f) => f,
                _ => {
                    return Err(GgufError::BadValue {
                        key: k("feed_forward_length"),
                        reason: "per-layer lengths differ or are empty".into(),
                    })
                }
            }
        }
        _ => req_u64(meta, &k("feed_forward_length"))?,
    };
    let num_heads = req_u64(meta, &k("attention.head_count"))?;
    let num_kv_heads = get_u64(meta, &k("attention.head_count_kv"))?.unwrap_or(num_heads);
    if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
        return Err(GgufError::BadValue {
            key: k("attention.head_count_kv"),
            reason: format!("{num_heads} heads cannot share {num_kv_heads} kv heads"),
        });
    }
    let head_dim = match get_u64(meta, &k("attention.key_length"))? {
        Some(h) => h,
        None => hidden_size / num_heads,
    };
    let max_position_embeddings = get_u64(meta, &k("context_length"))?.unwrap_or(2048);
    let rms_norm_eps = get_f64(meta, &k("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-5);
    let theta = get_f64(meta, &k("rope.freq_base"))?.unwrap_or(10_000.0);
    let scaling = match get_str(meta, &k("rope.scaling.type"))? {
        None | Some("none") => None,
        Some(t) => Some(RopeScaling {
            rope_type: t.to_string(),
            factor: get_f64(meta, &k("rope.scaling.factor"))?.unwrap_or(1.0),
            low_freq_factor: get_f64(meta, &k("rope.scaling.low_freq_factor"))?.unwrap_or(1.0),
            high_freq_factor: get_f64(meta, &k("rope.scaling.high_freq_factor"))?.unwrap_or(4.0),
            original_max_position_embeddings: get_u64(meta, &k("rope.scaling.original_context_length"))?
                .unwrap_or(max_position_embeddings),
        }),
    };
    let declared_vocab = get_u64(meta, &k("vocab_size"))?;
    let vocab_size = match meta.get("tokenizer.ggml.tokens") {
        Some(GgufValue::Array(a)) => a.len() as u64,
        Some(v) => return Err(wrong("tokenizer.ggml.tokens", "array", v)),
        None => declared_vocab.ok_or_else(|| GgufError::MissingKey(k("vocab_size")))?,
    };
    if let Some(v) = declared_vocab.filter(|&v| v != vocab_size) {
        return Err(GgufError::BadValue { key: k("vocab_size"), reason: format!("{v}, but tokenizer.ggml.tokens lists {vocab_size} tokens") });
    }
    let tie_word_embeddings = !tensors.iter().any(|t| t.name == "output.weight");
    let mut cfg = ArchConfig {
        dims: ShapeDims {
            family,
            vocab_size,
            hidden_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate_size,
            num_experts: 0,
            top_k: 0,
            tie_word_embeddings,
        },
        rms_norm_eps,
        max_position_embeddings,
        rope: RopeConfig {
            theta,
            local_theta: None,
            scaling,
        },
        no_rope_layers: Vec::new(),
        layer_attention: Vec::new(),
        sliding_window: None,
        query_pre_attn_scalar: None,
        final_logit_softcap: None,
        attn_logit_softcap: None,
        moe: None,
        hidden_act: "silu".to_string(),
    };
    // Per-layer lists: num_layers is at most the file's distinct layers (checked above).
    match family {
        Family::Llama => {}
        Family::Smollm3 => {
            // llama.cpp: every `interval`-th layer (1-based) skips RoPE; SmolLM3 uses 4.
            let interval = get_u64(meta, &k("no_rope_layer_interval"))?.unwrap_or(4).max(1);
            cfg.no_rope_layers = (0..num_layers).filter(|l| (l + 1) % interval == 0).collect();
        }
        Family::Gemma3 => {
            cfg.hidden_act = "gelu_pytorch_tanh".to_string();
            cfg.sliding_window = get_u64(meta, &k("attention.sliding_window"))?;
            // llama.cpp's Gemma 3 pattern: five sliding-window layers, then one global.
            let pattern = get_u64(meta, &k("attention.sliding_window_pattern"))?
                .unwrap_or(6)
                .max(1);
            cfg.layer_attention = (0..num_layers)
                .map(|l| {
                    if (l + 1) % pattern == 0 {
                        LayerAttention::Full
                    } else {
                        LayerAttention::SlidingWindow
                    }
                })
                .collect();
            cfg.rope.local_theta = Some(get_f64(meta, &k("rope.freq_base_swa"))?.unwrap_or(10_000.0));
            cfg.query_pre_attn_scalar = Some(head_dim as f64);
            cfg.final_logit_softcap = get_f64(meta, &k("final_logit_softcapping"))?;
            cfg.attn_logit_softcap = get_f64(meta, &k("attn_logit_softcapping"))?;
        }
        Family::Olmoe => {
            let experts = req_u64(meta, &k("expert_count"))?;
            // Experts are stacked in `*_exps` tensors, outermost dim first.
            let stacked = tensors.iter().filter(|t| t.name.contains("_exps.")).filter_map(|t| t.dims.last().copied()).max().unwrap_or(0);
            if experts > stacked {
                return Err(GgufError::Unbacked { key: k("expert_count"), declared: experts, present: stacked, what: "experts (the outermost dim of the *_exps tensors)" });
            }
            let top_k = req_u64(meta, &k("expert_used_count"))?;
            if top_k > experts {
                return Err(GgufError::BadValue { key: k("expert_used_count"), reason: format!("{top_k} is more than expert_count {experts}") });
            }
            cfg.dims.num_experts = experts;
            cfg.dims.top_k = top_k;
            cfg.moe = Some(MoeConfig { norm_topk_prob: false });
        }
    }
    Ok(cfg)
}

/// How many distinct layer indices the tensor names carry (`blk.<N>.`, llama.cpp's naming).
fn distinct_layers(tensors: &[GgufTensorInfo]) -> u64 {
    let layers: std::collections::BTreeSet<u64> =
        tensors.iter().filter_map(|t| t.name.strip_prefix("blk.")?.split('.').next()?.parse().ok()).collect();
    layers.len() as u64
}

/// llama.cpp's HF→GGUF converter permutes the rows of Llama-family Q and K projections for its
/// RoPE layout (`reshape(n_head, 2, hd/2, ..).swapaxes(1, 2)`); transformers undoes it on load.
/// For row `hf_row` of the Hugging Face layout of a `[rows, in]` Q/K weight with `n_head` heads
/// (`n_kv_heads` for K), this gives the GGUF row that holds it, or `None` if the shape does not
/// split into heads of even size or `hf_row` is out of range.
pub fn llama_qk_gguf_row(hf_row: u64, rows: u64, n_head: u64) -> Option<u64> {
    if n_head == 0 || rows % n_head != 0 || hf_row >= rows {
        return None;
    }
    let hd = rows / n_head;
    if hd % 2 != 0 {
        return None;
    }
    let half = hd / 2;
    let (h, r) = (hf_row / hd, hf_row % hd);
    let (i, j) = (r / half, r % half);
    Some(h * hd + 2 * j + i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qk_unpermute_inverts_llama_cpp_permute() {
        // llama.cpp permute on row indices: hf rows [n_head, 2, hd/2] -> gguf rows [n_head, hd/2, 2].
        let (n_head, hd) = (3u64, 8u64);
        let rows = n_head * hd;
        let mut gguf_of_hf = vec![0u64; rows as usize];
        for h in 0..n_head {
            for i in 0..2 {
                for j in 0..hd / 2 {
                    gguf_of_hf[(h * hd + i * hd / 2 + j) as usize] = h * hd + j * 2 + i;
                }
            }
        }
        for r in 0..rows {
            assert_eq!(llama_qk_gguf_row(r, rows, n_head), Some(gguf_of_hf[r as usize]));
        }
        assert_eq!(llama_qk_gguf_row(0, 10, 3), None);
        assert_eq!(llama_qk_gguf_row(24, 24, 3), None);
        assert_eq!(llama_qk_gguf_row(0, 9, 3), None);
    }
}
