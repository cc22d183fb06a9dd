#!/usr/bin/env python3
"""Independent numpy reference for `thin eval`'s statistics (src/eval.rs).

Reads pairs of saved-logits files (the THINLOGT format of `thin eval --save-logits`, parsed here
from its documented layout), computes the perplexity and KL-divergence statistics the way
llama.cpp's llama-perplexity defines them, vectorised in float64, and writes them to
tests/fixtures/eval/expected.json, which the unit test `eval::tests::statistics_equal_numpy`
compares with src/eval.rs to 1e-6 relative.

It also writes the synthetic pair (seeded random logits with larger differences, argmax ties and
identical rows) with its own writer, so the Rust reader is checked against a second writer.

The llama-tiny pair was made with (from the repository root, after `cargo build`):

    thin convert tests/fixtures/tiny/llama-tiny -o /tmp/f32.thin --profile f32 --quiet
    thin convert tests/fixtures/tiny/llama-tiny -o /tmp/bf16.thin --profile bf16 --quiet
    thin eval /tmp/f32.thin --text eval/alice-ch1-4.txt --ctx 16 --chunks 16 \
        --save-logits tests/fixtures/eval/llama-tiny-f32.logits
    thin eval /tmp/bf16.thin --text eval/alice-ch1-4.txt --ctx 16 --chunks 16 \
        --save-logits tests/fixtures/eval/llama-tiny-bf16.logits

then (numpy in a venv: python3 -m venv target/venv-ref && target/venv-ref/bin/pip install numpy):

    target/venv-ref/bin/python scripts/eval_reference.py
"""

import json
import pathlib
import struct
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "eval"
HEADER = 128


def read_logits(path):
    """(vocab, ctx, windows, tokens[windows, ctx], rows[windows, scored, vocab]) of a THINLOGT file."""
    b = path.read_bytes()
    assert b[:8] == b"THINLOGT", path
    version, vocab, ctx, windows, scored, reserved = struct.unpack_from("<6I", b, 8)
    assert (version, reserved) == (1, 0), path
    assert scored == ctx - 1 - ctx // 2, path
    tokens = np.frombuffer(b, dtype="<u4", count=windows * ctx, offset=HEADER).reshape(windows, ctx)
    off = HEADER + 4 * windows * ctx
    rows = np.frombuffer(b, dtype="<f4", count=windows * scored * vocab, offset=off).reshape(windows, scored, vocab)
    assert off + rows.nbytes == len(b), path
    return vocab, ctx, windows, tokens, rows


def write_logits(path, tokens, rows, fingerprint):
    windows, ctx = tokens.shape
    _, scored, vocab = rows.shape
    head = b"THINLOGT" + struct.pack("<6I", 1, vocab, ctx, windows, scored, 0)
    head += fingerprint.encode().ljust(64, b"\0") + bytes(32)
    assert len(head) == HEADER
    path.write_bytes(head + tokens.astype("<u4").tobytes() + rows.astype("<f4").tobytes())


def synthetic():
    """A model/reference pair with large differences, some identical rows and argmax ties."""
    rng = np.random.default_rng(20230)
    vocab, ctx, windows = 64, 24, 10
    scored = ctx - 1 - ctx // 2
    tokens = rng.integers(0, vocab, size=(windows, ctx))
    tokens[:, 0] = 1  # a BOS in front of each window, as a tokenizer that adds BOS has it
    ref = (rng.standard_normal((windows, scored, vocab)) * 3.0).astype(np.float32)
    model = (ref + rng.standard_normal(ref.shape) * 0.7).astype(np.float32)
    model[0, :3] = ref[0, :3]  # identical rows: KLD exactly 0
    # Ties for the argmax: the first index counts, as in llama.cpp.
    model[1, 0, 5] = model[1, 0, 9] = model[1, 0].max() + 1.0
    ref[1, 0, 9] = ref[1, 0, 5] = ref[1, 0].max() + 1.0
    model[1, 1, 7] = model[1, 1, 3] = model[1, 1].max() + 1.0
    ref[1, 1, 3] = ref[1, 1].max() + 2.0
    write_logits(FIXTURES / "synthetic-model.logits", tokens, model, "synthetic")
    write_logits(FIXTURES / "synthetic-ref.logits", tokens, ref, "synthetic")


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def mean_sem(x):
    """Mean and its standard error, sqrt(population variance / (n - 1)); llama.cpp reports no
    error (0) for 10 values or fewer."""
    sem = np.std(x) / np.sqrt(len(x) - 1) if len(x) > 10 else 0.0
    return float(np.mean(x)), float(sem)


def est(value, uncertainty):
    return {"value": float(value), "uncertainty": float(uncertainty)}


