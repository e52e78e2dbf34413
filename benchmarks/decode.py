"""Batch-1 prefill and decode speed: kvgen vs transformers generate() on the same GGUF, same run.

Both engines are timed the same way from outside: time to first token = generate(1 token);
decode tokens/s = (N - 1) / (time of generate(N) - time of generate(1)). Greedy, EOS ignored.

    python benchmarks/decode.py --model smollm2 --prompt-tokens 128 --new-tokens 256
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import best_of, print_table, prompt_ids, timed, write_results  # noqa: E402

from kvgen import LLM, SamplingParams  # noqa: E402
from kvgen.loading.registry import resolve_model_path  # noqa: E402


def measure(generate: Callable[[int], Any], prompt_tokens: int, new_tokens: int, repeats: int) -> dict[str, float]:
    generate(2)  # warm up allocators and kernels
    first = best_of(repeats, lambda: timed(lambda: generate(1)))
    full = best_of(repeats, lambda: timed(lambda: generate(new_tokens)))
    return {
        "time_to_first_token_s": first,
        "prefill_tokens_per_s": prompt_tokens / first,
        "decode_tokens_per_s": (new_tokens - 1) / (full - first),
        "total_s": full,
    }


def kvgen_runner(llm: LLM, ids: list[int]) -> Callable[[int], Any]:
    def generate(n: int) -> Any:
        result = llm.generate(ids, SamplingParams(max_new_tokens=n, ignore_eos=True))
        assert len(result.token_ids) == n
        return result

    return generate


def transformers_runner(path: Path, ids: list[int], dtype: torch.dtype) -> Callable[[int], Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    input_ids = torch.tensor([ids])

    def generate(n: int) -> Any:
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=0)  # fmt: skip
        assert out.shape[1] == len(ids) + n
        return out

    return generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()

    llm = LLM.load(args.model, dtype=args.dtype, progress=False)
    ids = prompt_ids(llm.tokenizer, args.prompt_tokens)
    rows = [{"engine": "kvgen", **measure(kvgen_runner(llm, ids), len(ids), args.new_tokens, args.repeats)}]
    if not args.skip_transformers:
        runner = transformers_runner(resolve_model_path(args.model), ids, llm.model.dtype)
        rows.append({"engine": "transformers", **measure(runner, len(ids), args.new_tokens, args.repeats)})
        base = rows[1]
        for row in rows:
            row["decode_vs_transformers"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
            row["prefill_vs_transformers"] = row["prefill_tokens_per_s"] / base["prefill_tokens_per_s"]

    print(f"\n{args.model}, batch 1, {len(ids)}-token prompt, {args.new_tokens} new tokens, greedy, {args.dtype}")
    print_table(rows, ["engine", "prefill_tokens_per_s", "decode_tokens_per_s", "prefill_vs_transformers", "decode_vs_transformers"])
    config = {k: getattr(args, k) for k in ("model", "prompt_tokens", "new_tokens", "repeats", "dtype")}
    path = write_results(f"decode-{args.model}", {"config": config, "rows": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
