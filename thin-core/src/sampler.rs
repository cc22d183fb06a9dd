//! Token sampling: a repetition penalty, then greedy or temperature with top-k, top-p (nucleus)
//! and min-p cuts, drawn from a seeded, reproducible RNG. The definitions are llama.cpp's.

/// How the next token is chosen from a logits row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplerConfig {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    /// 1.0 means no nucleus cut.
    pub top_p: f32,
    /// Keep only tokens whose probability (after temperature) is at least `min_p` times the most
    /// likely one's; 0 means no cut.
    pub min_p: f32,
    /// Divides the positive logits and multiplies the negative ones of every token seen in the
    /// last `repeat_last_n` tokens (prompt included), before greedy or sampling; 1.0 means off.
    pub repeat_penalty: f32,
    /// How many of the latest tokens the repetition penalty looks at; 0 means off.
    pub repeat_last_n: usize,
    pub seed: u64,
}

/// llama.cpp's `--repeat-last-n` default.
pub const DEFAULT_REPEAT_LAST_N: usize = 64;

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, repeat_penalty: 1.0, repeat_last_n: DEFAULT_REPEAT_LAST_N, seed: 0 }
    }
}

impl SamplerConfig {
    /// Whether the repetition penalty changes anything.
    pub fn penalizes(&self) -> bool {
        self.repeat_penalty != 1.0 && self.repeat_last_n > 0
    }
}

/// splitmix64: tiny, fast and the same stream on every platform for a given seed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// Chooses tokens; every buffer is reused, so no token after the first allocates.
pub struct Sampler {
    config: SamplerConfig,
    rng: Rng,
    /// Candidate (id, logit or probability) pairs.
    candidates: Vec<(u32, f32)>,
    /// The last `repeat_last_n` accepted tokens, a ring: `recent_next` is the oldest once full.
    recent: Vec<u32>,
    recent_next: usize,
    /// The distinct tokens of `recent` (each is penalized once however often it came).
    distinct: Vec<u32>,
    /// The logits row with the penalty applied (the engine's own row is not ours to change).
    penalized: Vec<f32>,
}

/// Index of the largest logit; ties go to the lowest index (as torch.argmax). NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best as u32
}

/// llama.cpp's repetition penalty on one logit: a positive one is divided, a negative (or zero)
/// one multiplied, so a penalty above 1 always makes the token less likely.
fn penalize(logit: f32, penalty: f32) -> f32 {
    if logit <= 0.0 {
        logit * penalty
    } else {
        logit / penalty
    }
}

impl Sampler {
    pub fn new(config: SamplerConfig) -> Self {
        let window = if config.penalizes() { config.repeat_last_n } else { 0 };
        Sampler {
            config,
            rng: Rng::new(config.seed),
            candidates: Vec::new(),
            recent: Vec::with_capacity(window),
            recent_next: 0,
            distinct: Vec::with_capacity(window),
            penalized: Vec::new(),
        }
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.config
    }

    /// A token that is now part of the text (a prompt token or a chosen one): it enters the
    /// repetition penalty's window.
    pub fn accept(&mut self, id: u32) {
        if !self.config.penalizes() {
            return;
        }
        if self.recent.len() < self.config.repeat_last_n {
            self.recent.push(id);
        } else {
            self.recent[self.recent_next] = id;
            self.recent_next = (self.recent_next + 1) % self.recent.len();
        }
    }

