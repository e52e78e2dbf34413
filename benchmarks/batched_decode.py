"""Batched decode: one forward_batch of B rows x 1 token vs B single-row decode forwards.

Every row has a prompt of `--context` tokens in its own paged cache; each timed step appends one
token per row (and is rewound afterwards so every repeat sees the same lengths).

    python benchmarks/batched_decode.py --model smollm2 --rows 8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import best_of, model_label, print_table, prompt_ids, timed, write_results  # noqa: E402

from kvgen import LLM  # noqa: E402
from kvgen.kv import CacheSpec, PagedCache, PagedStorage  # noqa: E402


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--weights", default="fp32")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    llm = LLM.load(args.model, weights=args.weights, progress=False)
    storage = PagedStorage.create(CacheSpec.for_model(llm.config), budget_mb=256)
    caches = [PagedCache(storage) for _ in range(args.rows)]
    ids = prompt_ids(llm.tokenizer, args.context + args.rows)
    for row, cache in enumerate(caches):
        llm.model(torch.tensor([ids[row : row + args.context]]), cache)
    tokens = [[ids[args.context + row]] for row in range(args.rows)]

    def rewind() -> None:
        for cache in caches:
            cache.truncate(args.context)

    def batched() -> float:
        seconds = timed(lambda: llm.model.forward_batch(tokens, caches))
        rewind()
        return seconds

    def one_by_one() -> float:
        seconds = timed(lambda: [llm.model(torch.tensor([t]), c) for t, c in zip(tokens, caches)])
        rewind()
        return seconds

    batched(), one_by_one()  # warm up
    rows = [
        {"mode": f"forward_batch {args.rows}x1", "seconds": best_of(args.repeats, batched)},
        {"mode": f"{args.rows} single forwards", "seconds": best_of(args.repeats, one_by_one)},
    ]
    for row in rows:
        row["tokens_per_s"] = args.rows / row["seconds"]
    speedup = rows[1]["seconds"] / rows[0]["seconds"]
    print_table(rows, ["mode", "seconds", "tokens_per_s"])
    print(f"speedup of the batched step: {speedup:.2f}x")
    write_results(f"batched-decode-{model_label(args.model)}", {"args": vars(args), "rows": rows, "speedup": speedup})


if __name__ == "__main__":
    main()
