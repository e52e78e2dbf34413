"""Serving under a memory budget: how many long requests the engine's pool holds at once, and what
the storage format costs in decode speed, for fp32 blocks and blocks of K/V codes, same run.

1. Admission: a pool of `--budget-mb` (staging slots of the quantized pools included) and requests
   of `--prompt-tokens` + `--new-tokens`, greedy, EOS ignored. The requests the pool can carry to
   completion together are computed from its blocks; that many plus one are submitted at once and
   `admitted` is the most that ran at the same time, with no preemption.
2. Decode throughput at `--concurrency` requests (a pool large enough for all of them, the same for
   every format): generated tokens / wall time of the decode steps, the median of `--repeats`
   rounds, the formats taking turns within each round (every sample in the JSON).
3. Agreement: the engine's greedy tokens against the single-sequence QuantizedCache of the same
   format (no residual window, the same block size), one request at a time.

    python benchmarks/serving_memory.py --model smollm2 --budget-mb 64 --prompt-tokens 1024
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_class, print_table, write_results  # noqa: E402
from serving import distinct_prompts  # noqa: E402

from kvgen import LLM, CacheConfig, SamplingParams  # noqa: E402
from kvgen.engine import EngineConfig, LLMEngine, RequestStatus  # noqa: E402
from kvgen.engine.engine import STAGING_SPARE  # noqa: E402
from kvgen.generate import GenerationStream  # noqa: E402
from kvgen.kv.quantized import QuantizedCache  # noqa: E402
from kvgen.loading.registry import resolve_model_path  # noqa: E402

FORMATS = {"fp32/fp32": CacheConfig(), "int8/int8": CacheConfig("quantized", k_dtype="int8", v_dtype="int8"),
           "int4/int4": CacheConfig("quantized", k_dtype="int4", v_dtype="int4")}  # fmt: skip


def run(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> tuple[list, float]:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    requests = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    decode_started, engine.most_running = None, 0
    while any(r.status is not RequestStatus.FINISHED for r in requests):
        engine.step()
        engine.most_running = max(engine.most_running, len(engine.scheduler.running))
        if decode_started is None and all(r.output_ids for r in requests):
            decode_started = (time.perf_counter(), sum(len(r.output_ids) for r in requests))
    assert decode_started is not None
    seconds = time.perf_counter() - decode_started[0]
    return requests, (sum(len(r.output_ids) for r in requests) - decode_started[1]) / seconds


def admission(llm: LLM, cache: CacheConfig, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    config = EngineConfig(kv_budget_mb=args.budget_mb, max_num_seqs=args.max_num_seqs, prefix_cache=False,
                          max_tokens_per_step=args.max_tokens_per_step)  # fmt: skip
    engine = LLMEngine(llm, config, cache)
    pool = engine.storage.pool
    fits = pool.num_blocks // pool.blocks_for(args.prompt_tokens + args.new_tokens)
    run(engine, prompts[: fits + 1], args.new_tokens)
    return {"blocks": pool.num_blocks, "bytes_per_block": engine.storage.bytes_per_block(), "fit_by_blocks": fits,
            "admitted": engine.most_running, "preemptions": engine.scheduler.num_preemptions}  # fmt: skip


def agreement(llm: LLM, cache: CacheConfig, prompts: list[list[int]], new_tokens: int) -> float:
    """Share of requests whose engine tokens equal the single-sequence quantized cache's."""
    if cache.kind != "quantized":
        return 1.0
    engine = LLMEngine(llm, EngineConfig(num_blocks=256, prefix_cache=False), cache)
    template = llm.generator.caches.quantized(8, cache.k_dtype, cache.v_dtype)
    equal = 0
    for prompt in prompts:
        (request,), _ = run(engine, [prompt], new_tokens)
        single = QuantizedCache(template.spec, 64, 4096, template.key_codec, template.value_codec, residual=0,
                                key_rope=template.key_rope, block_tokens=16)  # fmt: skip
        stream = GenerationStream(llm.generator, single, prompt, 0, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
        for _ in stream:  # drain: the tokens are in stream.result
            pass
        equal += stream.result.token_ids == request.output_ids
    return equal / len(prompts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--budget-mb", type=float, default=64.0)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-tokens-per-step", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--throughput-prompt-tokens", type=int, default=128)
    parser.add_argument("--throughput-new-tokens", type=int, default=64)
    parser.add_argument("--agreement-prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    llm = LLM.load(resolve_model_path(args.model), progress=False, weights=args.weights)
    rows = {name: {"format": name} for name in FORMATS}
    long_prompts = distinct_prompts(llm, 32, args.prompt_tokens)
    for name, cache in FORMATS.items():
        rows[name] |= admission(llm, cache, args, long_prompts)
    short = distinct_prompts(llm, args.concurrency, args.throughput_prompt_tokens)
    big_pool = EngineConfig(num_blocks=args.concurrency * (args.throughput_prompt_tokens + args.throughput_new_tokens) // 16 + 16,
                            max_num_seqs=args.concurrency, prefix_cache=False)  # fmt: skip
    for _ in range(args.repeats):  # formats take turns within each repeat
        for name, cache in FORMATS.items():
            _, speed = run(LLMEngine(llm, big_pool, cache), short, args.throughput_new_tokens)
            rows[name].setdefault("decode_samples", []).append(round(speed, 1))
    for name, cache in FORMATS.items():
        rows[name]["decode_tok_s"] = statistics.median(rows[name]["decode_samples"])
        rows[name]["agreement"] = agreement(llm, cache, short[: args.agreement_prompts], 32)
    base = rows["fp32/fp32"]
    for row in rows.values():
        row["admitted_vs_fp32"] = round(row["admitted"] / base["admitted"], 2)
        row["decode_vs_fp32"] = round(row["decode_tok_s"] / base["decode_tok_s"], 2)
    table = list(rows.values())
    print_table(table, ["format", "blocks", "bytes_per_block", "fit_by_blocks", "admitted", "admitted_vs_fp32", "preemptions",
                        "decode_tok_s", "decode_vs_fp32", "agreement"])  # fmt: skip
    path = write_results(f"serving_memory-{args.model}-{cpu_class()}", {"args": vars(args), "staging_spare": STAGING_SPARE, "rows": table})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
