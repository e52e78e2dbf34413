"""DeepSeek-V3's expert routing in kvgen, transformers and llama.cpp on one all-F32 file: where no
engine rounds its weights or activations, the three should give the same logits, and any
difference in how they choose experts (the sigmoid scores, the choice bias, the eligible groups)
shows. Random weights at a small V3 shape (27 layers, which llama.cpp needs to read a file without
a query latent as V2-Lite / Moonlight; hidden 256; 16 experts in 4 groups of which 2 are eligible,
4 per token, renormalised x 2.5, a random choice bias), written with llama.cpp's converter's
names (tests/support/tiny_gguf.py); last-position logits of a 32-token prompt. Also kvgen with
its groups switched off, to show the groups matter.

    python benchmarks/routing_check.py      # benchmarks/results/routing-check-deepseek-v3.json
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from common import FILLER, write_results  # noqa: E402


def main() -> None:
    import transformers
    from llama_cpp import Llama

    from kvgen import LLM
    from kvgen.models.moe import SparseMoE
    from tests.support.models import model_path
    from tests.support.tiny_gguf import write_gguf_from_hf

    config = transformers.DeepseekV3Config(
        vocab_size=49152, num_hidden_layers=27, hidden_size=256, intermediate_size=512, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=None, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        first_k_dense_replace=1, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, moe_intermediate_size=128,
        n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, tie_word_embeddings=False,
        max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if not name.endswith("norm.weight"):
                parameter.normal_(0, 0.05)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.05)
    path = write_gguf_from_hf(Path(tempfile.mkdtemp()) / "deepseek-v3-f32.gguf", model, model_path("smollm2"))
    peer = Llama(model_path=str(path), n_ctx=256, n_threads=2, verbose=False, logits_all=True)
    ids = peer.tokenize(FILLER.encode(), add_bos=False)[:32]
    peer.reset()
    peer.eval(ids)
    llama_cpp = np.array(peer.scores[len(ids) - 1])
    llm = LLM.load(path, progress=False, weights="fp32")

    def kvgen_logits() -> np.ndarray:
        with torch.inference_mode():
            return llm.model(torch.tensor([ids]), llm.generator.new_cache(len(ids)))[0, -1].numpy()

    with torch.inference_mode():
        reference = model(torch.tensor([ids])).logits[0, -1].numpy()
    kvgen = kvgen_logits()
    for mixture in (m for m in llm.model.modules() if isinstance(m, SparseMoE)):
        mixture.groups = 1
    ungrouped = kvgen_logits()
    gaps = {
        "kvgen_vs_transformers": float(np.abs(kvgen - reference).max()),
        "llama_cpp_vs_transformers": float(np.abs(llama_cpp - reference).max()),
        "kvgen_vs_llama_cpp": float(np.abs(kvgen - llama_cpp).max()),
        "kvgen_without_groups_vs_llama_cpp": float(np.abs(ungrouped - llama_cpp).max()),
    }
    for name, gap in gaps.items():
        print(f"{name:36s} max |logit difference| {gap:.6f}")
    print(write_results("routing-check-deepseek-v3", {"prompt_tokens": len(ids), "max_abs_logit_difference": gaps}))


if __name__ == "__main__":
    main()
