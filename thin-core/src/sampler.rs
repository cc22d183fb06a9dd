//! Token sampling: greedy, temperature, top-k, top-p (nucleus) with a seeded, reproducible RNG.

/// How the next token is chosen from a logits row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplerConfig {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    /// 1.0 means no nucleus cut.
    pub top_p: f32,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0 }
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

pub struct Sampler {
    config: SamplerConfig,
    rng: Rng,
    /// Reused candidate buffer: no allocation per token after the first.
    candidates: Vec<(u32, f32)>,
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

impl Sampler {
    pub fn new(config: SamplerConfig) -> Self {
        Sampler { config, rng: Rng::new(config.seed), candidates: Vec::new() }
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.config
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let c = self.config;
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
        let mut s = Sampler::new(SamplerConfig { temperature: 1.5, top_k: 1, top_p: 1.0, seed: 9 });
        for _ in 0..50 {
            assert_eq!(s.sample(&[0.0, 3.0, 2.9, -1.0]), 1);
        }
    }

    #[test]
    fn top_p_cuts_the_tail() {
        // probabilities ~ [0.665, 0.245, 0.09]: top_p 0.6 keeps only the first.
        let mut s = Sampler::new(SamplerConfig { temperature: 1.0, top_k: 0, top_p: 0.6, seed: 3 });
        for _ in 0..50 {
            assert_eq!(s.sample(&[2.0, 1.0, 0.0]), 0);
        }
    }

    #[test]
    fn sampling_follows_the_distribution_and_is_seeded() {
        let logits = [0.0f32, (3.0f32).ln()]; // p = [0.25, 0.75]
        let cfg = SamplerConfig { temperature: 1.0, top_k: 0, top_p: 1.0, seed: 42 };
        let mut s = Sampler::new(cfg);
        let n = 20_000;
        let ones = (0..n).filter(|_| s.sample(&logits) == 1).count() as f32 / n as f32;
        assert!((ones - 0.75).abs() < 0.02, "{ones}");
        let a: Vec<u32> = { let mut s = Sampler::new(cfg); (0..100).map(|_| s.sample(&logits)).collect() };
        let b: Vec<u32> = { let mut s = Sampler::new(cfg); (0..100).map(|_| s.sample(&logits)).collect() };
        assert_eq!(a, b);
    }
}
