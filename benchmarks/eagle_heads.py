"""EAGLE heads side by side on the 4-bit SmolLM2: the shipped head against other weight files.

Per task (speculative.py's chat, open-ended and grounded requests) and per head:
1. how often the target's greedy token is among the head's top 1..4 first drafts at each reply
   position (teacher-forced: the head fed the target's features as the decoder feeds them);
2. in-process turns of EAGLE's default (adaptive, one-token drafts) with each head, each request
   between two plain ones (its ratio against their mean), order reversed every round; medians of
   the ratios, every sample kept. Every run's tokens must equal plain greedy decoding's.

Results: benchmarks/results/eagle_heads-<cpu class>.json.

    python benchmarks/eagle_heads.py --heads candidate.safetensors --rounds 7
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cpu_class, print_table, write_results  # noqa: E402
from eagle_trees import reply_features, top_k_hits, turns  # noqa: E402

from kvgen import LLM  # noqa: E402
from kvgen.speculative.eagle import SHIPPED_WEIGHTS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", required=True, help="comma-separated head weight files to set beside the shipped head")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--tasks", default="chat,open-ended,grounded")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    heads = {"shipped": str(SHIPPED_WEIGHTS)}
    for path in args.heads.split(","):
        if not Path(path).is_file():
            parser.error(f"--heads: no head weights at {path}")
        heads[Path(path).stem] = path
    llm = LLM.load("smollm2", progress=False)  # the default 4-bit weights
    tasks = args.tasks.split(",")
    replies = {task: reply_features(llm, task, args.new_tokens) for task in tasks}  # one per task, for every head
    hits = {task: {name: top_k_hits(llm, replies[task], weights=path) for name, path in heads.items()} for task in tasks}
    for task, by_head in hits.items():
        for name, shares in by_head.items():
            print(f"{task}, {name}: target token among the head's top 1..4 first drafts: "
                  f"{' '.join(f'{s:.3f}' for s in shares)}")  # fmt: skip
    configs = {name: {"eagle_weights": path} for name, path in heads.items()}
    rows = [row for task in tasks for row in turns(llm, task, args.rounds, args.new_tokens, configs)]
    for row in rows:
        row["head"] = row.pop("eagle")
    print_table(rows, ["task", "head", "decode_tok_s", "speedup", "acceptance_rate", "tokens_per_verify", "verify_steps"])
    write_results(f"eagle_heads-{cpu_class()}", {"config": vars(args), "heads": heads, "top_k_first_draft_hits": hits,
                                                  "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
