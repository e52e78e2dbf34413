"""What 16-bit weights' prompt path does to the model: perplexity on Shakespeare, KL divergence and
top-1 agreement against the fp32 weights decoded one token at a time, for the 16bit mode's decode
step (fp32 activations), its prompts with the widened fp32 GEMM (KVGEN_PREFILL_GEMM=fp32) and its
prompts with the bf16 kernel (activations rounded to bf16; the default where the kernels have
AVX512-BF16). Prompts are fed in chunks of --chunk tokens through the torch forward, as a prompt runs.

    python benchmarks/prefill_quality.py --models <F16 / BF16 .gguf paths> --tokens 1024
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from common import compared, cpu_class, model_label, print_table, write_results  # noqa: E402

from kvgen import LLM  # noqa: E402
from kvgen.models.half_linear import bf16_gemm_built  # noqa: E402
from kvgen.quality import score  # noqa: E402
from tests.support.shakespeare import play_text  # noqa: E402


def _prompt_scores(path: str, ids: list[int], prefill: str, chunk: int) -> Any:
    """16bit weights loaded with KVGEN_PREFILL_GEMM=prefill (HalfLinear reads it at load), every
    chunk through the torch forward."""
    os.environ["KVGEN_PREFILL_GEMM"] = prefill
    try:
        llm = LLM.load(path, progress=False, weights="16bit")
    finally:
        del os.environ["KVGEN_PREFILL_GEMM"]
    llm.model.use_fast_decode = False
    return score(llm.model, llm.generator.new_cache, ids, chunk_size=chunk, keep_distributions=True)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", required=True, help="comma-separated F16 / BF16 .gguf paths (benchmarks/quantize_gguf.py)")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=256, help="prompt rows a forward")
    parser.add_argument("--play", default="hamlet")
    parser.add_argument("--name", default="prefill_quality")
    args = parser.parse_args()
    if not bf16_gemm_built():
        parser.error("the kernels are built without AVX512-BF16 here: 16-bit prompts already run the fp32 GEMM")

    rows: list[dict[str, Any]] = []
    for path in args.models.split(","):
        label = model_label(path)
        reference = LLM.load(path, progress=False, weights="fp32")
        ids = reference.tokenizer.encode(play_text(args.play))[: args.tokens + 1]
        exact = score(reference.model, reference.generator.new_cache, ids, chunk_size=1, keep_distributions=True)
        rows.append({"model": label, "path": "fp32 weights, one token at a time", **compared(exact, exact)})
        half = LLM.load(path, progress=False, weights="16bit")
        decoded = score(half.model, half.generator.new_cache, ids, chunk_size=1, keep_distributions=True)
        rows.append({"model": label, "path": "16bit decode step (fp32 activations)", **compared(exact, decoded)})
        for prefill, name in (("fp32", "16bit prompts, widened fp32 GEMM"), ("bf16", "16bit prompts, bf16 kernel")):
            rows.append({"model": label, "path": name, **compared(exact, _prompt_scores(path, ids, prefill, args.chunk))})
    print(f"\n{args.play}, {args.tokens} tokens, prompts in chunks of {args.chunk}")
    print_table(rows, ["model", "path", "perplexity", "delta_ppl_pct", "kld", "top1_agreement"])
    path = write_results(f"{args.name}-{cpu_class()}", {"config": vars(args), "rows": rows})  # the kernel is per CPU class
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
