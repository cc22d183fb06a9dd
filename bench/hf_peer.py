# From the shared benchmark kit (../shared/bench/hf_peer.py); the compiled loop is ours (issue 29):
# the position lives on the device and advances in place, and dynamo's recompiles are counted.
"""HF transformers batch-1 decode baseline on random-weight models at real shapes.

Usage: python3 hf_peer.py MODE [names...]   MODE = eager | compiled
       python3 hf_peer.py offload GPU_MEM MODEL_DIR...
"compiled" is gpt-fast style: one StaticCache of fixed size, forward compiled with
mode="reduce-overhead" (CUDA graphs), the strongest plain-PyTorch peer.
"offload" is what an HF user with a GPU smaller than the model writes: the saved model (e.g.
bench/make_models.py's, the weights thin converts) loaded with device_map="auto" and
max_memory={0: GPU_MEM, "cpu": ...}, so accelerate keeps what does not fit on the host and moves
it in for each forward; the eager loop decodes (issue 28's peer for --residency stream).
Prints one JSON line per model: tok/s over timed decode steps, peak allocated GiB.
"""
import json, os, sys, time
import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, SmolLM3Config, OlmoeConfig, Gemma3TextConfig

CONFIGS = {
    "smollm2-135m": lambda: LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
        max_position_embeddings=8192),
    "gemma3-270m": lambda: Gemma3TextConfig(hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
        sliding_window=512, query_pre_attn_scalar=256, max_position_embeddings=32768),
    "llama3.2-1b": lambda: LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        tie_word_embeddings=True, max_position_embeddings=8192),
    "smollm3-3b": lambda: SmolLM3Config(),
    "olmoe-1b-7b": lambda: OlmoeConfig(intermediate_size=1024),
}

def build(name):
    torch.manual_seed(0)
    cfg = CONFIGS[name]()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval(), cfg

@torch.no_grad()
def eager(model, steps, warm):
    ids = torch.tensor([[1, 9906]], device="cuda")
    out = model(ids, use_cache=True)
    past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
    for _ in range(warm):
        out = model(tok, past_key_values=past, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(steps):
        out = model(tok, past_key_values=past, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    return steps / (time.perf_counter() - t)

def graphs():
    """Graphs dynamo has compiled so far (a recompile adds one)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]

@torch.no_grad()
def compiled(model, steps, warm):
    """The strongest plain-PyTorch decode loop a user could write (gpt-fast style): a StaticCache,
    the whole step (forward + argmax) compiled with mode="reduce-overhead" (CUDA graphs), the
    position a device tensor advanced in place (no host tensor built or copied per step), the next
    token fed back on the device. Reports the graphs dynamo compiled during the timed steps
    (0: no recompiles after warm-up)."""
    from transformers import StaticCache
    cache = StaticCache(config=model.config, max_cache_len=512)
    # Ids inside the vocabulary of every model here, the floor's 256 included (9906 is not).
    ids = torch.tensor([[1, 9906 % model.config.vocab_size]], device="cuda")
    out = model(ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(2, device="cuda"))
    tok = out.logits[:, -1:].argmax(-1)
    pos = torch.tensor([2], device="cuda")

    def one(tok, pos):
        o = model(tok, past_key_values=cache, use_cache=True, cache_position=pos)
        return o.logits[:, -1:].argmax(-1)

    step = torch.compile(one, mode="reduce-overhead", fullgraph=False, dynamic=False)
    t0 = time.perf_counter()
    for _ in range(warm + 3):
        tok = step(tok, pos).clone(); pos.add_(1)
    torch.cuda.synchronize(); compile_s = time.perf_counter() - t0
    g0 = graphs()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(steps):
        tok = step(tok, pos).clone(); pos.add_(1)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    print(json.dumps({"compile_and_warm_s": round(compile_s, 1), "graphs_compiled_while_timed": graphs() - g0}), flush=True)
    return steps / dt

# The per-step cost of the compiled loop itself: the same loop on a model of one tiny layer, whose
# kernels take a few microseconds; reported as "floor_ms_per_step" after the models.
FLOOR = lambda: LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=1, vocab_size=256, max_position_embeddings=1024)

@torch.no_grad()
def offload(gpu_mem, path):
    """Decode tok/s of the model at `path` with what does not fit `gpu_mem` offloaded to the host."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="auto",
                                                 max_memory={0: gpu_mem, "cpu": "100GiB"}).eval()
    on = {}
    for d in model.hf_device_map.values():
        on[str(d)] = on.get(str(d), 0) + 1
    tps = eager(model, 16, 2)
    return {"model": os.path.basename(path.rstrip("/")), "mode": "offload", "gpu_mem_limit": gpu_mem,
            "device_map_modules": on, "tok_s": round(tps, 3),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3)}

def main():
    mode = sys.argv[1]
    if mode == "offload":
        print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                          "gpu": torch.cuda.get_device_name()}), flush=True)
        for path in sys.argv[3:]:
            try:
                rec = offload(sys.argv[2], path)
            except Exception as e:  # report and go on to the next model
                rec = {"model": path, "mode": "offload", "gpu_mem_limit": sys.argv[2], "error": repr(e)[:400]}
            print(json.dumps(rec), flush=True)
            torch.cuda.empty_cache()
        return
    names = sys.argv[2:] or list(CONFIGS)
    print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                      "gpu": torch.cuda.get_device_name()}), flush=True)
    if mode == "compiled":
        torch.manual_seed(0)
        with torch.device("cuda"):
            tiny = AutoModelForCausalLM.from_config(FLOOR(), dtype=torch.bfloat16).eval()
        print(json.dumps({"floor_ms_per_step": round(1000 / compiled(tiny, 200, 10), 3)}), flush=True)
        del tiny
    for name in names:
        try:
            model, cfg = build(name)
            params = sum(p.numel() for p in model.parameters())
            steps = 50 if "olmoe" in name else 200
            tps = (eager if mode == "eager" else compiled)(model, steps, 10)
            rec = {"model": name, "mode": mode, "params": params, "tok_s": round(tps, 2),
                   "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3)}
        except Exception as e:  # report and go on to the next model
            rec = {"model": name, "mode": mode, "error": repr(e)[:400]}
        print(json.dumps(rec), flush=True)
        del model
        torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
