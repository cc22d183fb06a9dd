"""Random-weight HF models at the real shapes of the archs the benchmark covers, saved in bf16.

    python3 bench/make_models.py OUT_DIR [names...]
Configs mirror archs/<name>.toml (shapes, RoPE, norms), so `thin convert` gives archives the
generated engines accept and HF runs the same math. Weights: transformers' own init, seed 0.
The tokenizer is a byte-level BPE (tests/fixtures/make_tiny.py); these runs feed token ids.
"""
import json, os, sys

import torch
import transformers
from transformers import Gemma3TextConfig, LlamaConfig, OlmoeConfig, SmolLM3Config

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures"))
from make_tiny import byte_level_tokenizer  # noqa: E402

CONFIGS = {
    "smollm2-135m": lambda: LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
        max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5),
    "llama3.2-1b": lambda: LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
        max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)),
    "gemma3-270m": lambda: Gemma3TextConfig(hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144, tie_word_embeddings=True,
        sliding_window=512, query_pre_attn_scalar=256, max_position_embeddings=32768, rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh"),
    "smollm3-3b": lambda: SmolLM3Config(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=4, vocab_size=128256, tie_word_embeddings=True,
        max_position_embeddings=65536, rope_theta=5000000.0, rms_norm_eps=1e-6, no_rope_layer_interval=4),
    # archs/olmoe-1b-7b.toml: 64 experts, top 8, weights not renormalised, whole-projection QK-norm.
    "olmoe-1b-7b": lambda: OlmoeConfig(hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, vocab_size=50304, tie_word_embeddings=False,
        max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5, num_experts=64,
        num_experts_per_tok=8, norm_topk_prob=False),
}


def main(out, names):
    tok = byte_level_tokenizer()
    for name in names or list(CONFIGS):
        torch.manual_seed(0)
        cfg = CONFIGS[name]()
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        d = os.path.join(out, name)
        os.makedirs(d, exist_ok=True)
        model.save_pretrained(d, safe_serialization=True)
        tok.save(os.path.join(d, "tokenizer.json"))
        with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
            json.dump({"bos_token": None, "eos_token": None}, f)
        print(json.dumps({"made": name, "params": sum(p.numel() for p in model.parameters())}), flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
