"""Writes a random-weight Qwen3-MoE GGUF for timing the mixture-of-experts path against llama.cpp:
no mixture-of-experts model installs offline, so transformers builds one (seeded) at a scaled-down
Qwen3-30B-A3B shape, and the file gets llama.cpp's names and metadata with SmolLM2's tokenizer
(tests/support/tiny_gguf.py). Its tokens mean nothing; its step reads what such a model reads.

    python benchmarks/random_moe_gguf.py            # prints the path
    python benchmarks/decode.py --model <that path> --weights q4 --peers llama.cpp --new-tokens 64 --name decode-moe

Shape: 12 layers, hidden 768, 12 query / 4 KV heads of 64, 32 experts of width 384, 4 per token
(normalised), vocabulary 49,152; projections and experts Q4_0 (`--type`), the rest F32.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from peers.paths import peers_root  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--type", default="Q4_0", choices=("Q4_0", "Q4_1", "Q5_0", "Q8_0"), help="the projections' type (gguf-py writes these)")
    args = parser.parse_args()
    import gguf
    import transformers

    from tests.support.models import model_path
    from tests.support.tiny_gguf import write_gguf_from_hf

    config = transformers.Qwen3MoeConfig(
        vocab_size=49152, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
        num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=384,
        norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():  # transformers' init is tiny (std 0.02); wider weights keep the router's choices spread
        for name, parameter in model.named_parameters():
            if not name.endswith("norm.weight"):
                parameter.normal_(0, 0.05)
    out = peers_root() / "random-qwen3-moe" / f"random-qwen3-moe-{args.type.lower()}.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_gguf_from_hf(out, model, model_path("smollm2"), gguf.GGMLQuantizationType[args.type])
    print(out)


if __name__ == "__main__":
    main()
