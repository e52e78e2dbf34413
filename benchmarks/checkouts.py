"""Batch-1 decode (or prefill) of two commits of kvgen, taking turns: what a change did to the speed.

Runs from one machine's quiet spell drift by 10-40%, more than most changes move decoding; a change
is measured by two checkouts taking turns instead. Each commit is exported (`git archive`) into a
temporary folder; then, pair after pair, a fresh process of the base commit and one of the new
commit each load the model and time `--repeats` greedy decodes of `--new-tokens` tokens (EOS
ignored) after a warm-up, and report their median tok/s. The table gives each side's median over
the pairs and the median of the per-pair ratios; every sample and both sides' tokens (which must
agree) go to benchmarks/results/checkouts-<model>-<cpu class>.json. The kernels build once per
commit (cached by source). With `--prefill N` each turn times the prefill of an N-token prompt (the
benchmarks' text, `common.prompt_ids`; the prefill's own timer, one new token) instead; with
`--verify N --context C`, one forward over N new tokens after a C-token context, as a speculative
verify of N - 1 drafts runs (the median of `--repeats` x 5 forwards; tok/s = N / its time). With
`--context C` alone, the decode follows a C-token prompt of the benchmarks' text instead of
`--prompt`: decode at depth, where the cache's reads weigh.

    python benchmarks/checkouts.py --base a52cc96 --head 6837d03 --pairs 6
    python benchmarks/checkouts.py --base feff921 --head 1db94b5 --prefill 2048 --repeats 2
    python benchmarks/checkouts.py --base 21953ce --head bc683f8 --prefill 512 --repeats 3 --name amx-prefill512
    python benchmarks/checkouts.py --base 7be3115 --head 806449f --verify 8 --context 2048
    python benchmarks/checkouts.py --base 3148d9d --head HEAD --model M.gguf --context 3968 --new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cpu_class, model_label, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# Run in each turn's fresh process, with the commit's src/ first on the path.
TURN = """
import json, statistics, sys
from kvgen import LLM, SamplingParams
model, weights, new_tokens, repeats, prompt = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
prefill, verify, context = int(sys.argv[6]), int(sys.argv[8]), int(sys.argv[9])
sys.path.insert(0, sys.argv[7])
from common import prompt_ids
if verify:
    import time, torch
    llm = LLM.load(model, progress=False, weights=weights)
    ids = prompt_ids(llm.tokenizer, context + verify)
    cache = llm.generator.new_cache(context + verify)
    speeds = []
    with torch.inference_mode():
        llm.model(torch.tensor([ids[:context]]), cache)
        rows = torch.tensor([ids[context:]])
        for _ in range(repeats * 5 + 2):
            cache.truncate(context)
            start = time.perf_counter()
            logits = llm.model(rows, cache, logits_to_keep=verify)
            speeds.append(verify / (time.perf_counter() - start))
    speeds, tokens = speeds[2:], logits[0].argmax(-1).tolist()
    print(json.dumps({"tok_s": statistics.median(speeds), "samples": speeds, "tokens": tokens}))
    raise SystemExit
llm = LLM.load(model, progress=False, weights=weights, max_context=prefill + 1 if prefill else None)
if prefill:
    prompt, new_tokens = prompt_ids(llm.tokenizer, prefill), 1
elif context:  # decode at depth
    prompt = prompt_ids(llm.tokenizer, context)
