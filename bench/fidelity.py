"""Fidelity of thin's CUDA engine against HF transformers in bf16 on the same weights.

    python3 bench/fidelity.py HF_DIR THIN_BIN ARCHIVE NAME [--gguf FILE] [--steps 200]
For prompts of 1 and 128 tokens: HF greedily continues `steps` tokens (bf16, eager, KV cache);
both engines are then teacher-forced over prompt + continuation: HF in one forward, thin through
`thin logits` (prefill, then one decode step per id). Compared on the `steps` decode rows: min
cosine of the logit rows, top-1 agreement, top-5 set overlap, mean KL(HF || thin). One JSON line
per prompt length.
"""
import argparse, json, os, subprocess, tempfile

import numpy as np
import torch
import transformers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("hf_dir"); ap.add_argument("thin"); ap.add_argument("archive"); ap.add_argument("name")
    ap.add_argument("--gguf"); ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt-lens", default="1,128")
    ap.add_argument("--cpu-check", type=int, default=0,
                    help="also run thin's CPU reference engine over prompt + this many ids and compare the GPU to it")
    ap.add_argument("--fp32-ref", action="store_true",
                    help="also score thin and HF bf16 against HF fp32 on the same weights (who is closer to exact?)")
    a = ap.parse_args()
    kw = dict(gguf_file=a.gguf) if a.gguf else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(a.hf_dir, dtype=torch.bfloat16, attn_implementation="eager", **kw).cuda().eval()
    vocab = model.config.vocab_size
    for plen in [int(x) for x in a.prompt_lens.split(",")]:
        g = torch.Generator().manual_seed(plen)
        prompt = torch.randint(3, vocab, (1, plen), generator=g).cuda()
        with torch.no_grad():
            out = model(prompt, use_cache=True)
            past, nxt, ids = out.past_key_values, out.logits[:, -1:].argmax(-1), [prompt]
            for _ in range(a.steps):
                ids.append(nxt)
                out = model(nxt, past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
            full = torch.cat(ids, dim=1)
            ref = model(full).logits[0, plen - 1:].float().cpu().numpy()  # steps + 1 rows
        with tempfile.TemporaryDirectory() as td:
            idf, lf = os.path.join(td, "ids.json"), os.path.join(td, "logits.bin")
            json.dump(full[0].tolist(), open(idf, "w"))
            subprocess.run([a.thin, "logits", a.archive, "--ids", idf, "--prompt-len", str(plen), "-o", lf], check=True)
            ours = np.fromfile(lf, dtype="<f4").reshape(-1, ref.shape[1])[:, :vocab]
            if a.cpu_check:
                n = plen + a.cpu_check
                json.dump(full[0, :n].tolist(), open(idf, "w"))
                cf = os.path.join(td, "cpu.bin")
                subprocess.run([a.thin, "logits", a.archive, "--cpu", "--ids", idf, "--prompt-len", str(plen), "-o", cf], check=True)
                cpu = np.fromfile(cf, dtype="<f4").reshape(-1, ref.shape[1]).astype(np.float64)
                gpu = ours[: cpu.shape[0]].astype(np.float64)
                cc = (cpu * gpu).sum(1) / (np.linalg.norm(cpu, axis=1) * np.linalg.norm(gpu, axis=1))
                print(json.dumps(dict(model=a.name, check="gpu_vs_cpu_reference", prompt_len=plen, rows=int(cpu.shape[0]),
                                      max_abs_diff=float(np.abs(cpu - gpu).max()), logit_absmax=float(np.abs(cpu).max()),
                                      min_cosine=round(float(cc.min()), 7), top1_match=float((cpu.argmax(1) == gpu.argmax(1)).mean()),
                                      # rows counted from the prefill row (0); where the GPU first drifts from the oracle
                                      first_row_below_0_9999=next((int(i) for i in np.nonzero(cc < 0.9999)[0]), None),
                                      worst_rows={int(i): round(float(cc[i]), 6) for i in np.argsort(cc)[:5]})), flush=True)
        assert ours.shape == ref.shape, (ours.shape, ref.shape)
        m = scores(ref, ours)
        print(json.dumps(dict(model=a.name, prompt_len=plen, steps=a.steps, **m, hf_logit_std=round(float(ref[1:].std()), 4))), flush=True)
        if a.fp32_ref:
            with torch.no_grad():
                exact = model.float()(full).logits[0, plen - 1:].float().cpu().numpy()
            model.to(torch.bfloat16)
            print(json.dumps(dict(model=a.name, prompt_len=plen, reference="hf-fp32", thin=scores(exact, ours),
                                  hf_bf16=scores(exact, ref))), flush=True)


def scores(ref, ours):
    """min/mean cosine, top-1, top-5 set overlap and mean KL(ref || ours) over the decode rows."""
    r, o = ref[1:].astype(np.float64), ours[1:].astype(np.float64)
    cos = (r * o).sum(1) / (np.linalg.norm(r, axis=1) * np.linalg.norm(o, axis=1))
    t5r, t5o = np.argsort(-r, 1)[:, :5], np.argsort(-o, 1)[:, :5]
    lp = lambda z: z - z.max(1, keepdims=True) - np.log(np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True))
    pr, po = lp(r), lp(o)
    c0 = float((ref[0] * ours[0]).sum() / (np.linalg.norm(ref[0]) * np.linalg.norm(ours[0])))
    worst = np.argsort(cos)[:5]  # decode rows (0 = the first after the prompt) with the lowest cosine
    return dict(min_cosine=round(float(cos.min()), 6), mean_cosine=round(float(cos.mean()), 6),
                worst_rows={int(i): round(float(cos[i]), 6) for i in worst},
                top1_match=round(float((r.argmax(1) == o.argmax(1)).mean()), 4),
                top5_set=round(float(np.mean([len(set(x) & set(y)) / 5 for x, y in zip(t5r, t5o)])), 4),
                mean_kl=float((np.exp(pr) * (pr - po)).sum(1).mean()), prefill_row_cosine=round(c0, 6))


if __name__ == "__main__":
    main()
