"""Serving: kvgen's continuous-batching engine at concurrency 1, 4, 16, 64 per weight format, against
transformers (one request at a time, and its own batched `generate()`) and llama.cpp
(llama-cpp-python, one at a time) on the same GGUF, same run; and time to first token behind a
1,000-token shared system prompt, cold vs warm prefix cache.

Throughput = generated tokens / wall time for C requests submitted together (distinct prompts of
`--prompt-tokens`, `--new-tokens` each, greedy, EOS ignored, prefix cache off so nothing is shared).
Two gains are reported apart:
- the batching gain, at equal weights: kvgen at concurrency C against kvgen at concurrency 1 (one
  request at a time) with the same weight format (`vs_same_weights_c1`);
- the weight-format gain: each format against fp32 at the same concurrency (`vs_fp32_same_c`).
transformers gets a batch of its own (`generate()` over the C prompts together; the prompts have
equal lengths, so its batch carries no padding: its best case) beside its one-at-a-time row.
Every measurement is repeated `--repeats` times, all engines taking turns within each round; the
table shows medians and the JSON keeps every sample.

    python benchmarks/serving.py --model smollm2 --weights q4,fp32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import FILLER, cpu_class, model_label, print_table, timed, write_results  # noqa: E402
from decode import llama_cpp_runner, transformers_runner  # noqa: E402

from kvgen import LLM, SamplingParams  # noqa: E402
from kvgen.engine import EngineConfig, LLMEngine, RequestStatus  # noqa: E402
from kvgen.loading.registry import resolve_model_path  # noqa: E402


def distinct_prompts(llm: LLM, count: int, num_tokens: int) -> list[list[int]]:
    """`count` prompts of exactly `num_tokens`, each starting with its own number (no shared prefix)."""
    body = llm.tokenizer.encode(FILLER * (num_tokens // 20 + 2), add_special_tokens=False)
    return [(llm.tokenizer.encode(f"Request {i}:", add_special_tokens=False) + body)[:num_tokens] for i in range(count)]


def engine_throughput(llm: LLM, concurrency: int, prompt_tokens: int, new_tokens: int) -> dict:
    engine = LLMEngine(llm, EngineConfig(max_num_seqs=64, max_tokens_per_step=512, prefix_cache=False))
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    prompts = distinct_prompts(llm, concurrency, prompt_tokens)
    started = time.perf_counter()
    requests = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    while any(r.status is not RequestStatus.FINISHED for r in requests):
        engine.step()
    seconds = time.perf_counter() - started
    generated = sum(len(r.output_ids) for r in requests)
    assert generated == concurrency * new_tokens
    ttfts = sorted(r.first_token_time - r.arrival_time for r in requests)
    return {"engine": f"kvgen ({llm.weights})", "weights": llm.weights, "concurrency": concurrency, "seconds": seconds,
            "tokens_per_s": generated / seconds, "median_ttft_s": ttfts[len(ttfts) // 2]}  # fmt: skip


def transformers_batch_runner(path: Path, prompts: list[list[int]], pad_id: int = 0) -> Callable[[int], Any]:
    """transformers `generate()` over every prompt at once (fp32, the GGUF dequantized), shorter
    prompts left-padded to the longest with an attention mask (equal lengths: no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    longest = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])

    def generate(n: int) -> Any:
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=pad_id)  # fmt: skip
        assert out.shape == (len(prompts), longest + n)
        return out

    return generate


def first_token_seconds(engine: LLMEngine, request_id: str, prompt: list[int]) -> float:
    request = engine.add_request(request_id, prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))
    started = time.perf_counter()
    while request.status is not RequestStatus.FINISHED:
        engine.step()
    return time.perf_counter() - started


