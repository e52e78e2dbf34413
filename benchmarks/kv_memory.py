"""What a quantized KV cache really holds, and what reading it back costs in decode speed.

For each context length: prefill that many tokens into each cache, then decode `--decode` tokens
one at a time (greedy), `--repeats` times taking turns with the other caches (the cache is cut back
to the prompt between runs; the best run counts). Reports memory_bytes() per token after the prefill
(everything the cache holds: packed blocks, fp32 sink and recent window, the one-layer scratch), the
packed storage alone, and decode tokens/s, each as a ratio to the fp32 contiguous cache with the same
weights in the same run.

Weights decide the decode path: with fp32 weights every cache runs the torch attention, which
reads a quantized cache through `update` (its history decoded into the scratch buffer each step);
with q4 weights the C decode step runs, and for the codecs kernels/quantized_attention.c reads
(int8, int4, fp16/bf16/fp8) it attends over the stored codes directly; kvquant3 keeps `update`.

`--caches` picks the caches; `fp32-apart` is the fp32 cache with separate key and value stores for a
model whose values are its keys (DeepSeek's latent attention, which the fp32 cache otherwise keeps once):

    python benchmarks/kv_memory.py --contexts 512,2048 --weights fp32,q4
    python benchmarks/kv_memory.py --model M.gguf --weights q4 --contexts 1000,2000 --caches fp32,fp32-apart --repeats 9 --name kv_memory-latent
"""

from __future__ import annotations

import argparse
import dataclasses
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
from kvgen.cache_factory import build_quantized_cache  # noqa: E402
from kvgen.kv import quantized_decode_view  # noqa: E402

CONFIGS = {"fp32": ("fp32", "fp32"), "fp32-apart": ("fp32", "fp32"), "int8": ("int8", "int8"), "int4": ("int4", "int4"),
           "kvquant3": ("kvquant3", "kvquant3")}  # fmt: skip


def decode_speed(llm: LLM, cache: KVCache, last_logits: torch.Tensor, prompt_length: int, decode: int) -> float:
    """Decode greedily from the prompt's logits, then cut the cache back to the prompt; tokens/s."""
    with torch.inference_mode():
        logits = last_logits
        started = time.perf_counter()
        for _ in range(decode):
            logits = llm.model(logits[:, -1].argmax(-1, keepdim=True), cache)
        speed = decode / (time.perf_counter() - started)
    cache.truncate(prompt_length)
    return speed


def decode_path(weights: str, k_dtype: str, cache: KVCache) -> str:
    if weights == "fp32":
        return "torch"
    if k_dtype == "fp32":
        return "C, in place"
    return "C over codes" if quantized_decode_view.supports(cache) else "C + update"


def new_cache(llm: LLM, name: str, size: int) -> Any:
    k, v = CONFIGS[name]
    spec = CacheSpec.for_model(llm.config)
    if name == "fp32-apart":
        return ContiguousCache(dataclasses.replace(spec, values_are_keys=False), size)
    return ContiguousCache(spec, size) if k == "fp32" else build_quantized_cache(llm.model, llm.tokenizer, size, size, k, v)


def measure(llm: LLM, weights: str, context: int, decode: int, repeats: int, names: list[str]) -> list[dict[str, Any]]:
    ids, size = prompt_ids(llm.tokenizer, context), context + decode
    caches: list[tuple[str, Any, torch.Tensor]] = []
    for name in names:
        cache = new_cache(llm, name, size)
        with torch.inference_mode():
            caches.append((name, cache, llm.model(torch.tensor([ids]), cache)))
    samples: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(repeats):  # taking turns, so a busy minute on the machine hits every cache alike
        for name, cache, logits in caches:
            samples[name].append(decode_speed(llm, cache, logits, context, decode))
    rows: list[dict[str, Any]] = []
    fp32_held, baseline = caches[0][1].memory_bytes() / context, max(samples[names[0]])
    for name, cache, _ in caches:
        k, v = CONFIGS[name]
        held = cache.memory_bytes() / context
        packed = (cache.key_store.nbytes() + cache.value_store.nbytes()) / context if k != "fp32" else held
        speed = max(samples[name])
        rows.append({"weights": weights, "context": context, "cache": name, "k": k, "v": v, "bytes_per_token_held": held,
                     "bytes_per_token_packed": packed, "memory_vs_fp32": held / fp32_held,
                     "decode_path": decode_path(weights, k, cache),
                     "decode_tok_s": speed, "speed_vs_fp32": speed / baseline,
                     "samples_tok_s": [round(x, 1) for x in samples[name]]})  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--contexts", default="512,2048")
    parser.add_argument("--weights", default="fp32,q4", help="comma-separated: fp32 (torch path), q4, int8 (C path)")
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--caches", default="fp32,int8,int4,kvquant3", help=f"comma-separated, the first the baseline: {', '.join(CONFIGS)}")
    parser.add_argument("--name", default="kv_memory", help="results file: results/<name>.json")
    args = parser.parse_args()
    names = args.caches.split(",")
    unknown = [name for name in names if name not in CONFIGS]
    if unknown:
        parser.error(f"--caches: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    rows: list[dict[str, Any]] = []
    for weights in args.weights.split(","):
        llm = LLM.load(args.model, progress=False, weights=weights)
        for context in (int(c) for c in args.contexts.split(",")):
            rows += measure(llm, weights, context, args.decode, args.repeats, names)
    columns = [c for c in rows[0] if c != "samples_tok_s"]
    print_table(rows, columns)
    print(f"\nwrote {write_results(args.name, {'config': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
