"""Predicted Outputs: decode speed with a prediction of the reply (prompt lookup that searches the
predicted text first) against plain greedy decoding and plain prompt lookup, on the same requests.

Tasks (SmolLM2's chat template; the model's own greedy replies decide what a prediction matches):
- `retry`: the same request again, its earlier reply as the prediction (a client retrying, or a
  chat edited after the reply): the prediction is exactly the reply.
- `revise`: a request changed by one word, the reply to the unchanged request as the prediction:
  how much of a related reply the drafts keep.
- `edit`: OpenAI's example of Predicted Outputs: code in the message, an edit asked for, the code as
  the prediction (the code is in the prompt too, so plain lookup finds it as well).
- `unrelated`: a prediction that has nothing to do with the reply: the adaptive draft length must
  fall back to plain speed.

Each round runs every method on each task between two plain runs (rotating their order), and a
ratio is against the mean of those two plain runs. Every sample is kept in the JSON; the table shows
the median ratio over rounds. The tokens must equal plain greedy decoding's.

    python benchmarks/predicted_outputs.py                # 4-bit SmolLM2, up to 200 new tokens, 5 rounds
    python benchmarks/predicted_outputs.py --rounds 3 --tasks retry,edit
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import between_plain_runs, cpu_class, print_table, write_results  # noqa: E402

from kvgen import LLM, SamplingParams, SpeculativeConfig  # noqa: E402

STORY = "Write a short story about an old lighthouse keeper and the night the light {} failed."
CODE = '''class Basket:
    def __init__(self):
        self.items = []

    def add(self, name, price, quantity=1):
        self.items.append({"name": name, "price": price, "quantity": quantity})

    def total(self):
        total = 0
        for item in self.items:
            total += item["price"] * item["quantity"]
        return total

    def count(self):
        count = 0
        for item in self.items:
            count += item["quantity"]
        return count
'''
EDIT = "Rename the method total to subtotal in this class and reply with the whole class only.\n\n" + CODE
UNRELATED = "The mitochondria is the powerhouse of the cell. " * 8
TASKS = ("retry", "revise", "edit", "unrelated")


def chat(llm: LLM, message: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True)


def task_requests(llm: LLM, params: SamplingParams) -> dict[str, tuple[str, str]]:
    """task -> (prompt, prediction)."""
    story = chat(llm, STORY.format("almost"))
    reply = llm.generate(story, params).text
    return {
        "retry": (story, reply),
        "revise": (chat(llm, STORY.format("nearly")), reply),
        "edit": (chat(llm, EDIT), CODE),
        "unrelated": (story, UNRELATED),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--weights", default="q4")
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated from {', '.join(TASKS)}")
    args = parser.parse_args()
    tasks = args.tasks.split(",")
    if unknown := [t for t in tasks if t not in TASKS]:
        parser.error(f"unknown task(s) {', '.join(unknown)}; choose from {', '.join(TASKS)}")
    llm = LLM.load(args.model, progress=False, weights=args.weights)
    params = SamplingParams(max_new_tokens=args.new_tokens)
    requests = {t: r for t, r in task_requests(llm, params).items() if t in tasks}
    methods = {"lookup": lambda _: SpeculativeConfig("lookup"),
               "prediction": lambda prediction: SpeculativeConfig("lookup", prediction=prediction)}  # fmt: skip
    for prompt, _ in requests.values():
        llm.generate(prompt, SamplingParams(max_new_tokens=8))  # warm-up
    configs = {task: {name: method(prediction) for name, method in methods.items()} for task, (_, prediction) in requests.items()}
    samples, ratios = between_plain_runs(llm, {t: prompt for t, (prompt, _) in requests.items()}, configs.__getitem__, params,
                                         args.rounds)  # fmt: skip
    rows = []
    for task in requests:
        reference = samples[(task, "plain")][0].token_ids
        for method in ["plain", *methods]:
            results = samples[(task, method)]
            stats = [r.speculative for r in results if r.speculative is not None]
            rows.append({
                "task": task, "method": method,
                "decode_tok_s": statistics.median(r.timings.decode_tokens_per_second for r in results),
                "speedup": statistics.median(ratios.get((task, method), [1.0])),
                "speedup_samples": ratios.get((task, method), []),
                "identical": all(r.token_ids == reference for r in results),
                "acceptance": statistics.median(s.acceptance_rate for s in stats) if stats else None,
                "tokens_per_verify": statistics.median(s.tokens_per_verify for s in stats) if stats else None,
                "samples_tok_s": [r.timings.decode_tokens_per_second for r in results],
            })  # fmt: skip
    print_table(rows, ["task", "method", "decode_tok_s", "speedup", "identical", "acceptance", "tokens_per_verify"])
    config = {"model": args.model, "weights": args.weights, "new_tokens": args.new_tokens, "rounds": args.rounds,
              "tasks": tasks, "threads": torch.get_num_threads()}  # fmt: skip
    path = write_results(f"predicted_outputs-{args.model}-{cpu_class()}", {"config": config, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
