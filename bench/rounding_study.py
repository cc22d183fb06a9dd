"""Which bf16 rounding points does an f32-activation engine need to agree with HF transformers in bf16?

    python3 bench/rounding_study.py HF_DIR [--gguf FILE] [--steps 200] [--prompt-lens 1,128] [--device cpu]

HF in bf16 rounds every activation to bf16 after each op (each Linear's output, each RMSNorm's
two steps, RoPE's products and sum, QK^T, the softmax probabilities, PV, residual adds, SiLU and
the gate * up product, the logits); thin keeps activations in f32 and rounds only the KV cache.
This script runs a Llama-family forward of its own (Llama, SmolLM3's NoPE layers) in f32 on the
HF model's bf16 weights, with a chosen set of those points rounded to bf16, and scores each set
against HF's own bf16 forward with bench/fidelity.py's `scores` over the same teacher-forced
prompt + greedy continuation as the fidelity bench. It also prints HF bf16's own noise floor
(its KV-cache decode logits vs its full forward) and HF fp32 vs HF bf16. One JSON line per
(prompt length, rounding set).
"""
import argparse, json, math, os, sys

import numpy as np
import torch
import transformers

sys.path.insert(0, os.path.dirname(__file__))
from fidelity import scores  # noqa: E402

POINTS = ["norm", "linear", "rope", "qk", "probs", "pv", "resid", "act", "mul", "logits"]
SETS = {
    "none (thin today: f32, bf16 KV)": [],
    "all": POINTS,
    "all but logits": [p for p in POINTS if p != "logits"],
    "linear+resid+norm": ["linear", "resid", "norm"],
    "linear+resid+norm+act+mul": ["linear", "resid", "norm", "act", "mul"],
    "all but rope": [p for p in POINTS if p != "rope"],
    "all but qk/probs/pv": [p for p in POINTS if p not in ("qk", "probs", "pv")],
    "all but act/mul": [p for p in POINTS if p not in ("act", "mul")],
}


def bf(x):
    return x.to(torch.bfloat16).float()


class Forward:
    """A Llama-family forward in f32 over bf16 weights; `r` is the set of points rounded to bf16."""

    def __init__(self, model):
        self.m, self.c = model, model.config
        c = self.c
        self.hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.nh, self.nkv = c.num_attention_heads, c.num_key_value_heads
        self.use_rope = list(getattr(c, "no_rope_layers", [1] * c.num_hidden_layers))
        self.w = {k: v.float() for k, v in model.state_dict().items()}

    def __call__(self, ids, r):
        rd = lambda x, p: bf(x) if p in r else x
        m, c, w, hd = self.m, self.c, self.w, self.hd
        T = ids.shape[1]
        pos = torch.arange(T, device=ids.device)[None]
        dummy = torch.zeros(1, device=ids.device, dtype=torch.bfloat16 if "rope" in r else torch.float32)
        cos, sin = m.model.rotary_emb(dummy, pos)
        cos, sin = cos.float()[:, None], sin.float()[:, None]  # (1, 1, T, hd)

        def norm(x, g):
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)
            return rd(g * rd(y, "norm"), "norm")

        def lin(x, name):
            return rd(x @ w[name].T, "linear")

        def rot(x):
            x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
            rh = torch.cat((-x2, x1), -1)
            return rd(rd(x * cos, "rope") + rd(rh * sin, "rope"), "rope")

        h = w["model.embed_tokens.weight"][ids[0]][None]
        mask = torch.full((T, T), float("-inf"), device=ids.device).triu(1)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            x = norm(h, w[p + "input_layernorm.weight"])
            q = lin(x, p + "self_attn.q_proj.weight").view(1, T, self.nh, hd).transpose(1, 2)
            k = lin(x, p + "self_attn.k_proj.weight").view(1, T, self.nkv, hd).transpose(1, 2)
            v = lin(x, p + "self_attn.v_proj.weight").view(1, T, self.nkv, hd).transpose(1, 2)
            if self.use_rope[i]:
                q, k = rot(q), rot(k)
            k, v = bf(k), bf(v)  # the KV cache is bf16 in every set (thin's cache is bf16 too)
            g = self.nh // self.nkv
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            s = rd(rd(q @ k.transpose(-1, -2), "qk") * hd ** -0.5, "qk") + mask
            pr = rd(torch.softmax(s, -1), "probs")
            a = rd(pr @ v, "pv").transpose(1, 2).reshape(1, T, self.nh * hd)
            h = rd(h + lin(a, p + "self_attn.o_proj.weight"), "resid")
            x = norm(h, w[p + "post_attention_layernorm.weight"])
            gt = rd(torch.nn.functional.silu(lin(x, p + "mlp.gate_proj.weight")), "act")
            u = rd(gt * lin(x, p + "mlp.up_proj.weight"), "mul")
            h = rd(h + lin(u, p + "mlp.down_proj.weight"), "resid")
        x = norm(h, w["model.norm.weight"])
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        return rd(x @ head.T, "logits")[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("hf_dir"); ap.add_argument("--gguf"); ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt-lens", default="1,128"); ap.add_argument("--device", default="cpu")
    ap.add_argument("--sets", help='names of SETS to run, separated by ";" (default: all)')
    ap.add_argument("--name", default="")
    a = ap.parse_args()
    torch.manual_seed(0)
    kw = dict(gguf_file=a.gguf) if a.gguf else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(a.hf_dir, dtype=torch.bfloat16, attn_implementation="eager", **kw).to(a.device).eval()
    fwd = Forward(model)
    fp32 = transformers.AutoModelForCausalLM.from_pretrained(a.hf_dir, dtype=torch.float32, attn_implementation="eager", **kw).to(a.device).eval()
    vocab = model.config.vocab_size
    sets = {k: v for k, v in SETS.items() if not a.sets or k in a.sets.split(";")}
    for plen in [int(x) for x in a.prompt_lens.split(",")]:
        g = torch.Generator().manual_seed(plen)
        prompt = torch.randint(3, vocab, (1, plen), generator=g).to(a.device)
        with torch.no_grad():
            out = model(prompt, use_cache=True)
            past, nxt, ids, dec = out.past_key_values, out.logits[:, -1:].argmax(-1), [prompt], [out.logits[0, -1:]]
            for _ in range(a.steps):
                ids.append(nxt)
                out = model(nxt, past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
                dec.append(out.logits[0, -1:])
            full = torch.cat(ids, dim=1)
            ref = model(full).logits[0, plen - 1:].float().cpu().numpy()
            dec = torch.cat(dec).float().cpu().numpy()
            emit(a, plen, "hf-bf16 kv-cache decode (noise floor)", scores(ref, dec))
            for name, r in sets.items():
                ours = fwd(full, set(r))[plen - 1:].float().cpu().numpy()
                emit(a, plen, name, scores(ref, ours))
            exact = fp32(full).logits[0, plen - 1:].cpu().numpy()
            emit(a, plen, "hf-fp32", scores(ref, exact))


def emit(a, plen, name, s):
    s.pop("worst_rows", None)
    print(json.dumps(dict(model=a.name, prompt_len=plen, set=name, **s)), flush=True)


if __name__ == "__main__":
    main()
