//! `thin eval`: an archive's perplexity over a text, and its KL divergence from a reference (an
//! archive, or logits a previous run saved), defined as llama.cpp's `llama-perplexity` defines
//! them so the two can be read side by side.
//!
//! How the text is scored (llama-perplexity's default method): the text is tokenized once (BOS
//! first when the tokenizer adds one) and cut into `n = tokens / ctx` windows of `ctx` tokens (the
//! rest is dropped; at least two windows are needed). Each window is evaluated from an empty
//! context, its first token replaced by BOS when the tokenizer adds BOS. Only the second half is
//! scored: the logits at positions `ctx/2 ..= ctx-2`, each predicting the next token of the
//! window, `ctx - 1 - ctx/2` per window. The engine prefills positions `0 ..= ctx/2` and
//! teacher-forces the rest one `decode_step` at a time.
//!
//! Per scored position, with `q` the model's and `p` the reference's softmax and `t` the next token:
//! `nll = -ln q[t]`, `nll_base = -ln p[t]`, `KLD = Σ_i p_i (ln p_i - ln q_i)`, `Δp = q[t] - p[t]`,
//! "same top" when both argmaxes (first index on ties) agree. The summaries (means with their
//! uncertainties, percentiles, PPL ratio and its covariance-aware uncertainty, RMS Δp) follow
//! `kl_divergence()` in llama.cpp's `tools/perplexity/perplexity.cpp`. Two differences, both
//! towards the exact definition: llama.cpp stores the reference's log-probabilities as 16-bit
//! steps over at most 16 nats and drops reference probabilities below e^-16 from the KLD sum; here
//! the reference is kept as f32 logits and every token counts, in f64. And llama.cpp prints no
//! final statistics under 100 scored tokens; here they are printed anyway.
//!
//! Memory stays bounded by one window: with `--ref` both engines advance in lockstep, position by
//! position; `--ref-logits` streams the saved file row by row. Only one f64 per scored position
//! is kept for each distribution (KLD, Δp), as llama.cpp does.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use serde::Serialize;
use thin_core::engine::EngineError;

#[derive(Args, Debug)]
pub struct EvalArgs {
    /// The .thin archive to score.
    pub model: PathBuf,
    /// A UTF-8 text file (eval/alice-ch1-4.txt ships with the repository).
    #[arg(long)]
    pub text: PathBuf,
    /// A reference archive (normally the bf16 one) run over the same windows: KL divergence,
    /// same-top p, Δp, PPL ratio.
    #[arg(long = "ref", value_name = "REF.thin")]
    pub reference: Option<PathBuf>,
    /// Reference logits a previous `thin eval --save-logits` wrote (same text and window size).
    #[arg(long, value_name = "FILE", conflicts_with = "reference")]
    pub ref_logits: Option<PathBuf>,
    /// Write the model's logits at every scored position to FILE, for a later `--ref-logits`.
    #[arg(long, value_name = "FILE")]
    pub save_logits: Option<PathBuf>,
    /// Tokens per window (llama-perplexity's -c); default 512, or the window size of --ref-logits.
    #[arg(long, value_name = "N")]
    pub ctx: Option<usize>,
    /// Score only the first N windows (llama-perplexity's --chunks).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub chunks: Option<u64>,
    /// One JSON object on stdout instead of llama.cpp's layout.
    #[arg(long)]
    pub json: bool,
    /// Where both engines run (the CPU by default: its engines run every archive).
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: thin::Backend,
}

/// llama-perplexity's default window.
pub const DEFAULT_CTX: usize = 512;

/// What `thin eval` refuses, each naming the file or value at fault.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error("reading the text {path}: {source}")]
    TextRead { path: String, source: std::io::Error },
    #[error("the text {path} is empty")]
    EmptyText { path: String },
    #[error(
        "the text {path} tokenizes to {tokens} tokens; windows of {ctx} tokens need at least {} (two windows, as llama-perplexity asks): give a longer text or a smaller --ctx",
        2 * ctx
    )]
    TextTooShort { path: String, tokens: usize, ctx: usize },
    #[error("--ctx {ctx} is too small: a window of fewer than 3 tokens has no position to score")]
    CtxTooSmall { ctx: usize },
    #[error("the reference {reference} has a vocabulary of {reference_vocab}, the model {model_vocab}: logits of different vocabularies cannot be compared")]
    VocabMismatch { reference: String, reference_vocab: u64, model_vocab: u64 },
    #[error("the reference {reference} is another architecture ({reference_arch}, shape fingerprint {reference_fingerprint}) than the model ({model_arch}, {model_fingerprint}); thin eval compares precisions of one model")]
    ArchMismatch { reference: String, reference_arch: String, reference_fingerprint: String, model_arch: String, model_fingerprint: String },
    #[error("the reference {reference} tokenizes the text differently from the model (first difference at token {pos}: {reference_id} vs {model_id})")]
    TokenizerMismatch { reference: String, pos: usize, reference_id: u32, model_id: u32 },
    #[error("{archive}: window {window}, position {pos}: {source}")]
    Step { archive: String, window: usize, pos: usize, source: EngineError },
    #[error("{archive}: the engine returned {got} logits, the vocabulary has {vocab}")]
    LogitsLength { archive: String, got: usize, vocab: usize },
    #[error("{archive}: logits at window {window}, position {pos} are not finite")]
    NonFinite { archive: String, window: usize, pos: usize },
    #[error("--save-logits {0} would overwrite the --ref-logits file being read")]
    SaveOverRef(String),
    #[error(transparent)]
    Logits(#[from] LogitsFileError),
}

// ---------------------------------------------------------------------------------------------
// The saved-logits file.

/// First bytes of a saved-logits file.
pub const LOGITS_MAGIC: [u8; 8] = *b"THINLOGT";
pub const LOGITS_VERSION: u32 = 1;
/// Bytes before the token ids.
pub const LOGITS_HEADER_LEN: usize = 128;
const FINGERPRINT_LEN: usize = 64;

/// A saved-logits file's header. The file, all little-endian:
///
/// | offset | bytes | field |
/// |---|---|---|
/// | 0 | 8 | magic `THINLOGT` |
/// | 8 | 4 | version (1) |
/// | 12 | 4 | `vocab`: logits per row |
/// | 16 | 4 | `ctx`: tokens per window |
/// | 20 | 4 | `windows` |
/// | 24 | 4 | scored positions per window, `ctx - 1 - ctx/2` |
/// | 28 | 4 | reserved, 0 |
/// | 32 | 64 | shape fingerprint of the archive that wrote it (ASCII, zero-padded) |
/// | 96 | 32 | that archive's `archive_hash` (blake3) |
/// | 128 | 4·windows·ctx | the windows' token ids (u32) as evaluated (BOS in place of each first token when the tokenizer adds BOS) |
/// | … | 4·windows·scored·vocab | f32 logits rows, window by window, at positions `ctx/2 ..= ctx-2` |
#[derive(Clone, Debug, PartialEq)]
pub struct LogitsHeader {
    pub vocab: usize,
    pub ctx: usize,
    pub windows: usize,
    pub fingerprint: String,
    pub archive_hash: [u8; 32],
}

