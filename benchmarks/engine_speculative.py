"""Speculative decoding inside the continuous-batching engine: decode tokens/s with each method against
the same requests decoded plainly, one request at a time and several at once (same run).

Each request is a chat request through the model's chat template (the speculative benchmark's chat
task and other questions); all start together and decode `--new-tokens` tokens greedily (EOS
ignored). A run's time counts from the step after the prompts were computed to the last token, so
the ratio is decoding's. Within each round every method runs between two plain runs (their order
rotating from round to round) and its ratio is against the mean of those two. Every sample goes to
benchmarks/results/engine_speculative-<model>-<cpu class>.json; each method's tokens must equal
plain decoding's.

    python benchmarks/engine_speculative.py --concurrency 1,4 --repeats 9
    python benchmarks/engine_speculative.py --concurrency 2,4 --repeats 5 --methods eagle --speculative-max-batch 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cpu_class, print_table, write_results  # noqa: E402
from speculative import CHAT_REQUEST  # noqa: E402

from kvgen import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from kvgen.engine import EngineConfig, LLMEngine  # noqa: E402

QUESTIONS = [
    CHAT_REQUEST,
    "Explain how a bicycle stays upright when it moves.",
    "Write a short poem about the sea at night.",
    "What should I pack for a weekend hike in the mountains?",
    "Describe how bread is made, step by step.",
    "Give me three tips for learning a new language.",
    "Why is the sky blue? Explain it to a child.",
    "Write a letter to a friend about a trip to the coast.",
]
METHODS = {"eagle": SpeculativeConfig("eagle"), "lookup": SpeculativeConfig("lookup")}


def decode(llm: LLM, prompts: list[list[int]], params: SamplingParams, speculative: SpeculativeConfig | None,
           max_batch: int = 1) -> tuple[float, list[list[int]], int, int]:  # fmt: skip
    """All prompts in one engine -> (decode tokens/s, each request's tokens, drafts, accepted)."""
    engine = LLMEngine(llm, EngineConfig(num_blocks=64 * len(prompts), speculative_max_batch=max_batch))
    requests = [engine.add_request(f"r{i}", p, params, speculative=speculative) for i, p in enumerate(prompts)]
    while any(not r.output_ids for r in requests):  # the prompts, and each request's first token
        engine.step()
    started, first = time.perf_counter(), sum(len(r.output_ids) for r in requests)
    while any(r.status.value != "finished" for r in requests):
        engine.step()
    seconds = time.perf_counter() - started
    totals = engine.speculative_totals
    tokens = sum(len(r.output_ids) for r in requests) - first
    return tokens / seconds, [r.output_ids for r in requests], totals.proposed_tokens, totals.accepted_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--weights", default="q4")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,4", help="requests decoding at once, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="rounds; each method between two plain runs")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated from {', '.join(METHODS)}")
    parser.add_argument("--speculative-max-batch", type=int, default=1,
                        help="EngineConfig.speculative_max_batch: costly drafts run while at most this many decode")
    args = parser.parse_args()
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    llm = LLM.load(args.model, progress=False, weights=args.weights)
    template = llm.tokenizer.apply_chat_template
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    rows = []
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        texts = [template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], add_generation_prompt=True)
                 for i in range(concurrency)]  # fmt: skip
        prompts = [llm.tokenizer.encode(text, add_special_tokens=False) for text in texts]
        decode(llm, prompts, params, None)  # warm-up
        samples: dict[str, list[float]] = {"plain": [], **{m: [] for m in methods}}
        ratios: dict[str, list[float]] = {m: [] for m in methods}
        counts: dict[str, tuple[int, int]] = {}
        identical = {m: True for m in methods}
        for round_index in range(args.repeats):
            order = methods[round_index % len(methods) :] + methods[: round_index % len(methods)]
            before, plain_tokens, _, _ = decode(llm, prompts, params, None)
            samples["plain"].append(before)
            for method in order:
                speed, tokens, proposed, accepted = decode(llm, prompts, params, METHODS[method], args.speculative_max_batch)
                after, _, _, _ = decode(llm, prompts, params, None)
                samples[method].append(speed)
                samples["plain"].append(after)
                ratios[method].append(speed / ((before + after) / 2))
                identical[method] &= tokens == plain_tokens
                counts[method] = (proposed, accepted)
                before = after
        rows.append({"concurrency": concurrency, "method": "plain", "decode_tok_s": statistics.median(samples["plain"]),
                     "speedup": 1.0, "samples": samples["plain"]})  # fmt: skip
        for method in methods:
            proposed, accepted = counts[method]
            rows.append({
                "concurrency": concurrency, "method": method, "decode_tok_s": statistics.median(samples[method]),
                "speedup": statistics.median(ratios[method]), "speedup_min": min(ratios[method]),
                "speedup_max": max(ratios[method]), "identical_tokens": identical[method],
                "acceptance": accepted / proposed if proposed else None, "samples": samples[method],
                "ratios": ratios[method],
            })  # fmt: skip
    print(f"{args.model} ({args.weights}) in the engine (speculative_max_batch {args.speculative_max_batch}), "
          f"chat requests, {args.new_tokens} new tokens each, medians of {args.repeats} rounds")  # fmt: skip
    print_table(rows, ["concurrency", "method", "decode_tok_s", "speedup", "speedup_min", "speedup_max", "acceptance",
                       "identical_tokens"])  # fmt: skip
    suffix = "" if args.speculative_max_batch == 1 else f"-max-batch-{args.speculative_max_batch}"
    path = write_results(f"engine_speculative{suffix}-{args.model}-{cpu_class()}", {"config": vars(args), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
