"""What a quantized KV cache really holds, and what reading it back costs in decode speed.

For each context length: prefill that many tokens into each cache, then decode `--decode` tokens
one at a time (greedy). Reports memory_bytes() per token after the prefill (everything the cache
holds: packed blocks, fp32 sink and recent window, the one-layer scratch), the packed storage alone,
and decode tokens/s, each as a ratio to the fp32 contiguous cache in the same run. Weights are fp32,
so every cache runs the same torch attention path (the C decode path needs quantized weights).

    python benchmarks/kv_memory.py --contexts 512,2048
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "src"))
from common import print_table, prompt_ids, write_results  # noqa: E402

from kvgen import LLM  # noqa: E402
from kvgen.kv.contiguous import ContiguousCache  # noqa: E402
from kvgen.kv.interface import CacheSpec, KVCache  # noqa: E402
from kvgen.kv.kvquant import build_quantized_cache  # noqa: E402

CONFIGS = [("fp32", "fp32"), ("int8", "int8"), ("int4", "int4"), ("kvquant3", "kvquant3")]


def run(llm: LLM, cache: KVCache, ids: list[int], decode: int) -> float:
    """Prefill `ids`, then decode greedily; returns decode tokens/s."""
    with torch.inference_mode():
        logits = llm.model(torch.tensor([ids]), cache)
        started = time.perf_counter()
        for _ in range(decode):
            logits = llm.model(logits[:, -1].argmax(-1, keepdim=True), cache)
        return decode / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--contexts", default="512,2048")
    parser.add_argument("--decode", type=int, default=16)
    args = parser.parse_args()
    llm = LLM.load(args.model, progress=False, weights="fp32")
    spec = CacheSpec.for_model(llm.config)
    rows: list[dict[str, Any]] = []
    for context in (int(c) for c in args.contexts.split(",")):
        ids, size = prompt_ids(llm.tokenizer, context), context + args.decode
        baseline: dict[str, float] = {}
        for k, v in CONFIGS:
            if (k, v) == ("fp32", "fp32"):
                cache: Any = ContiguousCache(spec, size)
            else:
                cache = build_quantized_cache(llm.model, llm.tokenizer, size, size, k, v)
            speed = run(llm, cache, ids, args.decode)
            held = cache.memory_bytes() / cache.seq_len
            packed = (cache.key_store.nbytes() + cache.value_store.nbytes()) / cache.seq_len if k != "fp32" else held
            baseline = baseline or {"held": held, "speed": speed}
            rows.append({"context": context, "k": k, "v": v, "bytes_per_token_held": held,
                         "bytes_per_token_packed": packed, "memory_vs_fp32": held / baseline["held"],
                         "decode_tok_s": speed, "speed_vs_fp32": speed / baseline["speed"]})  # fmt: skip
            print(rows[-1], flush=True)
    print_table(rows, list(rows[0]))
    print(f"\nwrote {write_results('kv_memory', {'config': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
