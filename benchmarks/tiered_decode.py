"""Tiered cache cost: decode speed against the contiguous cache in the same run, with most of the
prompt warm or on disk, and how many cold-block reads the prefetcher had finished in time.

    python benchmarks/tiered_decode.py --tokens 512 --new 32
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from common import print_table, prompt_ids, write_results  # noqa: E402

from kvgen import LLM, CacheConfig, SamplingParams  # noqa: E402
from kvgen.generate import Generator  # noqa: E402

SETTINGS = [  # (label, config)
    ("contiguous", CacheConfig()),
    ("tiered all hot", CacheConfig("tiered", hot_tokens=1 << 20)),
    ("tiered fp16 warm, 128 hot", CacheConfig("tiered", hot_tokens=128, warm_tokens=1 << 20, warm_dtype="fp16")),
    ("tiered int8 warm, 128 hot", CacheConfig("tiered", hot_tokens=128, warm_tokens=1 << 20, warm_dtype="int8")),
    ("tiered 128 hot, 128 warm, rest disk", CacheConfig("tiered", hot_tokens=128, warm_tokens=128)),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--weights", default="fp32")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--new", type=int, default=32)
    args = parser.parse_args()
    llm = LLM.load(args.model, progress=False, weights=args.weights)
    ids = prompt_ids(llm.tokenizer, args.tokens)
    params = SamplingParams(max_new_tokens=args.new, ignore_eos=True)
    rows, reference = [], None
    for label, config in SETTINGS:
        generator = Generator(llm.model, llm.tokenizer, cache=config)
        generator.generate(ids[:32], SamplingParams(max_new_tokens=2))  # warm-up
        stream = generator.stream(ids, params)
        memory, stats = 0, {}
        for _ in stream:
            memory = max(memory, stream.cache.memory_bytes())
            stats = dict(getattr(stream.cache, "stats", {}))
        result = stream.result
        reference = reference or result.token_ids
        rows.append({"cache": label, "decode_tok_s": result.timings.decode_tokens_per_second,
                     "prefill_tok_s": result.timings.prefill_tokens_per_second, "ram_mb": memory / 2**20,
                     "cold_reads": stats.get("cold_reads", 0), "prefetched": stats.get("prefetch_hits", 0),
                     "same_tokens": result.token_ids == reference})  # fmt: skip
    print(f"\n{args.model} ({args.weights} weights), {args.tokens}-token prompt, {args.new} new tokens")
    print_table(rows, ["cache", "decode_tok_s", "prefill_tok_s", "ram_mb", "cold_reads", "prefetched", "same_tokens"])
    print(f"\nwrote {write_results('tiered_decode', {'config': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