impl LogitsHeader {
    pub fn scored(&self) -> usize {
        scored_per_window(self.ctx)
    }

    /// The file's whole length; `None` when it overflows.
    fn file_len(&self) -> Option<u64> {
        let (v, c, w, s) = (self.vocab as u64, self.ctx as u64, self.windows as u64, self.scored() as u64);
        let tokens = w.checked_mul(c)?.checked_mul(4)?;
        let rows = w.checked_mul(s)?.checked_mul(v)?.checked_mul(4)?;
        (LOGITS_HEADER_LEN as u64).checked_add(tokens)?.checked_add(rows)
    }

    fn to_bytes(&self) -> [u8; LOGITS_HEADER_LEN] {
        let mut b = [0u8; LOGITS_HEADER_LEN];
        b[0..8].copy_from_slice(&LOGITS_MAGIC);
        for (at, v) in [(8, LOGITS_VERSION), (12, self.vocab as u32), (16, self.ctx as u32), (20, self.windows as u32), (24, self.scored() as u32)] {
            b[at..at + 4].copy_from_slice(&v.to_le_bytes());
        }
        let fp = self.fingerprint.as_bytes();
        b[32..32 + fp.len().min(FINGERPRINT_LEN)].copy_from_slice(&fp[..fp.len().min(FINGERPRINT_LEN)]);
        b[96..128].copy_from_slice(&self.archive_hash);
        b
    }
}

/// What is wrong with a saved-logits file.
#[derive(Debug, thiserror::Error)]
pub enum LogitsFileError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{path} is not a thin logits file (its first 8 bytes are not THINLOGT)")]
    Magic { path: String },
    #[error("{path} is a thin logits file of version {version}; this thin reads version {LOGITS_VERSION}")]
    Version { path: String, version: u32 },
    #[error("{path}: bad header: {what}")]
    Header { path: String, what: String },
    #[error("{path} is truncated: {actual} bytes, its header describes {expected}")]
    Truncated { path: String, expected: u64, actual: u64 },
    #[error("{path} has {} bytes past the {expected} its header describes", actual - expected)]
    TrailingBytes { path: String, expected: u64, actual: u64 },
    #[error("{path} holds logits over a vocabulary of {file}; the model's is {model}")]
    Vocab { path: String, file: usize, model: usize },
    #[error("{path} was written with windows of {file} tokens; --ctx asks for {requested}")]
    Ctx { path: String, file: usize, requested: usize },
    #[error("{path} was written by another architecture (shape fingerprint {file}) than the model's ({model})")]
    Arch { path: String, file: String, model: String },
    #[error("{path} holds {file} windows; the text (with --chunks) gives {text}")]
    Windows { path: String, file: usize, text: usize },
    #[error("{path} was written over other tokens: window {window}, position {pos} is {file} there, {text} in this text")]
    Token { path: String, window: usize, pos: usize, file: u32, text: u32 },
}

/// Reads a saved-logits file as hostile input: the header checked field by field, the length
/// checked against it before anything is allocated, rows streamed one at a time.
pub struct LogitsReader {
    path: String,
    header: LogitsHeader,
    /// `windows × ctx` token ids.
    tokens: Vec<u32>,
    r: BufReader<File>,
    bytes: Vec<u8>,
    row: Vec<f32>,
}

impl LogitsReader {
    pub fn open(path: &Path) -> Result<LogitsReader, LogitsFileError> {
        let p = path.display().to_string();
        let io = |source| LogitsFileError::Io { path: p.clone(), source };
        let f = File::open(path).map_err(io)?;
        let actual = f.metadata().map_err(io)?.len();
        let mut r = BufReader::with_capacity(1 << 20, f);
        let mut b = [0u8; LOGITS_HEADER_LEN];
        if actual < 8 {
            return Err(LogitsFileError::Magic { path: p });
        }
        r.read_exact(&mut b[..8]).map_err(io)?;
        if b[..8] != LOGITS_MAGIC {
            return Err(LogitsFileError::Magic { path: p });
        }
        if actual < LOGITS_HEADER_LEN as u64 {
            return Err(LogitsFileError::Truncated { path: p, expected: LOGITS_HEADER_LEN as u64, actual });
        }
        r.read_exact(&mut b[8..]).map_err(io)?;
        let u = |at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        if u(8) != LOGITS_VERSION {
            return Err(LogitsFileError::Version { path: p, version: u(8) });
        }
        let bad = |what: String| LogitsFileError::Header { path: p.clone(), what };
        let (vocab, ctx, windows, scored) = (u(12) as usize, u(16) as usize, u(20) as usize, u(24) as usize);
        if vocab == 0 {
            return Err(bad("vocab is 0".into()));
        }
        if ctx < 3 {
            return Err(bad(format!("ctx {ctx} has no position to score")));
        }
        if windows == 0 {
            return Err(bad("windows is 0".into()));
        }
        if scored != scored_per_window(ctx) {
            return Err(bad(format!("{scored} scored positions per window; ctx {ctx} scores {}", scored_per_window(ctx))));
        }
        if u(28) != 0 {
            return Err(bad(format!("reserved field is {}, not 0", u(28))));
        }
        let fp = &b[32..96];
        let end = fp.iter().position(|&c| c == 0).unwrap_or(FINGERPRINT_LEN);
        if fp[end..].iter().any(|&c| c != 0) || !fp[..end].iter().all(|c| c.is_ascii_graphic()) {
            return Err(bad("the shape fingerprint is not zero-padded ASCII".into()));
        }
        let fingerprint = String::from_utf8_lossy(&fp[..end]).into_owned();
        let mut archive_hash = [0u8; 32];
        archive_hash.copy_from_slice(&b[96..128]);
        let header = LogitsHeader { vocab, ctx, windows, fingerprint, archive_hash };
        let expected = header.file_len().ok_or_else(|| bad("its sizes overflow".into()))?;
        if actual < expected {
            return Err(LogitsFileError::Truncated { path: p, expected, actual });
        }
        if actual > expected {
            return Err(LogitsFileError::TrailingBytes { path: p, expected, actual });
        }
        let mut raw = vec![0u8; windows * ctx * 4];
        r.read_exact(&mut raw).map_err(io)?;
        let tokens = raw.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        Ok(LogitsReader { path: p, header, tokens, r, bytes: vec![0u8; vocab * 4], row: vec![0.0; vocab] })
    }

