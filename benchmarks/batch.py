"""Batched vs one-by-one generation: the same prompts of different lengths, greedy, same run.

`LLM.generate_batch` (the engine: every unfinished prompt in one step) against a loop of
`LLM.generate` (batch 1, the C decode step), for each weight format asked for: the batching gain at
equal weights. transformers is the peer with a batch of its own: `generate()` over the same prompts,
left-padded to the longest (fp32, the GGUF dequantized: its CPU path for these files). Throughput
counts generated tokens over wall time including prefill; EOS is ignored so every prompt makes the
same number of tokens. In each of `--repeats` rounds every mode runs once, in turn; the table shows
medians and the JSON keeps every sample.

    python benchmarks/batch.py --prompts 8 --new-tokens 64 --weights q4,fp32
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_class, print_table, prompt_ids, timed, write_results  # noqa: E402
from serving import transformers_batch_runner  # noqa: E402

from kvgen import LLM, SamplingParams  # noqa: E402
from kvgen.loading.registry import resolve_model_path  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--weights", default="q4,fp32", help="comma-separated weight formats to compare")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peers", default="transformers", help="'transformers' (its padded batch) or empty for none")
    args = parser.parse_args()
    if args.peers not in ("", "transformers"):
        parser.error(f"--peers: unknown {args.peers!r}; give 'transformers' or ''")

    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    total = args.prompts * args.new_tokens
    modes: dict[tuple[str, str], Callable[[], Any]] = {}  # (weights, mode) -> one timed run
    prompts: list[list[int]] = []
    for weights in args.weights.split(","):
        llm = LLM.load(args.model, weights=weights, progress=False)
        ids = prompt_ids(llm.tokenizer, 400)
        prompts = [ids[i * 7 : i * 7 + 16 + 24 * i] for i in range(args.prompts)]  # 16..184 tokens
        llm.generate_batch(prompts[:2], SamplingParams(max_new_tokens=2))  # warm up (engine, kernels)
        prefix = llm._batch.engine.scheduler.prefix  # the batch's engine keeps a prefix cache

        def batched(llm: LLM = llm, prefix: Any = prefix) -> None:
            prefix.clear()  # every batched run starts cold: no prompt is reused from the last one
            llm.generate_batch(prompts, params)

        modes[(llm.weights, f"kvgen generate_batch x{args.prompts}")] = batched
        modes[(llm.weights, "kvgen one by one")] = lambda llm=llm: [llm.generate(p, params) for p in prompts]
    if args.peers:
        peer = transformers_batch_runner(resolve_model_path(args.model), prompts)  # left-padded
        peer(2)  # warm up
        modes[("fp32 (dequantized)", f"transformers padded batch x{args.prompts}")] = lambda: peer(args.new_tokens)
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in modes}
    for _ in range(args.repeats):  # taking turns: the machine's speed drifts
        for key, run in modes.items():
            samples[key].append(total / timed(run))
    rows = [{"weights": w, "mode": m, "tokens_per_s": statistics.median(s), "samples_tokens_per_s": [round(x, 2) for x in s]}
            for (w, m), s in samples.items()]  # fmt: skip
    by_key = {(r["weights"], r["mode"]): r for r in rows}
    peer_row = next((r for r in rows if r["mode"].startswith("transformers")), None)
    for row in rows:
        alone = by_key.get((row["weights"], "kvgen one by one"))
        if row["mode"].startswith("kvgen generate_batch") and alone is not None:
            row["vs_one_by_one"] = row["tokens_per_s"] / alone["tokens_per_s"]
        if peer_row is not None:
            row["vs_transformers_batch"] = row["tokens_per_s"] / peer_row["tokens_per_s"]
    print(f"\n{args.model}, {args.prompts} prompts of 16-{16 + 24 * (args.prompts - 1)} tokens, {args.new_tokens} new "
          f"tokens each, greedy, {torch.get_num_threads()} threads, medians of {args.repeats} rounds")  # fmt: skip
    print_table(rows, ["weights", "mode", "tokens_per_s", "vs_one_by_one", "vs_transformers_batch"])
    out = write_results(f"batch-{args.model}-{cpu_class()}", {"config": vars(args), "rows": rows})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
