"""Sliding-window layers in the engine's pool: KV bytes one long Gemma 3 sequence holds, with the
pool split into layer groups (kv/layer_groups.py) against one block for every layer, same run.

1. Memory: one request of `--tokens` prompt tokens + `--new-tokens` greedy tokens; the pages its
   cache holds at the end, times the bytes of a page, for each pool. `ratio` = grouped / full.
2. Exactness: the engine's tokens on both pools against the single-sequence window cache
   (kv/window.py); then a follow-up request (prompt + answer + a question) that resumes from the
   prefix cache past the window, against the window cache on the whole follow-up prompt.
3. Speed: decode tok/s of that one request on each pool (both run the C step over every layer; the
   grouped pool's reads each layer through its group's table), best of `--repeats`, the pools taking
   turns within each repeat.

    python benchmarks/window_pool.py --model gemma3-270m --tokens 4096
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_class, print_table, prompt_ids, write_results  # noqa: E402

from kvgen import LLM, CacheConfig, SamplingParams  # noqa: E402
from kvgen.engine import EngineConfig, LLMEngine, RequestStatus  # noqa: E402
from kvgen.loading.registry import resolve_model_path  # noqa: E402


def run_engine(llm: LLM, ids: list[int], params: SamplingParams, grouped: bool, block_size: int,
               follow_up: list[int] | None = None) -> dict:  # fmt: skip
    """One request on a fresh engine: its tokens, held pages and decode speed; then, if given,
    `follow_up` ids + the first answer, resumed from the prefix cache."""
    engine = LLMEngine(llm, EngineConfig(kv_budget_mb=4096, block_size=block_size, max_tokens_per_step=512,
                                         layer_groups=grouped))  # fmt: skip
    request = engine.add_request("long", ids, params)
    decode_started = held = None
    while request.status is not RequestStatus.FINISHED:
        engine.step()
        if request.cache is not None:
            held = len(request.cache.held_blocks())
        if decode_started is None and request.output_ids:
            decode_started = time.perf_counter()
    assert decode_started is not None and held is not None
    decode_seconds = time.perf_counter() - decode_started
    row = {
        "pool": f"grouped {engine.storage.groups.describe()}" if grouped else "one block, every layer",
        "pages_held": held, "bytes_per_page": engine.storage.bytes_per_block(),
        "kv_mb": held * engine.storage.bytes_per_block() / 2**20,
        "decode_tok_s": (len(request.output_ids) - 1) / decode_seconds, "tokens": request.output_ids,
    }  # fmt: skip
    if follow_up is not None:
        second = engine.add_request("follow-up", ids + request.output_ids + follow_up, params)
        while second.status is not RequestStatus.FINISHED:
            engine.step()
        row["follow_up_cached_tokens"], row["follow_up_tokens"] = second.cached_tokens, second.output_ids
    engine.check_invariants()
    return row


def window_cache_tokens(llm: LLM, ids: list[int], params: SamplingParams) -> list[int]:
    llm.generator.cache_config = CacheConfig("window")
    return llm.generate(ids, params).token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    llm = LLM.load(resolve_model_path(args.model), progress=False, weights=args.weights)
    windows = {llm.model.config.window_for(i) for i in range(llm.model.config.num_layers)} - {None}
    if not windows:
        raise SystemExit(f"{args.model} has no sliding-window layers: nothing to measure")
    ids = prompt_ids(llm.tokenizer, args.tokens)
    question = llm.tokenizer.encode(" What happened next?", add_special_tokens=False)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    with torch.inference_mode():
        grouped = run_engine(llm, ids, params, True, args.block_size, follow_up=question)
        full = run_engine(llm, ids, params, False, args.block_size)
        for _ in range(args.repeats - 1):  # more decode samples, the pools taking turns
            for row, grouping in ((grouped, True), (full, False)):
                again = run_engine(llm, ids, params, grouping, args.block_size)
                row["decode_tok_s"] = max(row["decode_tok_s"], again["decode_tok_s"])
        reference = window_cache_tokens(llm, ids, params)
        follow_up_reference = window_cache_tokens(llm, ids + grouped["tokens"] + question, params)
    rows = [grouped, full]
    for row in rows:
        row["equals_window_cache"] = row["tokens"] == reference
    grouped["follow_up_equals_window_cache"] = grouped.pop("follow_up_tokens") == follow_up_reference
    ratio = grouped["kv_mb"] / full["kv_mb"]
    print_table(rows, ["pool", "pages_held", "bytes_per_page", "kv_mb", "decode_tok_s", "equals_window_cache"])
    print(f"KV bytes per sequence, grouped / full: {ratio:.3f}; follow-up resumed {grouped['follow_up_cached_tokens']} "
          f"cached tokens, equals the window cache: {grouped['follow_up_equals_window_cache']}")  # fmt: skip
    payload = {"args": vars(args), "window": sorted(windows), "kv_ratio": ratio,
               "decode_ratio": grouped["decode_tok_s"] / full["decode_tok_s"], "rows": rows}  # fmt: skip
    path = write_results(f"window_pool-{args.model}-{args.tokens}-{cpu_class()}", payload)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