    /// The next token from a logits row (see [`SamplerConfig`] for the order of the steps).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let c = self.config;
        let logits = if c.penalizes() && !self.recent.is_empty() {
            self.penalized.clear();
            self.penalized.extend_from_slice(logits);
            self.distinct.clear();
            self.distinct.extend_from_slice(&self.recent);
            self.distinct.sort_unstable();
            self.distinct.dedup();
            for &id in &self.distinct {
                if let Some(x) = self.penalized.get_mut(id as usize) {
                    *x = penalize(*x, c.repeat_penalty);
                }
            }
            &self.penalized[..]
        } else {
            logits
        };
        if c.temperature <= 0.0 || logits.is_empty() {
            return argmax(logits);
        }
        let cand = &mut self.candidates;
        cand.clear();
        cand.extend(logits.iter().enumerate().filter(|(_, v)| v.is_finite()).map(|(i, &v)| (i as u32, v / c.temperature)));
        if cand.is_empty() {
            return argmax(logits);
        }
        // Descending by logit, ties by id, so the order (and thus the sample) is deterministic.
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if c.top_k > 0 && c.top_k < cand.len() {
            cand.select_nth_unstable_by(c.top_k - 1, by_logit);
            cand.truncate(c.top_k);
        }
        cand.sort_unstable_by(by_logit);
        let max = cand[0].1;
        let mut sum = 0.0f32;
        for x in cand.iter_mut() {
            x.1 = (x.1 - max).exp();
            sum += x.1;
        }
        for x in cand.iter_mut() {
            x.1 /= sum;
        }
        if c.top_p < 1.0 {
            let mut acc = 0.0f32;
            let mut keep = cand.len();
            for (i, x) in cand.iter().enumerate() {
                acc += x.1;
                if acc >= c.top_p {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep.max(1));
        }
        if c.min_p > 0.0 {
            // Sorted: the first is the most likely, and the kept tokens are a prefix.
            let floor = c.min_p * cand[0].1;
            let keep = cand.iter().position(|x| x.1 < floor).unwrap_or(cand.len());
            cand.truncate(keep.max(1));
        }
        let total: f32 = cand.iter().map(|x| x.1).sum();
        let r = self.rng.next_f32() * total;
        let mut acc = 0.0f32;
        for x in cand.iter() {
            acc += x.1;
            if r < acc {
                return x.0;
            }
        }
        cand[cand.len() - 1].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_argmax_and_ignores_nan() {
        let mut s = Sampler::new(SamplerConfig::default());
        assert_eq!(s.sample(&[0.1, 2.0, f32::NAN, 1.9]), 1);
        assert_eq!(argmax(&[1.0, 1.0]), 0);
    }

    #[test]
    fn top_k_one_is_greedy() {
        let mut s = Sampler::new(SamplerConfig { temperature: 1.5, top_k: 1, seed: 9, ..Default::default() });
        for _ in 0..50 {
            assert_eq!(s.sample(&[0.0, 3.0, 2.9, -1.0]), 1);
        }
    }

    #[test]
    fn top_p_cuts_the_tail() {
        // probabilities ~ [0.665, 0.245, 0.09]: top_p 0.6 keeps only the first.
        let mut s = Sampler::new(SamplerConfig { temperature: 1.0, top_p: 0.6, seed: 3, ..Default::default() });
        for _ in 0..50 {
            assert_eq!(s.sample(&[2.0, 1.0, 0.0]), 0);
        }
    }

    #[test]
    fn sampling_follows_the_distribution_and_is_seeded() {
        let logits = [0.0f32, (3.0f32).ln()]; // p = [0.25, 0.75]
        let cfg = SamplerConfig { temperature: 1.0, seed: 42, ..Default::default() };
        let mut s = Sampler::new(cfg);
        let n = 20_000;
        let ones = (0..n).filter(|_| s.sample(&logits) == 1).count() as f32 / n as f32;
        assert!((ones - 0.75).abs() < 0.02, "{ones}");
        let a: Vec<u32> = { let mut s = Sampler::new(cfg); (0..100).map(|_| s.sample(&logits)).collect() };
        let b: Vec<u32> = { let mut s = Sampler::new(cfg); (0..100).map(|_| s.sample(&logits)).collect() };
        assert_eq!(a, b);
    }

    /// Share of `n` draws that are each id, the sampler fed the same row every time.
    fn shares(s: &mut Sampler, logits: &[f32], n: usize) -> Vec<f32> {
        let mut count = vec![0usize; logits.len()];
        for _ in 0..n {
            count[s.sample(logits) as usize] += 1;
        }
        count.iter().map(|&c| c as f32 / n as f32).collect()
    }

    #[test]
    fn min_p_cuts_relative_to_the_most_likely_token_after_temperature() {
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.15f32.ln(), 0.05f32.ln()];
        // T = 1: p = [0.5, 0.3, 0.15, 0.05]; min_p 0.35 keeps p >= 0.175: ids 0 and 1, renormalized
        // to [0.625, 0.375].
        let cfg = SamplerConfig { temperature: 1.0, min_p: 0.35, seed: 1, ..Default::default() };
        let got = shares(&mut Sampler::new(cfg), &logits, 20_000);
        assert_eq!((got[2], got[3]), (0.0, 0.0), "{got:?}");
        assert!((got[1] - 0.375).abs() < 0.02, "{got:?}");
        // T = 2: p ∝ sqrt([0.5, 0.3, 0.15, 0.05]) = [0.7071, 0.5477, 0.3873, 0.2236], ratios to the
        // first [1, 0.775, 0.548, 0.316]: id 2 is kept now, id 3 still cut; p2 = 0.3873 / 1.6421 = 0.2359.
        let got = shares(&mut Sampler::new(SamplerConfig { temperature: 2.0, ..cfg }), &logits, 20_000);
        assert_eq!(got[3], 0.0, "{got:?}");
        assert!((got[2] - 0.2359).abs() < 0.02, "{got:?}");
        // min_p 1 keeps only the most likely token.
        let got = shares(&mut Sampler::new(SamplerConfig { min_p: 1.0, ..cfg }), &logits, 200);
        assert_eq!(got[0], 1.0);
    }

    fn penalized(cfg: SamplerConfig, seen: &[u32], logits: &[f32]) -> (u32, Vec<f32>) {
        let mut s = Sampler::new(cfg);
        seen.iter().for_each(|&t| s.accept(t));
        let id = s.sample(logits);
        (id, s.penalized.clone())
    }