    pub fn header(&self) -> &LogitsHeader {
        &self.header
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    /// Window `w`'s token ids.
    pub fn window_tokens(&self, w: usize) -> &[u32] {
        &self.tokens[w * self.header.ctx..(w + 1) * self.header.ctx]
    }

    /// The next row of logits.
    pub fn next_row(&mut self) -> Result<&[f32], LogitsFileError> {
        self.r.read_exact(&mut self.bytes).map_err(|source| LogitsFileError::Io { path: self.path.clone(), source })?;
        for (x, c) in self.row.iter_mut().zip(self.bytes.chunks_exact(4)) {
            *x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
        Ok(&self.row)
    }

    /// Refuse a file that cannot be the reference for these windows of this model.
    fn check(&self, vocab: usize, fingerprint: &str, windows: &[Vec<u32>], chunks_given: bool) -> Result<(), LogitsFileError> {
        let (h, path) = (&self.header, self.path.clone());
        if h.vocab != vocab {
            return Err(LogitsFileError::Vocab { path, file: h.vocab, model: vocab });
        }
        if h.fingerprint != fingerprint {
            return Err(LogitsFileError::Arch { path, file: h.fingerprint.clone(), model: fingerprint.into() });
        }
        if h.windows < windows.len() || (!chunks_given && h.windows != windows.len()) {
            return Err(LogitsFileError::Windows { path, file: h.windows, text: windows.len() });
        }
        for (w, ours) in windows.iter().enumerate() {
            if let Some(pos) = (0..h.ctx).find(|&i| self.window_tokens(w)[i] != ours[i]) {
                return Err(LogitsFileError::Token { path, window: w, pos, file: self.window_tokens(w)[pos], text: ours[pos] });
            }
        }
        Ok(())
    }
}

/// Writes a saved-logits file under a temporary name, renamed into place by [`LogitsWriter::finish`]
/// (an eval that fails leaves nothing under the final name, and removes the temporary).
pub struct LogitsWriter {
    path: PathBuf,
    tmp: PathBuf,
    w: Option<BufWriter<File>>,
    bytes: Vec<u8>,
}

impl LogitsWriter {
    pub fn create(path: &Path, header: &LogitsHeader, windows: &[Vec<u32>]) -> std::io::Result<LogitsWriter> {
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(format!(".partial-{}", std::process::id()));
        let tmp = PathBuf::from(tmp);
        let mut w = BufWriter::with_capacity(1 << 20, File::create(&tmp)?);
        let mut out = LogitsWriter { path: path.to_path_buf(), tmp, w: None, bytes: Vec::with_capacity(header.vocab * 4) };
        w.write_all(&header.to_bytes())?;
        for t in windows.iter().flatten() {
            w.write_all(&t.to_le_bytes())?;
        }
        out.w = Some(w);
        Ok(out)
    }

    pub fn write_row(&mut self, logits: &[f32]) -> std::io::Result<()> {
        self.bytes.clear();
        self.bytes.extend(logits.iter().flat_map(|x| x.to_le_bytes()));
        match &mut self.w {
            Some(w) => w.write_all(&self.bytes),
            None => Err(std::io::Error::other("the logits file is already finished")),
        }
    }

    pub fn finish(mut self) -> std::io::Result<()> {
        if let Some(mut w) = self.w.take() {
            w.flush()?;
            w.get_ref().sync_all()?;
        }
        std::fs::rename(&self.tmp, &self.path)
    }
}

impl Drop for LogitsWriter {
    fn drop(&mut self) {
        if self.w.is_some() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Statistics.

/// Scored positions in a window of `ctx` tokens: `ctx/2 ..= ctx-2`.
pub fn scored_per_window(ctx: usize) -> usize {
    ctx.saturating_sub(1 + ctx / 2)
}

/// `ln Σ_i exp(x_i)` (as `max + ln Σ exp(x_i - max)`) and the first index of the maximum.
fn log_sum_exp(logits: &[f32]) -> (f64, usize) {
    let mut imax = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[imax] {
            imax = i;
        }
    }
    let max = logits[imax] as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    (max + sum.ln(), imax)
}

/// A value with its uncertainty (one standard error).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Estimate {
    pub value: f64,
    pub uncertainty: f64,
}

/// llama.cpp's `mean_and_uncertainty`: the mean of `count` values from their sum and sum of
/// squares, and the standard error of that mean (0 for 10 values or fewer).
fn mean_and_uncertainty(sum: f64, sum2: f64, count: usize) -> Estimate {
    if count < 1 {
        return Estimate::default();
    }
    let n = count as f64;
    let mean = sum / n;
    let var = sum2 / n - mean * mean;
    let uncertainty = if var > 0.0 && count > 10 { (var / (n - 1.0)).sqrt() } else { 0.0 };
    Estimate { value: mean, uncertainty }
}

/// llama.cpp's `covariance` of two means (0 under 10 values).
fn covariance(sum_a: f64, sum_b: f64, sum_ab: f64, count: usize) -> f64 {
    if count < 10 {
        return 0.0;
    }
    let n = count as f64;
    (sum_ab / n - (sum_a / n) * (sum_b / n)) / (n - 1.0)
}

/// Linear interpolation between the closest ranks of sorted `values` (llama.cpp's `percentile`,
/// numpy's default method).
fn percentile(sorted: &[f64], fraction: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    if fraction <= 0.0 {
        return sorted[0];
    }
    if fraction >= 1.0 {
        return sorted[sorted.len() - 1];
    }
    let p = fraction * (sorted.len() - 1) as f64;
    let ip = p as usize;
    let p = p - ip as f64;
    (1.0 - p) * sorted[ip] + p * sorted[(ip + 1).min(sorted.len() - 1)]
}

fn median(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    match n {
        0 => 0.0,
        _ if n & 1 == 1 => sorted[n / 2],
        _ => 0.5 * (sorted[n / 2] + sorted[n / 2 - 1]),
    }
}

/// `sqrt(max(x, 0))`: a variance that rounding made slightly negative is 0.
fn sqrt0(x: f64) -> f64 {
    x.max(0.0).sqrt()
}

/// Running sums over the scored positions; [`Scores::report`] turns them into the statistics.
#[derive(Debug, Default)]
pub struct Scores {
    count: usize,
    sum_nll: f64,
    sum_nll2: f64,
    sum_nll_base: f64,
    sum_nll_base2: f64,
    sum_nll_nll_base: f64,
    sum_kld: f64,
    sum_kld2: f64,
    sum_p_diff: f64,
    sum_p_diff2: f64,
    sum_p_diff4: f64,
    n_same_top: usize,
    kld_values: Vec<f64>,
    p_diff_values: Vec<f64>,
    with_base: bool,
    chunks: Vec<Chunk>,
}

impl Scores {
    /// Scores without a reference (perplexity only) or against one.
    pub fn new(with_base: bool) -> Scores {
        Scores { with_base, ..Default::default() }
    }

    /// One scored position: the model's logits, the reference's (when there is one), and the
    /// token that follows.
    pub fn add(&mut self, logits: &[f32], base: Option<&[f32]>, next: u32) {
        let t = next as usize;
        let (log_z, imax) = log_sum_exp(logits);
        let nll = log_z - logits[t] as f64;
        self.count += 1;
        self.sum_nll += nll;
        self.sum_nll2 += nll * nll;
        let Some(base) = base else { return };
        let (log_z_base, imax_base) = log_sum_exp(base);
        let nll_base = log_z_base - base[t] as f64;
        self.sum_nll_base += nll_base;
        self.sum_nll_base2 += nll_base * nll_base;
        self.sum_nll_nll_base += nll * nll_base;
        // KL(base || model) = Σ p_i (ln p_i - ln q_i), every token counted.
        let kld: f64 = base
            .iter()
            .zip(logits)
            .map(|(&b, &q)| {
                let lp = b as f64 - log_z_base;
                lp.exp() * (lp - (q as f64 - log_z))
            })
            .sum();
        self.sum_kld += kld;
        self.sum_kld2 += kld * kld;
        self.kld_values.push(kld);
        if imax == imax_base {
            self.n_same_top += 1;
        }
        let p_diff = (-nll).exp() - (-nll_base).exp();
        let p_diff2 = p_diff * p_diff;
        self.sum_p_diff += p_diff;
        self.sum_p_diff2 += p_diff2;
        self.sum_p_diff4 += p_diff2 * p_diff2;
        self.p_diff_values.push(p_diff);
    }

    /// Close a window: record the running values llama-perplexity prints after each chunk.
    pub fn end_window(&mut self) -> &Chunk {
        let ppl = self.ppl().value;
        let chunk = if self.with_base {
            let k = self.kld_running();
            Chunk { window: self.chunks.len() + 1, ppl, ppl_uncertainty: Some(self.ppl_q().uncertainty), ln_ppl_ratio: Some(k.0), kld: Some(k.1), rms_delta_p: Some(k.2), same_top_p: Some(k.3) }
        } else {
            Chunk { window: self.chunks.len() + 1, ppl, ppl_uncertainty: None, ln_ppl_ratio: None, kld: None, rms_delta_p: None, same_top_p: None }
        };
        self.chunks.push(chunk);
        &self.chunks[self.chunks.len() - 1]
    }

    /// llama-perplexity's final estimate: exp(mean NLL) ± PPL · the standard error of the NLL mean.
    fn ppl(&self) -> Estimate {
        let n = self.count as f64;
        let mean = self.sum_nll / n;
        let var = self.sum_nll2 / n - mean * mean;
        let value = mean.exp();
        let uncertainty = if var > 0.0 && self.count > 1 { (var / (n - 1.0)).sqrt() * value } else { 0.0 };
        Estimate { value, uncertainty }
    }

    fn ppl_q(&self) -> Estimate {
        let l = mean_and_uncertainty(self.sum_nll, self.sum_nll2, self.count);
        let value = l.value.exp();
        Estimate { value, uncertainty: value * l.uncertainty }
    }

    /// ln(PPL(Q)/PPL(base)), KLD, RMS Δp and same-top p as they stand.
    fn kld_running(&self) -> (Estimate, Estimate, Estimate, Estimate) {
        let n = self.count;
        let l = mean_and_uncertainty(self.sum_nll, self.sum_nll2, n);
        let lb = mean_and_uncertainty(self.sum_nll_base, self.sum_nll_base2, n);
        let cov = covariance(self.sum_nll, self.sum_nll_base, self.sum_nll_nll_base, n);
        let ln_ratio = Estimate { value: l.value - lb.value, uncertainty: sqrt0(l.uncertainty.powi(2) + lb.uncertainty.powi(2) - 2.0 * cov) };
        let kld = mean_and_uncertainty(self.sum_kld, self.sum_kld2, n);
        let mse = mean_and_uncertainty(self.sum_p_diff2, self.sum_p_diff4, n);
        let rms = mse.value.sqrt();
        // llama.cpp's 0.5/rms · σ(mse) is 0/0 when the two models agree exactly: 0 here.
        let rms = Estimate { value: rms, uncertainty: if rms > 0.0 { 0.5 / rms * mse.uncertainty } else { 0.0 } };
        let p = self.n_same_top as f64 / n as f64;
        let same = Estimate { value: p, uncertainty: if n > 1 { sqrt0(p * (1.0 - p) / (n - 1) as f64) } else { 0.0 } };
        (ln_ratio, kld, rms, same)
    }

    /// The statistics llama-perplexity prints at the end.
    pub fn report(&self) -> Statistics {
        let kld = self.with_base.then(|| {
            let n = self.count;
            let l = mean_and_uncertainty(self.sum_nll, self.sum_nll2, n);
            let lb = mean_and_uncertainty(self.sum_nll_base, self.sum_nll_base2, n);
            let ppl_q = self.ppl_q();
            let ppl_base = Estimate { value: lb.value.exp(), uncertainty: lb.value.exp() * lb.uncertainty };
            let cov = covariance(self.sum_nll, self.sum_nll_base, self.sum_nll_nll_base, n);
            let (ln_ppl_ratio, kld, rms_delta_p, same_top_p) = self.kld_running();
            let ratio = ln_ppl_ratio.value.exp();
            let ppl_cov = ppl_q.value * ppl_base.value * cov;
            let mut kv = self.kld_values.clone();
            kv.sort_by(f64::total_cmp);
            let mut pv = self.p_diff_values.clone();
            pv.sort_by(f64::total_cmp);
            KldStatistics {
                ppl_q,
                ppl_base,
                cor_ln_ppl: cov / (l.uncertainty * lb.uncertainty),
                ln_ppl_ratio,
                ppl_ratio: Estimate { value: ratio, uncertainty: ratio * ln_ppl_ratio.uncertainty },
                ppl_diff: Estimate {
                    value: ppl_q.value - ppl_base.value,
                    uncertainty: sqrt0(ppl_q.uncertainty.powi(2) + ppl_base.uncertainty.powi(2) - 2.0 * ppl_cov),
                },
                kld: Spread::of(kld, &kv),
                delta_p: Spread::of(mean_and_uncertainty(self.sum_p_diff, self.sum_p_diff2, n), &pv),
                rms_delta_p,
                same_top_p,
            }
        });
        Statistics { scored: self.count, ppl: self.ppl(), chunks: self.chunks.clone(), kld }
    }
}

/// The running values after one window (llama-perplexity's per-chunk line).
#[derive(Clone, Debug, Serialize)]
pub struct Chunk {
    /// 1-based, as llama.cpp numbers chunks.
    pub window: usize,
    pub ppl: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ppl_uncertainty: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ln_ppl_ratio: Option<Estimate>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kld: Option<Estimate>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rms_delta_p: Option<Estimate>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub same_top_p: Option<Estimate>,
}

/// Mean ± uncertainty and the percentiles of one per-token quantity.
#[derive(Clone, Debug, Serialize)]
pub struct Spread {
    pub mean: f64,
    pub uncertainty: f64,
    pub max: f64,
    pub p99_9: f64,
    pub p99: f64,
    pub p95: f64,
    pub p90: f64,
    pub p75: f64,
    pub median: f64,
    pub p25: f64,
    pub p10: f64,
    pub p5: f64,
    pub p1: f64,
    pub p0_1: f64,
    pub min: f64,
}

impl Spread {
    fn of(mean: Estimate, sorted: &[f64]) -> Spread {
        let q = |f| percentile(sorted, f);
        Spread {
            mean: mean.value,
            uncertainty: mean.uncertainty,
            max: sorted.last().copied().unwrap_or(0.0),
            p99_9: q(0.999),
            p99: q(0.99),
            p95: q(0.95),
            p90: q(0.90),
            p75: q(0.75),
            median: median(sorted),
            p25: q(0.25),
            p10: q(0.10),
            p5: q(0.05),
            p1: q(0.01),
            p0_1: q(0.001),
            min: sorted.first().copied().unwrap_or(0.0),
        }
    }
}

/// Against a reference: llama-perplexity's `--kl-divergence` summary. Probabilities (Δp,
/// same-top p) are fractions, not percent.
#[derive(Clone, Debug, Serialize)]
pub struct KldStatistics {
    pub ppl_q: Estimate,
    pub ppl_base: Estimate,
    /// Cor(ln PPL(Q), ln PPL(base)), a fraction.
    pub cor_ln_ppl: f64,
    pub ln_ppl_ratio: Estimate,
    pub ppl_ratio: Estimate,
    pub ppl_diff: Estimate,
    pub kld: Spread,
    pub delta_p: Spread,
    pub rms_delta_p: Estimate,
    pub same_top_p: Estimate,
}

#[derive(Clone, Debug, Serialize)]
pub struct Statistics {
    /// Scored positions (llama.cpp's `count`).
    pub scored: usize,
    /// The model's perplexity (llama-perplexity's "Final estimate").
    pub ppl: Estimate,
    pub chunks: Vec<Chunk>,
    /// Present with `--ref` or `--ref-logits`.
    pub kld: Option<KldStatistics>,
}

// ---------------------------------------------------------------------------------------------
// The command.

/// What ran, beside the statistics, in the JSON object.
#[derive(Serialize)]
struct Run<'a> {
    model: String,
    #[serde(rename = "ref")]
    reference: Option<String>,
    ref_logits: Option<String>,
    arch: &'a str,
    backend: &'a str,
    text: String,
    text_tokens: usize,
    add_bos: bool,
    ctx: usize,
    windows: usize,
    seconds: f64,
    /// Tokens through the engines per second (with --ref both models' tokens count).
    tok_s: f64,
    #[serde(flatten)]
    stats: &'a Statistics,
}

enum Reference {
    None,
    Archive { path: String, session: thin::Session },
    Logits(LogitsReader),
}

fn read_text(path: &Path) -> Result<String, EvalError> {
    let text = std::fs::read_to_string(path).map_err(|source| EvalError::TextRead { path: path.display().to_string(), source })?;
    if text.trim().is_empty() {
        return Err(EvalError::EmptyText { path: path.display().to_string() });
    }
    Ok(text)
}

/// The text's windows as evaluated: `ctx` tokens each, BOS in place of the first when the
/// tokenizer adds BOS; at most `chunks` of them.
fn windows(tokens: &[u32], ctx: usize, bos: Option<u32>, chunks: Option<u64>) -> Vec<Vec<u32>> {
    let n = (tokens.len() / ctx).min(chunks.map_or(usize::MAX, |c| c.try_into().unwrap_or(usize::MAX)));
    (0..n)
        .map(|w| {
            let mut win = tokens[w * ctx..(w + 1) * ctx].to_vec();
            if let Some(b) = bos {
                win[0] = b;
            }
            win
        })
        .collect()
}

/// The logits at position `pos` of `window` (scored positions only, in order): the first scored
/// position resets the engine and prefills up to it, each later one is one decode step.
fn logits_at<'e>(e: &'e mut dyn thin::LoadedEngine, window: &[u32], pos: usize) -> Result<&'e [f32], EngineError> {
    let first = window.len() / 2;
    if pos == first {
        e.reset();
        e.prefill(&window[..=first])
    } else {
        e.decode_step(window[pos])
    }
}

