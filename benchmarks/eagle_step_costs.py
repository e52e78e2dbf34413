"""Where an EAGLE step's time goes, on the speculative benchmark's chat request (one process).

Each round decodes the chat request with EAGLE at a fixed two-token draft with one alternative to
the first (where the adaptive controller settles on chat; fixed, so that the timers' own cost never
makes it pause), timing the parts of every speculative step, then plainly; per part it prints the
median time of one call and the calls per step: the draft (the head's positions, the
draft-vocabulary logits, the rest of `propose`), the target's tree verify forward and its logits,
the verification around them, and a plain step.
Medians over the rounds' medians; every round in benchmarks/results/eagle_step_costs-<cpu class>.json.

    python benchmarks/eagle_step_costs.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cpu_class, print_table, write_results  # noqa: E402
from speculative import task_prompt  # noqa: E402

from kvgen import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from kvgen.speculative import decoder, eagle, eagle_fast  # noqa: E402

# (part, class, method): each call of the method is timed as the part.
PARTS = [
    ("speculative step", decoder.SpeculativeDecoder, "step"),
    ("draft (propose)", eagle.EagleProposer, "propose"),
    ("head position", eagle_fast.FastHeadCache, "run"),
    ("draft logits", eagle.EagleProposer, "draft_logits"),
    ("verify step (target + verification)", decoder.SpeculativeDecoder, "_verify_step"),
    ("target tree forward (rows)", None, "tree_hidden_states"),
    ("target logits", None, "logits_from_hidden"),
    ("plain step (in speculation)", decoder.SpeculativeDecoder, "_plain_step"),
]


def timed_calls(owner: Any, name: str, into: list[float]) -> Callable[[], None]:
    """Time every call of owner.name into `into`; returns the undo."""
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - started)

    setattr(owner, name, wrapper)
    return lambda: setattr(owner, name, original)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    llm = LLM.load("smollm2", progress=False)
    prompt = task_prompt(llm, "chat")
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    config = SpeculativeConfig("eagle", num_draft_tokens=2, adaptive=False, draft_alternatives=1)
    llm.generate(prompt, params, speculative=config)  # warm-up
    rounds = []
    for _ in range(args.rounds):
        calls: dict[str, list[float]] = {part: [] for part, _, _ in PARTS}
        undo = [timed_calls(owner or type(llm.model), name, calls[part]) for part, owner, name in PARTS]
        try:
            speculative = llm.generate(prompt, params, speculative=config).timings.decode_tokens_per_second
        finally:
            for restore in undo:
                restore()
        plain = llm.generate(prompt, params).timings.decode_tokens_per_second
        steps = len(calls["speculative step"])
        rounds.append({
            "speculative_tok_s": speculative, "plain_tok_s": plain, "plain_ms_per_token": 1000 / plain, "steps": steps,
            "parts": {part: {"median_ms": 1000 * statistics.median(times) if times else None,
                             "calls_per_step": len(times) / steps} for part, times in calls.items()},
        })  # fmt: skip
    rows = [{"part": part, "median_ms": statistics.median(r["parts"][part]["median_ms"] or 0.0 for r in rounds),
             "calls_per_step": statistics.median(r["parts"][part]["calls_per_step"] for r in rounds)}
            for part, _, _ in PARTS]  # fmt: skip
    plain_ms = statistics.median(r["plain_ms_per_token"] for r in rounds)
    rows.append({"part": "plain decoding, per token", "median_ms": plain_ms, "calls_per_step": None})
    ratio = statistics.median(r["speculative_tok_s"] / r["plain_tok_s"] for r in rounds)
    print(f"EAGLE on the chat request, {args.new_tokens} new tokens, medians of {args.rounds} rounds; "
          f"speculative / plain decode speed {ratio:.2f}x")  # fmt: skip
    print_table(rows, ["part", "median_ms", "calls_per_step"])
    path = write_results(f"eagle_step_costs-{cpu_class()}", {"config": vars(args), "rows": rows, "rounds": rounds})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
