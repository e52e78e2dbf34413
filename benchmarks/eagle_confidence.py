"""How well the EAGLE head's confidence predicts acceptance, and what draft lengths chosen from it
would buy (EAGLE-2's dynamic drafts), replayed offline on the 4-bit SmolLM2's own greedy replies.

At every reply position the head is fed the target's features as the decoder feeds them and drafts
three tokens; each draft's softmax maximum over the draft vocabulary is its confidence. The table
gives, per depth and confidence tenth, how often the draft was the target's greedy token (given the
drafts before it were). The replay then walks each reply as the decoder would, under a cost model in
plain-step units (`--draft-cost` per drafted token, `--verify-cost` for a two-row verify, `--row-cost`
per row past two), for fixed lengths and for lengths cut where the confidence falls below a
threshold. Results: benchmarks/results/eagle_confidence-<cpu class>.json.

    python benchmarks/eagle_confidence.py --tasks chat,open-ended --new-tokens 256
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cpu_class, write_results  # noqa: E402
from speculative import task_prompt  # noqa: E402

from kvgen import LLM, SamplingParams  # noqa: E402
from kvgen.kv.contiguous import ContiguousCache  # noqa: E402
from kvgen.kv.interface import CacheSpec  # noqa: E402
from kvgen.speculative.eagle import EagleProposer, eagle_proposer  # noqa: E402
from kvgen.speculative.proposer import DraftPolicy  # noqa: E402

DEPTH = 3
Position = tuple[list[int], list[int], list[float]]  # drafted, the target's greedy tokens, confidences


class ConfidentProposer(EagleProposer):
    """The EAGLE proposer, recording each draft's softmax maximum over the draft vocabulary."""

    confidences: list[float]

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        logits = super().draft_logits(features)
        self.confidences.append(float(torch.softmax(logits.float(), -1).max()))
        return logits


@torch.inference_mode()
def positions(llm: LLM, task: str, new_tokens: int) -> list[Position]:
    model = llm.model
    prompt = task_prompt(llm, task)
    prompt_ids = prompt if isinstance(prompt, list) else llm.tokenizer.encode(prompt)
    reply = llm.generate(prompt_ids, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)).token_ids
    ids = prompt_ids + reply
    cache = ContiguousCache(CacheSpec.for_model(model.config, model.dtype), len(ids))
    features = model.hidden_states(torch.tensor([ids]), cache)[0]
    greedy = model.logits_from_hidden(features).argmax(-1).tolist()
    proposer = ConfidentProposer(model, eagle_proposer(model, None).head)  # the runtime head (q4: C linears)
    out, seen = [], len(prompt_ids)
    for j in range(len(prompt_ids), len(ids) - DEPTH - 1):
        proposer.observe_features(features[seen : j + 1])
        seen = j + 1
        proposer.confidences = []
        drafted = proposer.propose(ids[: j + 2], DEPTH, DraftPolicy(SamplingParams()), None).tokens
        out.append((drafted, greedy[j + 1 : j + 1 + DEPTH], list(proposer.confidences)))
    return out


def calibration(rows: list[Position]) -> list[dict[str, list[int]]]:
    """Per depth: confidence tenth -> [drafts whose earlier drafts were right, of them right]."""
    table: list[dict[str, list[int]]] = []
    for depth in range(DEPTH):
        bins: dict[str, list[int]] = {}
        for drafted, truth, confidences in rows:
            if len(confidences) > depth and drafted[:depth] == truth[:depth]:
                counts = bins.setdefault(f"{min(int(confidences[depth] * 10), 9) / 10:.1f}", [0, 0])
                counts[0] += 1
                counts[1] += drafted[depth] == truth[depth]
        table.append(dict(sorted(bins.items())))
    return table


def replay(replies: list[list[Position]], length: Callable[[list[float]], tuple[int, int]], args) -> float:
    """Speedup over plain decoding when each step drafts and verifies `length(confidences)` =
    (drafted, verified) tokens, walking each reply as the decoder does."""
    seconds = tokens = 0.0
    for rows in replies:
        j = 0
        while j < len(rows):
            drafted, truth, confidences = rows[j]
            made, kept = length(confidences)
            accepted = 0
            while accepted < kept and drafted[accepted] == truth[accepted]:
                accepted += 1
            seconds += args.draft_cost * made + args.verify_cost + args.row_cost * (kept - 1)
            tokens += accepted + 1
            j += accepted + 1
    return tokens / seconds


def confident_length(draft_above: float, keep_above: float) -> Callable[[list[float]], tuple[int, int]]:
    """Draft one more token while the running confidence product is above `draft_above`; verify the
    drafts whose product stays above `keep_above` (at least the first)."""

    def length(confidences: list[float]) -> tuple[int, int]:
        made, kept, product = 1, 1, confidences[0]
        while made < DEPTH and product >= draft_above:
            made += 1
            if product * confidences[made - 1] < keep_above:
                break
            kept, product = made, product * confidences[made - 1]
        return made, kept

    return length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="chat,open-ended")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--draft-cost", type=float, default=0.18, help="a drafted token, in plain steps")
    parser.add_argument("--verify-cost", type=float, default=1.13, help="a two-row verify, in plain steps")
    parser.add_argument("--row-cost", type=float, default=0.23, help="each verify row past two, in plain steps")
    args = parser.parse_args()
    torch.set_num_threads(2)
    llm = LLM.load("smollm2", progress=False)
    replies = [positions(llm, task, args.new_tokens) for task in args.tasks.split(",")]
    table = calibration([row for rows in replies for row in rows])
    for depth, bins in enumerate(table, 1):
        print(f"depth {depth}: " + ", ".join(f"{tenth}: {right}/{n}" for tenth, (n, right) in bins.items()))
    policies: dict[str, Any] = {f"fixed {k}": (lambda c, k=k: (k, k)) for k in range(1, DEPTH + 1)}
    for draft_above in (0.6, 0.7, 0.8, 0.9):
        for keep_above in (0.5, 0.6, 0.7, 0.8):
            policies[f"draft while > {draft_above}, keep while > {keep_above}"] = confident_length(draft_above, keep_above)
    speedups = {name: replay(replies, length, args) for name, length in policies.items()}
    for name, speedup in speedups.items():
        print(f"{name:40s} {speedup:.3f}x")
    payload = {"settings": vars(args), "positions": sum(len(r) for r in replies),
               "calibration": [{t: {"drafts": n, "right": r} for t, (n, r) in bins.items()} for bins in table],
               "speedups": speedups}  # fmt: skip
    print(f"wrote {write_results(f'eagle_confidence-{cpu_class()}', payload)}")


if __name__ == "__main__":
    main()
