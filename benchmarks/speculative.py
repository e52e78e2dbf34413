"""Speculative decoding speedup per proposer, on chat, open-ended and input-grounded text (same run).

For each target weight format, each task and each proposer: decode tokens/s with speculation vs plain
greedy decoding of the same model, whether the tokens are identical, the draft acceptance rate and the
tokens each verify forward yields. Within each round every proposer runs on each task between two
plain runs (their order rotating from round to round), and its ratio is against the mean of those
two: this machine's speed drifts 10-20% within a round. Every sample is kept in the JSON, the table
shows median speeds, and a speedup is the median over rounds of those ratios. Also the cost of one
target forward over 1, 5 and 9 new tokens (a verify step vs a plain step). Where drafts fail (lookup and self on open-ended text), the adaptive draft length must
fall back to near plain speed: the summary prints the worst ratio.

    python benchmarks/speculative.py                 # fp32 and q4 targets, 128 new tokens, 3 rounds
    python benchmarks/speculative.py --weights q4 --new-tokens 64
    python benchmarks/speculative.py --weights q4 --methods lookup --lora-rank 16   # every request under a LoRA adapter

With `--lora-rank R` every request, plain and speculative, runs under a random rank-R LoRA adapter
on every linear (benchmarks/lora.py's, loaded by kvgen): the verify then adds the adapter's deltas
to each of its rows. Prompt lookup and the draft model run under an adapter; self and eagle, which
draft from the base model, are refused there (SpeculativeConfig.check_adapter).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import best_of, between_plain_runs, cpu_class, print_table, timed, write_results  # noqa: E402

from kvgen import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from kvgen.kv.contiguous import ContiguousCache  # noqa: E402
from kvgen.kv.interface import CacheSpec  # noqa: E402

CHAT_REQUEST = "Write a short story about an old lighthouse keeper and the night the light almost failed."
PASSAGE = (
    "The lighthouse stood on a rock at the mouth of the harbour. Every evening the keeper climbed the "
    "hundred and twelve steps, trimmed the wick, polished the great lens and lit the lamp, and every "
    "morning he put it out again and wrote in his log the weather, the ships that had passed and the "
    "oil he had burned. He did this for forty years, and in all that time the light never failed."
)
TASKS = {
    "chat": None,  # CHAT_REQUEST through the model's chat template (open-ended chat)
    "open-ended": "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    # Input-grounded: the answer quotes the passage, as summaries and retrieval answers quote theirs.
    "grounded": f"Passage: {PASSAGE}\n\nQuote the passage exactly.\nQuote: The lighthouse stood on a rock",
}


def forward_ms(llm: LLM, num_tokens: int, repeats: int, adapter: str | None = None) -> float:
    """One target forward over `num_tokens` new tokens after a 64-token context, in ms (under LoRA
    `adapter` where one is named, as the requests run)."""
    model = llm.model
    cache = ContiguousCache(CacheSpec.for_model(model.config, model.dtype), 128)
    with torch.inference_mode():
        model(torch.arange(64)[None], cache, adapter=adapter)

        def run() -> float:
            cache.truncate(64)
            return timed(lambda: model(torch.arange(num_tokens)[None], cache, logits_to_keep=None, adapter=adapter))

        return best_of(repeats, run) * 1000


def configs(weights: str, draft: LLM | None) -> dict[str, SpeculativeConfig]:
    out = {"lookup": SpeculativeConfig("lookup"), "self": SpeculativeConfig("self"), "eagle": SpeculativeConfig("eagle")}
    if draft is not None:
        out["draft"] = SpeculativeConfig("draft", draft_model=draft)
    return out


def task_prompt(llm: LLM, task: str) -> str | list[int]:
    if TASKS[task] is not None:
        return TASKS[task]
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": CHAT_REQUEST}], add_generation_prompt=True)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--weights", default="fp32,q4", help="target weight formats, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="rounds; plain and every proposer run once per round")
    parser.add_argument("--methods", default="lookup,self,eagle,draft", help="proposers, comma-separated "
                        "(draft: the 4-bit copy of the model drafting for a non-4-bit target)")  # fmt: skip
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated from {', '.join(TASKS)}")
    parser.add_argument("--lora-rank", type=int, default=0, help="run every request under a random LoRA adapter of this rank (0: none)")
    args = parser.parse_args()
    refused = sorted({"self", "eagle"} & set(args.methods.split(",")))
    if args.lora_rank and refused:
        parser.error(f"--methods {','.join(refused)}: these draft from the base model and are refused under a LoRA adapter; "
                     "leave them out with --lora-rank")  # fmt: skip
    adapter = "bench" if args.lora_rank else None
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, adapter=adapter)
    tasks = [t for t in args.tasks.split(",") if t]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        parser.error(f"unknown task(s) {', '.join(unknown)}; choose from {', '.join(TASKS)}")

    rows: list[dict[str, Any]] = []
    forwards: dict[str, dict[int, float]] = {}
    for weights in args.weights.split(","):
        llm = LLM.load(args.model, progress=False, weights=weights)
        if adapter is not None:
            from lora import write_peft_adapter

            folder = Path(tempfile.mkdtemp()) / adapter
            write_peft_adapter(llm, folder, args.lora_rank, seed=0)
            llm.load_adapter(adapter, folder)
        # The only same-tokenizer draft we ship is the 4-bit copy of the same model: used for fp32.
        draft = LLM.load(args.model, progress=False, weights="q4") if weights != "q4" else None
        methods = {m: c for m, c in configs(weights, draft).items() if m in args.methods.split(",")}
        forwards[weights] = {n: forward_ms(llm, n, 3, adapter) for n in (1, 5, 9)}
        prompts = {task: task_prompt(llm, task) for task in tasks}
        for task, prompt in prompts.items():
            llm.generate(prompt, SamplingParams(max_new_tokens=8, adapter=adapter))  # warm-up (kernels, allocator)
        samples, ratios = between_plain_runs(llm, prompts, lambda task: methods, params, args.repeats)
        for task in tasks:
            plain = samples[(task, "plain")]
            for method in ["plain", *methods]:
                results = samples[(task, method)]
                speeds = [r.timings.decode_tokens_per_second for r in results]
                stats = [r.speculative for r in results if r.speculative is not None]
                rows.append({
                    "weights": weights, "task": task, "method": method,
                    "decode_tok_s": statistics.median(speeds), "speedup": statistics.median(ratios.get((task, method), [1.0])),
                    "speedup_samples": ratios.get((task, method), []),
                    "identical": all(r.token_ids == plain[0].token_ids for r in results),
                    "acceptance": statistics.median(s.acceptance_rate for s in stats) if stats else None,
                    "tokens_per_verify": statistics.median(s.tokens_per_verify for s in stats) if stats else None,
                    "verify_steps": statistics.median(s.verify_steps for s in stats) if stats else None,
                    "probe_steps": statistics.median(s.probe_steps for s in stats) if stats else None,
                    "samples_tok_s": speeds,
                })  # fmt: skip
                print(f"{weights} {task} {method}: {rows[-1]['speedup']:.2f}x", file=sys.stderr)
    print_table(rows, ["weights", "task", "method", "decode_tok_s", "speedup", "identical", "acceptance", "tokens_per_verify",
                       "verify_steps", "probe_steps"])  # fmt: skip
    print("target forward ms by new tokens:", forwards)
    drafted = [r for r in rows if r["method"] != "plain"]
    best = max((r for r in drafted if r["identical"]), key=lambda r: r["speedup"], default=None)
    worst = min(drafted, key=lambda r: r["speedup"], default=None)
    for label, row in (("best", best), ("worst", worst)):
        if row is not None:
            print(f"{label}: {row['method']} on {row['task']} ({row['weights']}): {row['speedup']:.2f}x")
    config = {"model": args.model, "new_tokens": args.new_tokens, "repeats": args.repeats, "methods": args.methods,
              "tasks": tasks, "threads": torch.get_num_threads(), "lora_rank": args.lora_rank}  # fmt: skip
    path = write_results(f"speculative-{args.model}{f'-lora-r{args.lora_rank}' if args.lora_rank else ''}-{cpu_class()}", {"config": config, "rows": rows,
                                                                       "forward_ms": forwards, "best": best, "worst": worst})  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
