"""Batched vs one-by-one generation: the same prompts, greedy, same run.

`LLM.generate_batch` (one batched forward per step over every unfinished prompt) against a loop of
`LLM.generate` (batch 1, the C decode path), for each weight format asked for. Throughput counts
generated tokens over wall time including prefill; EOS is ignored so every prompt makes the same
number of tokens.

    python benchmarks/batch.py --prompts 8 --new-tokens 64 --weights q4,fp32
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import print_table, prompt_ids, timed, write_results  # noqa: E402

from kvgen import LLM, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--weights", default="q4,fp32", help="comma-separated weight formats to compare")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    rows = []
    for weights in args.weights.split(","):
        llm = LLM.load(args.model, weights=weights, progress=False)
        ids = prompt_ids(llm.tokenizer, 400)
        prompts = [ids[i * 7 : i * 7 + 16 + 24 * i] for i in range(args.prompts)]  # 16..184 tokens
        total = args.prompts * args.new_tokens
        llm.generate_batch(prompts[:2], SamplingParams(max_new_tokens=2))  # warm up (engine, kernels)
        prefix = llm._batch.engine.scheduler.prefix  # the batch's engine keeps a prefix cache
        batched_runs, alone_runs = [], []
        for _ in range(args.repeats):  # taking turns, best of each: the machine's speed drifts
            prefix.clear()  # every batched run starts cold: no prompt is reused from the last one
            batched_runs.append(timed(lambda: llm.generate_batch(prompts, params)))
            alone_runs.append(timed(lambda: [llm.generate(p, params) for p in prompts]))
        batched, alone = min(batched_runs), min(alone_runs)
        rows.append({"weights": weights, "mode": f"generate_batch x{args.prompts}", "seconds": batched, "tokens_per_s": total / batched})
        rows.append({"weights": weights, "mode": "one by one", "seconds": alone, "tokens_per_s": total / alone})
        rows[-2]["vs_one_by_one"] = alone / batched
    print_table(rows, ["weights", "mode", "seconds", "tokens_per_s", "vs_one_by_one"])
    write_results(f"batch-{args.model}", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