fn checked<'a>(logits: &'a [f32], vocab: usize, archive: &str, window: usize, pos: usize) -> Result<&'a [f32], EvalError> {
    if logits.len() != vocab {
        return Err(EvalError::LogitsLength { archive: archive.into(), got: logits.len(), vocab });
    }
    if !logits.iter().all(|x| x.is_finite()) {
        return Err(EvalError::NonFinite { archive: archive.into(), window, pos });
    }
    Ok(logits)
}

pub fn eval(a: EvalArgs) -> anyhow::Result<()> {
    let model_path = a.model.display().to_string();
    let text = read_text(&a.text)?;
    let ref_logits = a.ref_logits.as_deref().map(LogitsReader::open).transpose()?;
    if let (Some(save), Some(r)) = (&a.save_logits, &a.ref_logits) {
        let same = save == r || matches!((save.canonicalize(), r.canonicalize()), (Ok(x), Ok(y)) if x == y);
        if same {
            return Err(EvalError::SaveOverRef(save.display().to_string()).into());
        }
    }
    let ctx = match (a.ctx, &ref_logits) {
        (Some(c), Some(r)) if c != r.header().ctx => {
            return Err(LogitsFileError::Ctx { path: r.path().into(), file: r.header().ctx, requested: c }.into())
        }
        (Some(c), _) => c,
        (None, Some(r)) => r.header().ctx,
        (None, None) => DEFAULT_CTX,
    };
    if ctx < 3 {
        return Err(EvalError::CtxTooSmall { ctx }.into());
    }

    let opts = |backend| thin::Options { backend, ctx: Some(ctx), ..Default::default() };
    let mut model = thin::open(&a.model, &opts(a.backend)).with_context(|| format!("opening {model_path}"))?;
    // thin::open refused a --ctx above the model's maximum.
    let m = model.archive().manifest();
    let vocab = m.arch.dims.vocab_size as usize;
    let fingerprint = m.shape_fingerprint.clone();
    let add_bos = m.tokenizer.add_bos && m.tokenizer.bos_token_id.is_some();
    let bos = m.tokenizer.bos_token_id.filter(|_| add_bos);
    let tokens = model.tokenizer().encode(&text).context("tokenizing the text")?;
    if tokens.len() < 2 * ctx {
        return Err(EvalError::TextTooShort { path: a.text.display().to_string(), tokens: tokens.len(), ctx }.into());
    }
    let wins = windows(&tokens, ctx, bos, a.chunks);

    let mut reference = match (&a.reference, ref_logits) {
        (Some(path), _) => {
            let p = path.display().to_string();
            let session = thin::open(path, &opts(a.backend)).with_context(|| format!("opening the reference {p}"))?;
            let rm = session.archive().manifest();
            if rm.arch.dims.vocab_size != m.arch.dims.vocab_size {
                return Err(EvalError::VocabMismatch { reference: p, reference_vocab: rm.arch.dims.vocab_size, model_vocab: m.arch.dims.vocab_size }.into());
            }
            if rm.shape_fingerprint != fingerprint {
                return Err(EvalError::ArchMismatch {
                    reference: p,
                    reference_arch: format!("{:?}, {} layers, hidden {}", rm.arch.dims.family, rm.arch.dims.num_layers, rm.arch.dims.hidden_size),
                    reference_fingerprint: rm.shape_fingerprint.clone(),
                    model_arch: format!("{:?}, {} layers, hidden {}", m.arch.dims.family, m.arch.dims.num_layers, m.arch.dims.hidden_size),
                    model_fingerprint: fingerprint,
                }
                .into());
            }
            let ref_tokens = session.tokenizer().encode(&text).context("tokenizing the text with the reference's tokenizer")?;
            let ref_bos = rm.tokenizer.bos_token_id.filter(|_| rm.tokenizer.add_bos);
            if let Some(pos) = (0..tokens.len().max(ref_tokens.len())).find(|&i| tokens.get(i) != ref_tokens.get(i)).or((bos != ref_bos).then_some(0)) {
                return Err(EvalError::TokenizerMismatch {
                    reference: p,
                    pos,
                    reference_id: ref_tokens.get(pos).copied().unwrap_or(u32::MAX),
                    model_id: tokens.get(pos).copied().unwrap_or(u32::MAX),
                }
                .into());
            }
            Reference::Archive { path: p, session }
        }
        (None, Some(r)) => {
            r.check(vocab, &fingerprint, &wins, a.chunks.is_some())?;
            Reference::Logits(r)
        }
        (None, None) => Reference::None,
    };
    let mut saver = match &a.save_logits {
        Some(path) => {
            let header = LogitsHeader { vocab, ctx, windows: wins.len(), fingerprint: fingerprint.clone(), archive_hash: model.archive().header().archive_hash };
            Some(LogitsWriter::create(path, &header, &wins).with_context(|| format!("creating {}", path.display()))?)
        }
        None => None,
    };

    let first = ctx / 2;
    let engines = if matches!(reference, Reference::Archive { .. }) { 2 } else { 1 };
    eprintln!(
        "eval: {} tokens; {} windows of {ctx} tokens (the last {} of each scored); {} on {}{}",
        tokens.len(),
        wins.len(),
        scored_per_window(ctx),
        model.arch(),
        model.backend(),
        if add_bos { "; BOS starts each window" } else { "" }
    );
    let bar = indicatif::ProgressBar::new((wins.len() * ctx * engines) as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} tokens {per_sec} window {msg} eta {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let start = Instant::now();
    let mut scores = Scores::new(!matches!(reference, Reference::None));
    for (w, win) in wins.iter().enumerate() {
        bar.set_message(format!("{}/{}", w + 1, wins.len()));
        for pos in first..ctx - 1 {
            let step = |source| EvalError::Step { archive: model_path.clone(), window: w, pos, source };
            let q = checked(logits_at(model.engine(), win, pos).map_err(step)?, vocab, &model_path, w, pos)?;
            let base = match &mut reference {
                Reference::None => None,
                Reference::Archive { path, session } => {
                    let l = logits_at(session.engine(), win, pos).map_err(|source| EvalError::Step { archive: path.clone(), window: w, pos, source })?;
                    Some(checked(l, vocab, path, w, pos)?)
                }
                Reference::Logits(r) => {
                    let path = r.path().to_string();
                    Some(checked(r.next_row()?, vocab, &path, w, pos)?)
                }
            };
            if let Some(s) = &mut saver {
                s.write_row(q).context("writing --save-logits")?;
            }
            scores.add(q, base, win[pos + 1]);
            let fed = if pos == first { first + 1 } else { 1 };
            bar.inc((fed * engines) as u64);
        }
        bar.inc(engines as u64); // the window's last token is never fed: nothing predicts past it
        let chunk = scores.end_window();
        if !a.json {
            print_chunk(chunk, w == 0);
        }
        if bar.is_hidden() {
            // No terminal to draw the bar on (a log, CI): one line per window instead.
            let s = start.elapsed().as_secs_f64();
            eprintln!("eval: window {}/{} done, {s:.1} s, {:.1} tok/s", w + 1, wins.len(), ((w + 1) * ctx * engines) as f64 / s.max(1e-9));
        }
    }
    bar.finish_and_clear();
    let seconds = start.elapsed().as_secs_f64();
    if let Some(s) = saver {
        s.finish().context("finishing --save-logits")?;
    }
    let stats = scores.report();
    let tok_s = if seconds > 0.0 { (wins.len() * ctx * engines) as f64 / seconds } else { 0.0 };
    eprintln!(
        "eval: {} windows × {ctx} tokens × {engines} model{} in {seconds:.1} s ({tok_s:.1} tok/s); {} positions scored",
        wins.len(),
        if engines == 1 { "" } else { "s" },
        stats.scored
    );
    if a.json {
        let run = Run {
            model: model_path,
            reference: a.reference.as_ref().map(|p| p.display().to_string()),
            ref_logits: a.ref_logits.as_ref().map(|p| p.display().to_string()),
            arch: model.arch(),
            backend: model.backend(),
            text: a.text.display().to_string(),
            text_tokens: tokens.len(),
            add_bos,
            ctx,
            windows: wins.len(),
            seconds,
            tok_s,
            stats: &stats,
        };
        println!("{}", serde_json::to_string_pretty(&run)?);
    } else {
        print!("{}", to_text(&stats));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// llama-perplexity's layout.

fn print_chunk(c: &Chunk, first: bool) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let _ = match (&c.kld, &c.ln_ppl_ratio, &c.rms_delta_p, &c.same_top_p) {
        (Some(k), Some(r), Some(d), Some(s)) => {
            if first {
                let _ = writeln!(out, "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p");
            }
            writeln!(
                out,
                "{:4}    {:9.4} ± {:9.4}    {:10.5} ± {:10.5}    {:10.5} ± {:10.5}    {:6.3} ± {:6.3} %    {:6.3} ± {:6.3} %",
                c.window,
                c.ppl,
                c.ppl_uncertainty.unwrap_or(0.0),
                r.value,
                r.uncertainty,
                k.value,
                k.uncertainty,
                100.0 * d.value,
                100.0 * d.uncertainty,
                100.0 * s.value,
                100.0 * s.uncertainty
            )
        }
        _ => write!(out, "[{}]{:.4},", c.window, c.ppl),
    };
    let _ = out.flush();
}

/// The closing statistics as llama-perplexity prints them.
pub fn to_text(s: &Statistics) -> String {
    let Some(k) = &s.kld else {
        return format!("\nFinal estimate: PPL = {:.4} +/- {:.5}\n", s.ppl.value, s.ppl.uncertainty);
    };
    let mut o = String::from("\n");
    let e = |o: &mut String, name: &str, v: &Estimate| o.push_str(&format!("{name:<30}: {:10.6} ± {:10.6}\n", v.value, v.uncertainty));
    o.push_str("====== Perplexity statistics ======\n");
    e(&mut o, "Mean PPL(Q)", &k.ppl_q);
    e(&mut o, "Mean PPL(base)", &k.ppl_base);
    o.push_str(&format!("Cor(ln(PPL(Q)), ln(PPL(base))): {:6.2}%\n", 100.0 * k.cor_ln_ppl));
    e(&mut o, "Mean ln(PPL(Q)/PPL(base))", &k.ln_ppl_ratio);
    e(&mut o, "Mean PPL(Q)/PPL(base)", &k.ppl_ratio);
    e(&mut o, "Mean PPL(Q)-PPL(base)", &k.ppl_diff);
    o.push_str("\n====== KL divergence statistics ======\n");
    let d = &k.kld;
    o.push_str(&format!("Mean    KLD: {:10.6} ± {:10.6}\n", d.mean, d.uncertainty));
    for (name, v) in [
        ("Maximum KLD", d.max),
        ("99.9%   KLD", d.p99_9),
        ("99.0%   KLD", d.p99),
        ("95.0%   KLD", d.p95),
        ("90.0%   KLD", d.p90),
        ("Median  KLD", d.median),
        ("10.0%   KLD", d.p10),
        (" 5.0%   KLD", d.p5),
        (" 1.0%   KLD", d.p1),
        (" 0.1%   KLD", d.p0_1),
        ("Minimum KLD", d.min),
    ] {
        o.push_str(&format!("{name}: {v:10.6}\n"));
    }
    o.push_str("\n====== Token probability statistics ======\n");
    let d = &k.delta_p;
    o.push_str(&format!("Mean    Δp: {:6.3} ± {:5.3} %\n", 100.0 * d.mean, 100.0 * d.uncertainty));
    for (name, v) in [
        ("Maximum Δp", d.max),
        ("99.9%   Δp", d.p99_9),
        ("99.0%   Δp", d.p99),
        ("95.0%   Δp", d.p95),
        ("90.0%   Δp", d.p90),
        ("75.0%   Δp", d.p75),
        ("Median  Δp", d.median),
        ("25.0%   Δp", d.p25),
        ("10.0%   Δp", d.p10),
        (" 5.0%   Δp", d.p5),
        (" 1.0%   Δp", d.p1),
        (" 0.1%   Δp", d.p0_1),
        ("Minimum Δp", d.min),
    ] {
        o.push_str(&format!("{name}: {:6.3}%\n", 100.0 * v));
    }
    o.push_str(&format!("RMS Δp    : {:6.3} ± {:5.3} %\n", 100.0 * k.rms_delta_p.value, 100.0 * k.rms_delta_p.uncertainty));
    o.push_str(&format!("Same top p: {:6.3} ± {:5.3} %\n", 100.0 * k.same_top_p.value, 100.0 * k.same_top_p.uncertainty));
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixtures() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/eval")
    }

    /// Every number in `want` equals the one at the same place in `got`, to `rel` relative.
    fn assert_close(want: &serde_json::Value, got: &serde_json::Value, at: &str, rel: f64) {
        use serde_json::Value;
        match want {
            Value::Object(w) => {
                for (k, v) in w {
                    let g = got.get(k).unwrap_or_else(|| panic!("{at}.{k} is missing from ours: {got}"));
                    assert_close(v, g, &format!("{at}.{k}"), rel);
                }
            }
            Value::Array(w) => {
                let g = got.as_array().unwrap_or_else(|| panic!("{at} is not an array in ours"));
                assert_eq!(w.len(), g.len(), "{at}: length");
                for (i, (a, b)) in w.iter().zip(g).enumerate() {
                    assert_close(a, b, &format!("{at}[{i}]"), rel);
                }
            }
            Value::Number(w) => {
                let (w, g) = (w.as_f64().expect("number"), got.as_f64().unwrap_or_else(|| panic!("{at}: ours is {got}")));
                assert!((w - g).abs() <= rel * w.abs().max(g.abs()) + 1e-15, "{at}: numpy {w:e}, ours {g:e}");
            }
            _ => {}
        }
    }

    /// Scores from a model/reference pair of saved-logits files.
    fn scores_of(model: &str, reference: &str) -> Statistics {
        let mut m = LogitsReader::open(&fixtures().join(model)).expect("model logits");
        let mut r = LogitsReader::open(&fixtures().join(reference)).expect("reference logits");
        let h = m.header().clone();
        assert_eq!((h.vocab, h.ctx, h.windows), (r.header().vocab, r.header().ctx, r.header().windows));
        let mut s = Scores::new(true);
        for w in 0..h.windows {
            let tokens = m.window_tokens(w).to_vec();
            assert_eq!(tokens, r.window_tokens(w), "window {w}");
            for pos in h.ctx / 2..h.ctx - 1 {
                let q = m.next_row().expect("row").to_vec();
                s.add(&q, Some(r.next_row().expect("row")), tokens[pos + 1]);
            }
            s.end_window();
        }
        s.report()
    }

    #[test]
    fn statistics_equal_numpy() {
        // scripts/eval_reference.py computed these from the same files with numpy.
        let expected: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixtures().join("expected.json")).expect("expected.json")).expect("json");
        let cases = expected.as_object().expect("cases");
        assert_eq!(cases.len(), 2);
        for (name, want) in cases {
            let got = serde_json::to_value(scores_of(want["model"].as_str().expect("model"), want["ref"].as_str().expect("ref"))).expect("json");
            let mut want = want.clone();
            let w = want.as_object_mut().expect("case");
            w.remove("model");
            w.remove("ref");
            assert_close(&want, &got, name, 1e-6);
        }
    }

    #[test]
    fn two_token_vocabulary_by_hand() {
        // Model q = softmax(0, ln 3) = (1/4, 3/4); reference p = (1/2, 1/2); next token 1.
        let mut s = Scores::new(true);
        s.add(&[0.0, 3f32.ln()], Some(&[0.0, 0.0]), 1);
        let r = s.report();
        let k = r.kld.expect("kld");
        // KL(p || q) = ½ ln(½ / ¼) + ½ ln(½ / ¾) = ½ ln(4/3).
        assert!((k.kld.mean - 0.5 * (4.0f64 / 3.0).ln()).abs() < 1e-7, "{}", k.kld.mean);
        assert!((k.delta_p.mean - 0.25).abs() < 1e-7);
        // argmax: model 1, reference 0 (a tie resolves to the first index).
        assert_eq!(k.same_top_p.value, 0.0);
        assert!((r.ppl.value - 4.0 / 3.0).abs() < 1e-6, "{}", r.ppl.value);
        assert!((k.ppl_base.value - 2.0).abs() < 1e-6);
        assert!((k.ln_ppl_ratio.value - (2.0f64 / 3.0).ln()).abs() < 1e-6);
        // One value: no uncertainty.
        assert_eq!((k.kld.uncertainty, r.ppl.uncertainty), (0.0, 0.0));
    }

    #[test]
    fn a_model_against_itself_scores_zero() {
        let rows: Vec<Vec<f32>> = (0..40).map(|i| (0..7).map(|j| ((i * 7 + j) % 5) as f32 * 0.7 - 1.0).collect()).collect();
        let mut s = Scores::new(true);
        for (i, r) in rows.iter().enumerate() {
            s.add(r, Some(r), (i % 7) as u32);
        }
        s.end_window();
        let k = s.report().kld.expect("kld");
        assert_eq!((k.kld.mean, k.kld.max, k.delta_p.max, k.rms_delta_p.value), (0.0, 0.0, 0.0, 0.0));
        assert_eq!((k.same_top_p.value, k.ppl_ratio.value, k.ln_ppl_ratio.value), (1.0, 1.0, 0.0));
        assert_eq!((k.ln_ppl_ratio.uncertainty, k.rms_delta_p.uncertainty), (0.0, 0.0));
    }

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 0.5), 2.5);
        assert!((percentile(&v, 0.999) - 3.997).abs() < 1e-12);
        assert_eq!((percentile(&v, 0.0), percentile(&v, 1.0)), (1.0, 4.0));
        assert_eq!((median(&v), median(&v[..3])), (2.5, 2.0));
        // Standard error of the mean of 1..=11: population variance 10, sqrt(10/10) = 1.
        let xs: Vec<f64> = (1..=11).map(f64::from).collect();
        let e = mean_and_uncertainty(xs.iter().sum(), xs.iter().map(|x| x * x).sum(), 11);
        assert_eq!(e.value, 6.0);
        assert!((e.uncertainty - 1.0).abs() < 1e-12);
        assert_eq!(mean_and_uncertainty(10.0, 30.0, 10).uncertainty, 0.0, "10 values: no uncertainty");
    }

    #[test]
    fn windows_start_with_bos_and_drop_the_rest() {
        let t: Vec<u32> = (10..31).collect();
        let w = windows(&t, 8, Some(1), None);
        assert_eq!(w, vec![vec![1, 11, 12, 13, 14, 15, 16, 17], vec![1, 19, 20, 21, 22, 23, 24, 25]]);
        assert_eq!(windows(&t, 8, None, Some(1)), vec![(10..18).collect::<Vec<u32>>()]);
        assert_eq!((scored_per_window(512), scored_per_window(16), scored_per_window(3), scored_per_window(2)), (255, 7, 1, 0));
    }

    // --- the saved-logits file as hostile input

    fn header() -> LogitsHeader {
        LogitsHeader { vocab: 5, ctx: 4, windows: 2, fingerprint: "abc123".into(), archive_hash: [7; 32] }
    }

    fn valid_file(dir: &Path) -> (PathBuf, Vec<Vec<u32>>) {
        let path = dir.join("x.logits");
        let wins = vec![vec![1, 2, 3, 4], vec![1, 3, 2, 4]];
        let mut w = LogitsWriter::create(&path, &header(), &wins).expect("create");
        for i in 0..2 {
            w.write_row(&[i as f32, 1.0, 2.0, 3.0, 4.0]).expect("row");
        }
        w.finish().expect("finish");
        (path, wins)
    }

    fn rewrite(path: &Path, f: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
        let mut b = std::fs::read(path).expect("read");
        f(&mut b);
        let out = path.with_extension("bad");
        std::fs::write(&out, b).expect("write");
        out
    }

    #[test]
    fn logits_file_round_trips() {
        let tmp = tempfile::tempdir().expect("tmp");
        let (path, wins) = valid_file(tmp.path());
        assert_eq!(std::fs::metadata(&path).expect("meta").len(), 128 + 4 * 8 + 4 * 2 * 5);
        let mut r = LogitsReader::open(&path).expect("open");
        assert_eq!(r.header(), &header());
        assert_eq!(r.window_tokens(1), &wins[1][..]);
        r.check(5, "abc123", &wins, false).expect("fits");
        assert_eq!(r.next_row().expect("row"), &[0.0, 1.0, 2.0, 3.0, 4.0]);
        assert_eq!(r.next_row().expect("row"), &[1.0, 1.0, 2.0, 3.0, 4.0]);
        assert!(r.next_row().is_err(), "past the end");
        assert_eq!(std::fs::read_dir(tmp.path()).expect("ls").count(), 1, "no temporary left");
    }

    #[test]
    fn an_unfinished_writer_leaves_nothing() {
        let tmp = tempfile::tempdir().expect("tmp");
        let path = tmp.path().join("x.logits");
        let w = LogitsWriter::create(&path, &header(), &[vec![1, 2, 3, 4], vec![1, 2, 3, 4]]).expect("create");
        drop(w);
        assert_eq!(std::fs::read_dir(tmp.path()).expect("ls").count(), 0);
    }

    #[test]
    fn hostile_logits_files_are_refused_by_name() {
        let tmp = tempfile::tempdir().expect("tmp");
        let (path, wins) = valid_file(tmp.path());
        let open = |p: &Path| LogitsReader::open(p).err().expect("refused");
        let set = |at: usize, v: u32| move |b: &mut Vec<u8>| b[at..at + 4].copy_from_slice(&v.to_le_bytes());
        assert!(matches!(open(&rewrite(&path, |b| b[0] = b'X')), LogitsFileError::Magic { .. }));
        assert!(matches!(open(&rewrite(&path, |b| b.truncate(5))), LogitsFileError::Magic { .. }));
        assert!(matches!(open(&rewrite(&path, |b| b.truncate(100))), LogitsFileError::Truncated { expected: 128, .. }));
        assert!(matches!(open(&rewrite(&path, |b| b.truncate(b.len() - 1))), LogitsFileError::Truncated { .. }));
        assert!(matches!(open(&rewrite(&path, |b| b.push(0))), LogitsFileError::TrailingBytes { .. }));
        assert!(matches!(open(&rewrite(&path, set(8, 2))), LogitsFileError::Version { version: 2, .. }));
        assert!(matches!(open(&rewrite(&path, set(12, 0))), LogitsFileError::Header { .. }));
        assert!(matches!(open(&rewrite(&path, set(16, 2))), LogitsFileError::Header { .. }));
        assert!(matches!(open(&rewrite(&path, set(20, 0))), LogitsFileError::Header { .. }));
        assert!(matches!(open(&rewrite(&path, set(24, 2))), LogitsFileError::Header { .. }));
        assert!(matches!(open(&rewrite(&path, set(28, 1))), LogitsFileError::Header { .. }));
        assert!(matches!(open(&rewrite(&path, |b| b[40] = b'z')), LogitsFileError::Header { .. }), "not zero-padded");
        // Sizes that overflow, or claim far more than the file holds, allocate nothing.
        assert!(matches!(open(&rewrite(&path, set(12, u32::MAX))), LogitsFileError::Truncated { .. }));
        let e = open(&rewrite(&path, |b| {
            for at in [12, 20] {
                b[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
            }
            b[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
            b[24..28].copy_from_slice(&scored_per_window(u32::MAX as usize).to_le_bytes()[..4]);
        }));
        assert!(matches!(e, LogitsFileError::Truncated { .. } | LogitsFileError::Header { .. }), "{e}");

        // A well-formed file that does not fit the model or the text.
        let r = LogitsReader::open(&path).expect("open");
        let msg = |e: LogitsFileError| e.to_string();
        assert!(matches!(r.check(6, "abc123", &wins, false), Err(LogitsFileError::Vocab { file: 5, model: 6, .. })));
        assert!(msg(r.check(5, "other", &wins, false).expect_err("arch")).contains("another architecture"));
        assert!(matches!(r.check(5, "abc123", &wins[..1], false), Err(LogitsFileError::Windows { file: 2, text: 1, .. })));
        r.check(5, "abc123", &wins[..1], true).expect("--chunks 1 reads the first window");
        let other = vec![vec![1, 2, 3, 4], vec![1, 3, 9, 4]];
        assert!(matches!(r.check(5, "abc123", &other, false), Err(LogitsFileError::Token { window: 1, pos: 2, file: 2, text: 9, .. })));
    }
}
