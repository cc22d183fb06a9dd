//! The generated tiny engines run on deterministic pseudo-random weights: finite logits, and
//! prefill equals token-by-token decode.

use thin_core::engine::{Engine, MemWeights};
use thin_core::role::Role;

fn weights(sizes: &[(Role, Option<u32>, usize)]) -> MemWeights {
    let mut w = MemWeights::default();
    let mut seed = 0x9e37_79b9_u32;
    for &(r, l, n) in sizes {
        let v = (0..n)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 17;
                seed ^= seed << 5;
                if r.is_norm() { 1.0 } else { (seed as f32 / u32::MAX as f32 - 0.5) * 0.2 }
            })
            .collect();
        w.tensors.insert((r, l), v);
    }
    w
}

fn sizes(layers: u32, h: usize, q: usize, kv: usize, hd: usize, ffn: usize, vocab: usize, extra: &[(Role, usize)]) -> Vec<(Role, Option<u32>, usize)> {
    let mut s = vec![(Role::TokenEmbd, None, vocab * h), (Role::OutputNorm, None, h)];
    for l in 0..layers {
        let l = Some(l);
        s.extend([
            (Role::AttnNorm, l, h), (Role::AttnQ, l, q * h), (Role::AttnK, l, kv * h), (Role::AttnV, l, kv * h),
            (Role::AttnO, l, h * q), (Role::FfnNorm, l, h), (Role::FfnGate, l, ffn * h), (Role::FfnUp, l, ffn * h),
            (Role::FfnDown, l, h * ffn),
        ]);
        let _ = hd;
        s.extend(extra.iter().map(|&(r, n)| (r, l, n)));
    }
    s
}

fn check<E: Engine>(mut e: E) {
    let prompt = [1u32, 7, 42, 255, 3];
    let a = e.prefill(&prompt).unwrap().to_vec();
    assert!(a.iter().all(|v| v.is_finite()));
    e.reset();
    let mut b = Vec::new();
    for &t in &prompt {
        b = e.decode_step(t).unwrap().to_vec();
    }
    assert_eq!(a, b);
    assert!(e.decode_step(256).is_err(), "token out of range is an error");
}

#[test]
fn llama_tiny_runs() {
    use thin_generated::llama_tiny as m;
    check(m::Engine::new(weights(&sizes(2, 64, 64, 32, 16, 128, 256, &[]))).expect("bind the weights"));
}

#[test]
fn smollm3_tiny_runs() {
    use thin_generated::smollm3_tiny as m;
    check(m::Engine::new(weights(&sizes(4, 64, 64, 32, 16, 128, 256, &[]))).expect("bind the weights"));
}

#[test]
fn gemma3_tiny_runs() {
    use thin_generated::gemma3_tiny as m;
    let extra = [(Role::AttnQNorm, 32), (Role::AttnKNorm, 32), (Role::AttnPostNorm, 64), (Role::FfnPostNorm, 64)];
    check(m::Engine::new(weights(&sizes(6, 64, 128, 32, 32, 128, 256, &extra))).expect("bind the weights"));
}

#[test]
fn olmoe_tiny_runs() {
    use thin_generated::olmoe_tiny as m;
    let extra = [(Role::AttnQNorm, 64), (Role::AttnKNorm, 64), (Role::MoeRouter, 8 * 64), (Role::MoeGate, 8 * 32 * 64), (Role::MoeUp, 8 * 32 * 64), (Role::MoeDown, 8 * 64 * 32)];
    let mut s = sizes(2, 64, 64, 64, 16, 32, 256, &extra);
    s.push((Role::LmHead, None, 256 * 64));
    check(m::Engine::new(weights(&s)).expect("bind the weights"));
}

/// The engine binds every tensor it reads when it is built: a missing or misshapen one is an
/// error naming it then, never a failure in the middle of a token.
#[test]
fn weights_are_bound_and_checked_at_load() {
    use thin_core::engine::EngineError;
    use thin_generated::llama_tiny as m;
    let mut w = weights(&sizes(2, 64, 64, 32, 16, 128, 256, &[]));
    w.tensors.remove(&(Role::FfnDown, Some(1)));
    match m::Engine::new(w) {
        Err(EngineError::MissingWeight { role: Role::FfnDown, layer: Some(1) }) => {}
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("an engine without ffn_down of layer 1"),
    }
    let mut w = weights(&sizes(2, 64, 64, 32, 16, 128, 256, &[]));
    w.tensors.insert((Role::AttnQ, Some(0)), vec![0.0; 10]);
    match m::Engine::new(w) {
        Err(EngineError::WeightSize { role: Role::AttnQ, layer: Some(0), expected: 4096, got: 10 }) => {}
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("an engine with a 10-element attn_q"),
    }
}