    #[test]
    fn the_repetition_penalty_divides_positive_logits_and_multiplies_negative_ones() {
        let greedy = SamplerConfig { repeat_penalty: 1.5, ..Default::default() };
        // Positive: id 0's 2.0 becomes 2.0 / 1.5 = 1.333 < 1.5, so greedy now picks id 1.
        let logits = [2.0f32, 1.5, -1.0, -1.2];
        assert_eq!(argmax(&logits), 0);
        let (id, row) = penalized(greedy, &[0, 2, 0], &logits);
        assert_eq!(id, 1);
        // id 0 is penalized once although it came twice; id 2's -1.0 is multiplied: -1.5.
        assert_eq!(row, [2.0 / 1.5, 1.5, -1.5, -1.2]);
        // Negative: -1.0 * 1.5 = -1.5 < -1.2 (dividing would have raised it to -0.667 and kept id 0).
        let (id, row) = penalized(greedy, &[0], &[-1.0, -1.2, -3.0]);
        assert_eq!((id, row), (1, vec![-1.5, -1.2, -3.0]));
        // A zero logit stays zero (multiplied).
        assert_eq!(penalized(greedy, &[0], &[0.0, -0.1]).1, [0.0, -0.1]);
        // Only the last repeat_last_n tokens count: with 2, id 0 has left the window [1, 2].
        let (id, row) = penalized(SamplerConfig { repeat_last_n: 2, ..greedy }, &[0, 1, 2], &logits);
        assert_eq!((id, row), (0, vec![2.0, 1.5 / 1.5, -1.5, -1.2]));
        // Ids outside the row are ignored; penalty 1 or window 0 leave the engine's row alone.
        assert_eq!(penalized(greedy, &[99], &logits).1, logits);
        assert_eq!(penalized(SamplerConfig { repeat_penalty: 1.0, ..greedy }, &[0], &logits), (0, vec![]));
        assert_eq!(penalized(SamplerConfig { repeat_last_n: 0, ..greedy }, &[0], &logits), (0, vec![]));
    }

    #[test]
    fn the_penalty_reshapes_the_sampled_distribution() {
        // p ∝ [2, 1]; id 0 seen, penalty 2: its logit ln 2 becomes ln 2 / 2 = ln √2, so
        // p0 = √2 / (√2 + 1) = 0.5858.
        let cfg = SamplerConfig { temperature: 1.0, repeat_penalty: 2.0, seed: 5, ..Default::default() };
        let mut s = Sampler::new(cfg);
        s.accept(0);
        let got = shares(&mut s, &[2.0f32.ln(), 0.0], 20_000);
        assert!((got[0] - 0.5858).abs() < 0.02, "{got:?}");
    }

    /// A generation loop: each chosen token enters the window, as `thin::generate` does.
    fn generate(cfg: SamplerConfig, prompt: &[u32], steps: usize) -> Vec<u32> {
        let mut s = Sampler::new(cfg);
        prompt.iter().for_each(|&t| s.accept(t));
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37 % 11) as f32) * 0.3).collect();
        (0..steps)
            .map(|_| {
                let id = s.sample(&logits);
                s.accept(id);
                id
            })
            .collect()
    }

    #[test]
    fn the_same_seed_gives_the_same_tokens_with_every_option() {
        let cfg = SamplerConfig { temperature: 0.9, top_k: 20, top_p: 0.95, min_p: 0.05, repeat_penalty: 1.3, repeat_last_n: 8, seed: 11 };
        let a = generate(cfg, &[3, 4, 5], 64);
        assert_eq!(a, generate(cfg, &[3, 4, 5], 64));
        assert_ne!(a, generate(SamplerConfig { seed: 12, ..cfg }, &[3, 4, 5], 64));
        // The penalty moves greedy decoding off its one token: without it every step is the argmax.
        let greedy = SamplerConfig { temperature: 0.0, ..cfg };
        let plain = generate(SamplerConfig { repeat_penalty: 1.0, ..greedy }, &[], 8);
        assert!(plain.iter().all(|&t| t == plain[0]), "{plain:?}");
        let varied = generate(greedy, &[], 8);
        assert_eq!(varied[0], plain[0]);
        assert_ne!(varied[1], plain[0], "{varied:?}");
    }

    #[test]
    fn no_buffer_grows_after_the_first_token() {
        let cfg = SamplerConfig { temperature: 1.0, top_k: 0, top_p: 0.9, min_p: 0.01, repeat_penalty: 1.2, repeat_last_n: 16, seed: 2 };
        let mut s = Sampler::new(cfg);
        let logits: Vec<f32> = (0..1000).map(|i| (i % 17) as f32 * 0.1).collect();
        (0..20).for_each(|t| s.accept(t));
        let id = s.sample(&logits);
        s.accept(id);
        let caps = |s: &Sampler| (s.candidates.capacity(), s.recent.capacity(), s.distinct.capacity(), s.penalized.capacity());
        let before = caps(&s);
        for _ in 0..200 {
            let id = s.sample(&logits);
            s.accept(id);
        }
        assert_eq!(caps(&s), before);
        assert_eq!(s.recent.len(), 16);
    }
}