def prefix_ttft(llm: LLM, system_tokens: int, repeats: int) -> dict:
    """TTFT of a question behind a shared system prompt: cold (index cleared) vs warm (a previous
    request with the same system prompt and another question left it in the prefix cache)."""
    system = llm.tokenizer.encode(FILLER * (system_tokens // 20 + 2), add_special_tokens=False)[:system_tokens]
    questions = [llm.tokenizer.encode(f" Question {i}: what happened next in the town?", add_special_tokens=False) for i in range(2 * repeats + 1)]
    engine = LLMEngine(llm, EngineConfig(max_tokens_per_step=2048))
    cold, warm = [], []
    for i in range(repeats):
        engine.scheduler.prefix.clear()
        cold.append(first_token_seconds(engine, f"cold{i}", system + questions[2 * i]))
        warm.append(first_token_seconds(engine, f"warm{i}", system + questions[2 * i + 1]))
    hit = engine.scheduler.prefix.stats
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)
    return {"weights": llm.weights, "system_prompt_tokens": system_tokens, "cold_ttft_s": cold_s, "warm_ttft_s": warm_s,
            "cold_samples_s": cold, "warm_samples_s": warm, "speedup": cold_s / warm_s,
            "prefix_hits": hit.hits, "tokens_reused": hit.tokens_reused}  # fmt: skip


def summarise(samples: dict[tuple[str, int], list[dict]]) -> list[dict]:
    """Median row per (engine, concurrency), every sample kept, and the two gains apart."""
    rows = []
    for runs in samples.values():
        median = statistics.median(r["tokens_per_s"] for r in runs)
        rows.append({**runs[0], "tokens_per_s": median, "seconds": statistics.median(r["seconds"] for r in runs),
                     "samples_tokens_per_s": [round(r["tokens_per_s"], 2) for r in runs]})  # fmt: skip
    by_key = {(r["engine"], r["concurrency"]): r for r in rows}
    for row in rows:
        alone = by_key.get((row["engine"], 1))
        if row["engine"].startswith("kvgen") and alone is not None:
            row["vs_same_weights_c1"] = row["tokens_per_s"] / alone["tokens_per_s"]
        fp32 = by_key.get(("kvgen (fp32)", row["concurrency"]))
        if row["engine"].startswith("kvgen") and fp32 is not None:
            row["vs_fp32_same_c"] = row["tokens_per_s"] / fp32["tokens_per_s"]
        for peer in ("transformers (one at a time)", "llama.cpp (one at a time)"):
            if (peer, 1) in by_key:
                row[f"vs_{peer.split(' ')[0]}"] = row["tokens_per_s"] / by_key[(peer, 1)]["tokens_per_s"]
    return rows


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--weights", default="q4,fp32", help="kvgen weight formats, comma-separated")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--peers", default="transformers,llama.cpp", help="comma-separated; empty for none")
    parser.add_argument("--transformers-batch", default="16", help="batch sizes for transformers' own batch; empty for none")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    peers = [p for p in args.peers.split(",") if p]
    unknown = set(peers) - {"transformers", "llama.cpp"}
    if unknown:
        parser.error(f"--peers: unknown {sorted(unknown)}; choose from transformers, llama.cpp")
    concurrencies = [int(c) for c in args.concurrency.split(",") if c]
    batch_sizes = [int(b) for b in args.transformers_batch.split(",") if b] if "transformers" in peers else []

    llms = [LLM.load(args.model, progress=False, weights=w) for w in args.weights.split(",") if w]
    path = resolve_model_path(args.model)
    ids = distinct_prompts(llms[0], max([1, *batch_sizes]), args.prompt_tokens)
    runners: dict[tuple[str, int], Callable[[int], Any]] = {}
    for peer in peers:
        one = transformers_runner(path, ids[0], torch.float32) if peer == "transformers" else llama_cpp_runner(path, ids[0], torch.get_num_threads())
        runners[(f"{peer} (one at a time)", 1)] = one
    for b in batch_sizes:
        runners[("transformers (batched generate)", b)] = transformers_batch_runner(path, ids[:b])
    for runner in runners.values():
        runner(2)  # warm up
    samples: dict[tuple[str, int], list[dict]] = {}
    for _ in range(args.repeats):  # every engine runs once per round, so drift reaches all of them
        for llm in llms:
            for c in concurrencies:
                row = engine_throughput(llm, c, args.prompt_tokens, args.new_tokens)
                samples.setdefault((row["engine"], c), []).append(row)
        for (name, c), runner in runners.items():
            seconds = timed(lambda: runner(args.new_tokens))
            row = {"engine": name, "concurrency": c, "seconds": seconds, "tokens_per_s": c * args.new_tokens / seconds}
            samples.setdefault((name, c), []).append(row)
    rows = summarise(samples)
    ttft = [prefix_ttft(llm, args.system_tokens, repeats=args.repeats) for llm in llms]

    print(f"\n{args.model}, {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens each, greedy, "
          f"{torch.get_num_threads()} threads, medians of {args.repeats} rounds")  # fmt: skip
    columns = ["engine", "concurrency", "tokens_per_s", "vs_same_weights_c1", "vs_fp32_same_c", *[f"vs_{p}" for p in peers]]
    print_table(rows, columns)
    for t in ttft:
        print(f"TTFT ({t['weights']}) behind a {t['system_prompt_tokens']}-token system prompt: cold {t['cold_ttft_s']:.3f} s, "
              f"warm {t['warm_ttft_s']:.3f} s ({t['speedup']:.1f}x)")  # fmt: skip
    out = write_results(f"serving-{model_label(args.model)}-{cpu_class()}", {"config": vars(args), "rows": rows, "prefix_ttft": ttft})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
