"""How near kvgen's and llama.cpp's quantized forwards come to each other and to the same file's
weights run in fp32, where their greedy tokens part on a random-weight file: the last logits of a
128-token prompt from kvgen (the file's quantized weights), llama.cpp (the same file) and kvgen
with weights="fp32" (the file's weights dequantized, no activation rounded), compared pairwise by
correlation and largest difference, with the quantized top-2 gap (a near tie flips the first token).

    python benchmarks/q4_agreement.py --models <file.gguf> [<file.gguf> ...] --name q4-agreement
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from common import write_results  # noqa: E402


def compare(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    return {"correlation": float(np.corrcoef(a, b)[0, 1]), "max_difference": float(np.abs(a - b).max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", required=True, help="GGUF files with quantized projections")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--name", default="q4-agreement", help="results file: results/<name>.json")
    args = parser.parse_args()
    from llama_cpp import Llama

    from kvgen import LLM

    ids = list(range(1000, 1000 + args.prompt_tokens))
    rows = {}
    for path in args.models:
        peer = Llama(model_path=path, n_ctx=2 * args.prompt_tokens, n_threads=2, verbose=False, logits_all=True)
        peer.reset()
        peer.eval(ids)
        llama_cpp = np.array(peer.scores[len(ids) - 1])
        del peer
        last = {}
        for weights in ("q4", "fp32"):
            llm = LLM.load(path, progress=False, weights=weights)
            with torch.inference_mode():
                last[weights] = llm.model(torch.tensor([ids]), llm.generator.new_cache(len(ids)))[0, -1].numpy()
            del llm
        top = np.sort(last["q4"])[::-1]
        rows[Path(path).stem] = {
            "logit_std": float(last["q4"].std()), "kvgen_top2_gap": float(top[0] - top[1]),
            "same_argmax": bool(last["q4"].argmax() == llama_cpp.argmax()),
            "kvgen_vs_llama_cpp": compare(last["q4"], llama_cpp), "kvgen_vs_fp32": compare(last["q4"], last["fp32"]),
            "llama_cpp_vs_fp32": compare(llama_cpp, last["fp32"]),
        }  # fmt: skip
        print(Path(path).stem, rows[Path(path).stem])
    print(write_results(args.name, {"prompt_tokens": args.prompt_tokens, "models": rows}))


if __name__ == "__main__":
    main()
