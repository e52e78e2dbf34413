"""Speculative decoding speedup per proposer, on open-ended and input-grounded text (same run).

For each target weight format, each task and each proposer: decode tokens/s with speculation vs plain
greedy decoding of the same model, whether the tokens are identical, and the draft acceptance rate.
Also the cost of one target forward over 1, 5 and 9 tokens (what a verify step costs vs a plain step).

    python benchmarks/speculative.py                 # fp32 and q4 targets, 128 new tokens
    python benchmarks/speculative.py --weights q4 --new-tokens 64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import best_of, print_table, timed, write_results  # noqa: E402

from kvgen import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from kvgen.kv.contiguous import ContiguousCache  # noqa: E402
from kvgen.kv.interface import CacheSpec  # noqa: E402

PASSAGE = (
    "The lighthouse stood on a rock at the mouth of the harbour. Every evening the keeper climbed the "
    "hundred and twelve steps, trimmed the wick, polished the great lens and lit the lamp, and every "
    "morning he put it out again and wrote in his log the weather, the ships that had passed and the "
    "oil he had burned. He did this for forty years, and in all that time the light never failed."
)
TASKS = {
    "open-ended": "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    # Input-grounded: the answer quotes the passage, as summaries and retrieval answers quote theirs.
    "grounded": f"Passage: {PASSAGE}\n\nQuote the passage exactly.\nQuote: The lighthouse stood on a rock",
}


def forward_ms(llm: LLM, num_tokens: int, repeats: int) -> float:
    """One target forward over `num_tokens` new tokens after a 64-token context, in ms."""
    model = llm.model
    cache = ContiguousCache(CacheSpec.for_model(model.config, model.dtype), 128)
    with torch.inference_mode():
        model(torch.arange(64)[None], cache)

        def run() -> float:
            cache.truncate(64)
            return timed(lambda: model(torch.arange(num_tokens)[None], cache, logits_to_keep=None))

        return best_of(repeats, run) * 1000


def configs(weights: str, draft: LLM | None) -> dict[str, SpeculativeConfig]:
    out = {"lookup": SpeculativeConfig("lookup"), "self": SpeculativeConfig("self"), "eagle": SpeculativeConfig("eagle")}
    if draft is not None:
        out["draft"] = SpeculativeConfig("draft", draft_model=draft)
    return out


def run_one(llm: LLM, prompt: str, params: SamplingParams, config: SpeculativeConfig | None, repeats: int):
    results = []
    for _ in range(repeats):
        results.append(llm.generate(prompt, params, speculative=config))
    return max(results, key=lambda r: r.timings.decode_tokens_per_second)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--weights", default="fp32,q4", help="target weight formats, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)

    rows: list[dict[str, Any]] = []
    forwards: dict[str, dict[int, float]] = {}
    for weights in args.weights.split(","):
        llm = LLM.load(args.model, progress=False, weights=weights)
        # The only same-tokenizer draft we ship is the 4-bit copy of the same model: used for fp32.
        draft = LLM.load(args.model, progress=False, weights="q4") if weights != "q4" else None
        forwards[weights] = {n: forward_ms(llm, n, max(3, args.repeats)) for n in (1, 5, 9)}
        for task, prompt in TASKS.items():
            run_one(llm, prompt, SamplingParams(max_new_tokens=8), None, 1)  # warm-up (kernels, allocator)
            plain = run_one(llm, prompt, params, None, args.repeats)
            base = plain.timings.decode_tokens_per_second
            rows.append({"weights": weights, "task": task, "method": "plain", "decode_tok_s": base, "speedup": 1.0,
                         "identical": True, "acceptance": None, "tokens_per_verify": None})  # fmt: skip
            for method, config in configs(weights, draft).items():
                result = run_one(llm, prompt, params, config, args.repeats)
                stats = result.speculative
                rows.append({
                    "weights": weights, "task": task, "method": method,
                    "decode_tok_s": result.timings.decode_tokens_per_second,
                    "speedup": result.timings.decode_tokens_per_second / base,
                    "identical": result.token_ids == plain.token_ids,
                    "acceptance": stats.acceptance_rate, "tokens_per_verify": stats.tokens_per_verify,
                })  # fmt: skip
                print(f"{weights} {task} {method}: {rows[-1]['speedup']:.2f}x", file=sys.stderr)
    print_table(rows, ["weights", "task", "method", "decode_tok_s", "speedup", "identical", "acceptance", "tokens_per_verify"])
    print("target forward ms by new tokens:", forwards)
    best = max((r for r in rows if r["method"] != "plain" and r["identical"]), key=lambda r: r["speedup"])
    print(f"best: {best['method']} on {best['task']} ({best['weights']}): {best['speedup']:.2f}x")
    path = write_results("speculative", {"model": args.model, "new_tokens": args.new_tokens, "rows": rows,
                                         "forward_ms": forwards, "best": best})  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