params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
llm.generate(prompt, params)
runs = [llm.generate(prompt, params) for _ in range(repeats)]
timings = [run.timings for run in runs]
speeds = [t.prefill_tokens_per_second if prefill else t.decode_tokens_per_second for t in timings]
print(json.dumps({"tok_s": statistics.median(speeds), "samples": speeds, "tokens": runs[0].token_ids}))
"""


def export(revision: str, into: Path) -> tuple[str, Path]:
    """The commit's tree under `into` -> (its full sha, the folder)."""
    sha = subprocess.run(["git", "rev-parse", revision], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()
    archive = subprocess.run(["git", "archive", sha, "src"], cwd=ROOT, check=True, capture_output=True).stdout
    folder = into / sha[:12]
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    return sha, folder


def turn(folder: Path, args: argparse.Namespace) -> dict:
    command = [sys.executable, "-c", TURN, args.model, args.weights, str(args.new_tokens), str(args.repeats), args.prompt,
               str(args.prefill), str(Path(__file__).resolve().parent), str(args.verify), str(args.context)]  # fmt: skip
    environment = os.environ | {"PYTHONPATH": str(folder / "src")}
    done = subprocess.run(command, env=environment, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the commit before the change")
    parser.add_argument("--head", default="HEAD", help="the commit with it")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5, help="decodes per turn (their median is the turn's)")
    parser.add_argument("--pairs", type=int, default=6, help="turns of each commit, alternating")
    parser.add_argument("--prompt", default="Once upon a time")
    parser.add_argument("--prefill", type=int, default=0, help="time the prefill of a prompt of this many tokens instead")
    parser.add_argument("--verify", type=int, default=0, help="time one forward over this many new tokens instead")
    parser.add_argument("--context", type=int, default=0, help="the tokens in the cache before a decode (its prompt) or a --verify forward")
    parser.add_argument("--numerics-change", action="store_true",
                        help="the head changes the arithmetic on purpose: keep going where the tokens differ, and "
                             "record how many leading tokens agree")
    parser.add_argument("--name", default=None,
                        help="the results file's name before -<model>-<cpu class> (default: checkouts, checkouts-prefill<N> "
                             "or checkouts-verify<N>-at<C>)")
    args = parser.parse_args()
    if args.verify and args.prefill:
        parser.error("--verify and --prefill time different things: give one")
    if args.context and args.prefill:
        parser.error("--context is the cache before a decode or a --verify forward, not a --prefill: give one")
    if args.verify and args.context < 1:
        parser.error("--verify needs --context (the tokens in the cache before the forward), at least 1")
    with tempfile.TemporaryDirectory() as scratch:
        (base_sha, base), (head_sha, head) = export(args.base, Path(scratch)), export(args.head, Path(scratch))
        pairs = []
        for index in range(args.pairs):
            before, after = turn(base, args), turn(head, args)
            agreeing = next((i for i, (a, b) in enumerate(zip(before["tokens"], after["tokens"])) if a != b),
                            min(len(before["tokens"]), len(after["tokens"])))  # fmt: skip
            if before["tokens"] != after["tokens"] and not args.numerics_change:
                raise SystemExit(f"pair {index}: the two commits decoded different tokens (from token {agreeing}); "
                                 "--numerics-change if the head changes the arithmetic on purpose")  # fmt: skip
            pairs.append({"base": before, "head": after, "ratio": after["tok_s"] / before["tok_s"], "agreeing_tokens": agreeing})
            print(f"pair {index + 1}: {before['tok_s']:.1f} -> {after['tok_s']:.1f} tok/s ({pairs[-1]['ratio']:.3f}x)")
    summary = {
        "base_tok_s": statistics.median(pair["base"]["tok_s"] for pair in pairs),
        "head_tok_s": statistics.median(pair["head"]["tok_s"] for pair in pairs),
        "ratio": statistics.median(pair["ratio"] for pair in pairs),
    }
    if args.verify:
        what, default_name = f"{args.verify}-token forward after {args.context}", f"checkouts-verify{args.verify}-at{args.context}"
    elif args.prefill:
        what, default_name = f"{args.prefill}-token prefill", f"checkouts-prefill{args.prefill}"
    elif args.context:
        what, default_name = f"{args.new_tokens} new tokens after {args.context}", f"checkouts-at{args.context}"
    else:
        what, default_name = f"{args.new_tokens} new tokens", "checkouts"
    print(f"{args.model} ({args.weights}), {what}, {args.pairs} pairs: {base_sha[:7]} "
          f"{summary['base_tok_s']:.1f} tok/s, {head_sha[:7]} {summary['head_tok_s']:.1f} tok/s, "
          f"median ratio {summary['ratio']:.3f}x")  # fmt: skip
    config = vars(args) | {"base_sha": base_sha, "head_sha": head_sha}
    for pair in pairs:
        pair["base"].pop("tokens"), pair["head"].pop("tokens")
    path = write_results(f"{args.name or default_name}-{model_label(args.model)}-{cpu_class()}", {"config": config, "summary": summary, "pairs": pairs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