def spread(x):
    x = np.sort(x)
    mean, sem = mean_sem(x)
    q = lambda f: float(np.percentile(x, 100.0 * f, method="linear"))
    return {
        "mean": mean, "uncertainty": sem, "max": float(x[-1]), "p99_9": q(0.999), "p99": q(0.99),
        "p95": q(0.95), "p90": q(0.90), "p75": q(0.75), "median": float(np.median(x)), "p25": q(0.25),
        "p10": q(0.10), "p5": q(0.05), "p1": q(0.01), "p0_1": q(0.001), "min": float(x[0]),
    }


def stats(model_logits, ref_logits, nxt):
    """llama-perplexity --kl-divergence over flattened positions (all in float64)."""
    n = len(nxt)
    lq, lp = log_softmax(model_logits), log_softmax(ref_logits)
    idx = np.arange(n)
    nll, nll_base = -lq[idx, nxt], -lp[idx, nxt]
    kld = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    same = np.argmax(model_logits, axis=-1) == np.argmax(ref_logits, axis=-1)
    dp = np.exp(-nll) - np.exp(-nll_base)

    m, u = mean_sem(nll)
    mb, ub = mean_sem(nll_base)
    # Covariance of the two means (llama.cpp: 0 under 10 values); a variance that rounding makes
    # negative is taken as 0, as src/eval.rs does (llama.cpp would print nan).
    cov = float(np.mean((nll - nll.mean()) * (nll_base - nll_base.mean())) / (n - 1)) if n >= 10 else 0.0
    ln_ratio = est(m - mb, np.sqrt(max(0.0, u * u + ub * ub - 2 * cov)))
    ppl_q, ppl_b = np.exp(m), np.exp(mb)
    mse, mse_u = mean_sem(dp * dp)
    rms = np.sqrt(mse)
    p = same.mean()
    return {
        "scored": n,
        "ppl": est(ppl_q, ppl_q * u),
        "kld": {
            "ppl_q": est(ppl_q, ppl_q * u),
            "ppl_base": est(ppl_b, ppl_b * ub),
            "cor_ln_ppl": cov / (u * ub) if u * ub > 0 else float("nan"),
            "ln_ppl_ratio": ln_ratio,
            "ppl_ratio": est(np.exp(ln_ratio["value"]), np.exp(ln_ratio["value"]) * ln_ratio["uncertainty"]),
            "ppl_diff": est(ppl_q - ppl_b, np.sqrt(max(0.0, (ppl_q * u) ** 2 + (ppl_b * ub) ** 2 - 2 * ppl_q * ppl_b * cov))),
            "kld": spread(kld),
            "delta_p": spread(dp),
            "rms_delta_p": est(rms, 0.5 / rms * mse_u if rms > 0 else 0.0),
            "same_top_p": est(p, np.sqrt(p * (1 - p) / (n - 1))),
        },
    }


def case(model_file, ref_file):
    vocab, ctx, windows, tokens, model = read_logits(FIXTURES / model_file)
    vocab_r, ctx_r, windows_r, tokens_r, ref = read_logits(FIXTURES / ref_file)
    assert (vocab, ctx, windows) == (vocab_r, ctx_r, windows_r) and (tokens == tokens_r).all()
    first = ctx // 2
    nxt = tokens[:, first + 1:]  # the token after each scored position ctx/2 ..= ctx-2
    out = stats(model.reshape(-1, vocab), ref.reshape(-1, vocab), nxt.reshape(-1))
    out["model"], out["ref"] = model_file, ref_file
    # The running values after each window (llama-perplexity's per-chunk lines).
    chunks = []
    for w in range(1, windows + 1):
        s = stats(model[:w].reshape(-1, vocab), ref[:w].reshape(-1, vocab), nxt[:w].reshape(-1))
        k = s["kld"]
        chunks.append({
            "window": w, "ppl": s["ppl"]["value"], "ppl_uncertainty": s["ppl"]["uncertainty"],
            "ln_ppl_ratio": k["ln_ppl_ratio"], "rms_delta_p": k["rms_delta_p"], "same_top_p": k["same_top_p"],
            "kld": {"value": k["kld"]["mean"], "uncertainty": k["kld"]["uncertainty"]},
        })
    out["chunks"] = chunks
    return out


def main():
    synthetic()
    cases = {
        "llama-tiny bf16 vs f32": case("llama-tiny-bf16.logits", "llama-tiny-f32.logits"),
        "synthetic": case("synthetic-model.logits", "synthetic-ref.logits"),
    }
    text = json.dumps(cases, indent=1, sort_keys=True) + "\n"
    (FIXTURES / "expected.json").write_text(text)
    print(f"wrote {FIXTURES / 'expected.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()
