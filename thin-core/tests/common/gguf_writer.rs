//! A small GGUF writer for synthetic test files, shared by the GGUF hostile-input and mutation tests.

pub const T_U32: u32 = 4;
pub const T_I32: u32 = 5;
pub const T_F32: u32 = 6;
pub const T_BOOL: u32 = 7;
pub const T_STRING: u32 = 8;
pub const T_ARRAY: u32 = 9;
pub const T_U64: u32 = 10;

pub fn s(v: &str) -> Vec<u8> {
    let mut b = (v.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(v.as_bytes());
    b
}

pub fn f16(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

#[derive(Clone)]
pub struct Tensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: u32,
    pub offset: u64,
}

#[derive(Clone)]
pub struct Gguf {
    pub magic: [u8; 4],
    pub version: u32,
    pub tensor_count: Option<u64>,
    pub kv_count: Option<u64>,
    pub kvs: Vec<(Vec<u8>, u32, Vec<u8>)>,
    pub tensors: Vec<Tensor>,
    pub alignment: u64,
    pub data: Vec<u8>,
}

impl Gguf {
    pub fn new() -> Gguf {
        Gguf {
            magic: *b"GGUF",
            version: 3,
            tensor_count: None,
            kv_count: None,
            kvs: Vec::new(),
            tensors: Vec::new(),
            alignment: 32,
            data: Vec::new(),
        }
    }
    pub fn kv(&mut self, key: &str, ty: u32, payload: Vec<u8>) -> &mut Self {
        self.kvs.push((s(key), ty, payload));
        self
    }
    pub fn kv_str(&mut self, key: &str, v: &str) -> &mut Self {
        self.kv(key, T_STRING, s(v))
    }
    pub fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.kv(key, T_U32, v.to_le_bytes().to_vec())
    }
    pub fn kv_f32(&mut self, key: &str, v: f32) -> &mut Self {
        self.kv(key, T_F32, v.to_le_bytes().to_vec())
    }
    pub fn kv_str_array(&mut self, key: &str, vs: &[&str]) -> &mut Self {
        let mut p = T_STRING.to_le_bytes().to_vec();
        p.extend_from_slice(&(vs.len() as u64).to_le_bytes());
        for v in vs {
            p.extend(s(v));
        }
        self.kv(key, T_ARRAY, p)
    }
    pub fn kv_i32_array(&mut self, key: &str, vs: &[i32]) -> &mut Self {
        let mut p = T_I32.to_le_bytes().to_vec();
        p.extend_from_slice(&(vs.len() as u64).to_le_bytes());
        for v in vs {
            p.extend_from_slice(&v.to_le_bytes());
        }
        self.kv(key, T_ARRAY, p)
    }
    /// Appends a tensor whose data goes at the next aligned offset of the data section.
    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, bytes: &[u8]) -> &mut Self {
        let a = self.alignment.max(1) as usize;
        while self.data.len() % a != 0 {
            self.data.push(0);
        }
        let offset = self.data.len() as u64;
        self.data.extend_from_slice(bytes);
        self.tensors.push(Tensor {
            name: name.into(),
            dims: dims.to_vec(),
            ty,
            offset,
        });
        self
    }
    pub fn build(&self) -> Vec<u8> {
        let mut b = self.magic.to_vec();
        b.extend_from_slice(&self.version.to_le_bytes());
        b.extend_from_slice(&self.tensor_count.unwrap_or(self.tensors.len() as u64).to_le_bytes());
        b.extend_from_slice(&self.kv_count.unwrap_or(self.kvs.len() as u64).to_le_bytes());
        for (k, ty, p) in &self.kvs {
            b.extend_from_slice(k);
            b.extend_from_slice(&ty.to_le_bytes());
            b.extend_from_slice(p);
        }
        for t in &self.tensors {
            b.extend(s(&t.name));
            b.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                b.extend_from_slice(&d.to_le_bytes());
            }
            b.extend_from_slice(&t.ty.to_le_bytes());
            b.extend_from_slice(&t.offset.to_le_bytes());
        }
        let a = self.alignment.max(1) as usize;
        while b.len() % a != 0 {
            b.push(0);
        }
        b.extend_from_slice(&self.data);
        b
    }
}

/// Byte-level BPE vocab: the 256 GPT-2 byte symbols, a few merges and one control token.
pub fn gpt2_tokens() -> Vec<String> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut toks: Vec<String> = cs
        .iter()
        .map(|&c| char::from_u32(c).map(String::from).unwrap_or_default())
        .collect();
    toks.extend(["he", "ll", "hell", "<|endoftext|>"].iter().map(|s| s.to_string()));
    toks
}

/// A valid small llama GGUF with a gpt2 tokenizer and Q8_0, Q4_K and F32 tensors.
pub fn valid() -> Gguf {
    let toks = gpt2_tokens();
    let tok_refs: Vec<&str> = toks.iter().map(|s| s.as_str()).collect();
    let mut types = vec![1i32; toks.len()];
    let last = types.len() - 1;
    types[last] = 3;
    let mut g = Gguf::new();
    g.kv_str("general.architecture", "llama")
        .kv_str("general.name", "tiny")
        .kv_u32("general.alignment", 32)
        .kv_u32("general.file_type", 7)
        .kv_u32("llama.context_length", 128)
        .kv_u32("llama.embedding_length", 64)
        .kv_u32("llama.block_count", 1)
        .kv_u32("llama.feed_forward_length", 256)
        .kv_u32("llama.attention.head_count", 4)
        .kv_u32("llama.attention.head_count_kv", 2)
        .kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        .kv_f32("llama.rope.freq_base", 10000.0)
        .kv_str("tokenizer.ggml.model", "gpt2")
        .kv_str_array("tokenizer.ggml.tokens", &tok_refs)
        .kv_i32_array("tokenizer.ggml.token_type", &types)
        .kv_str_array("tokenizer.ggml.merges", &["h e", "l l", "he ll"])
        .kv_u32("tokenizer.ggml.bos_token_id", last as u32)
        .kv_u32("tokenizer.ggml.eos_token_id", last as u32)
        .kv("tokenizer.ggml.add_bos_token", T_BOOL, vec![0])
        .kv_str(
            "tokenizer.chat_template",
            "{% for m in messages %}{{ m.content }}{% endfor %}",
        );
    // Q8_0 [2, 64]: 4 blocks.
    let mut q8 = Vec::new();
    for blk in 0..4 {
        q8.extend_from_slice(&f16(0.25 * (blk + 1) as f32));
        for i in 0..32 {
            q8.push((i as i8 - 16) as u8);
        }
    }
    g.tensor("blk.0.attn_q.weight", &[64, 2], 8, &q8);
    // Q4_K [1, 256]: one block.
    let mut q4k = f16(0.5).to_vec();
    q4k.extend_from_slice(&f16(0.125));
    q4k.extend((0..12u8).map(|i| i * 5 + 1));
    q4k.extend((0..128u32).map(|i| (i * 37 % 256) as u8));
    g.tensor("blk.0.ffn_up.weight", &[256, 1], 12, &q4k);
    // F32 [64].
    let f: Vec<u8> = (0..64).flat_map(|i| (1.0f32 + i as f32 / 64.0).to_le_bytes()).collect();
    g.tensor("blk.0.attn_norm.weight", &[64], 0, &f);
    g.tensor("output_norm.weight", &[64], 0, &f);
    g
}
