"""Could greedy decoding skip most of a Q8_0 output head and still pick its exact argmax?

A step's head reads every row of [V, H] int8 codes. A screen would read only each code's high 4 bits
(half the bytes: code = 16 * high + low, low in 0..15), bound what the low bits can add to each
row's logit, and compute exactly only the rows whose upper bound reaches the best lower bound. With
nothing else read, the bound on a row is the worst case, 7.5 * sum over blocks |d_w d_x| sum |a|
(low bits centred on 7.5, a the int8 activation codes of the block), whatever the low bits are.

This measures, for greedy steps of a real model, how many rows stay candidates: the screen pays
only when few do. The hidden states are the torch path's last normed rows (the input of the head),
quantized to int8 blocks of 32 as kvgen's kernels do (scale = amax / 127, round to nearest even);
the codes and scales are the GGUF file's own Q8_0 head.

    python benchmarks/head_screen.py --model gemma3-270m --steps 64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import FILLER, cpu_class, model_label, print_table, write_results  # noqa: E402

from gguf import GGUFReader  # noqa: E402

from kvgen import LLM, SamplingParams  # noqa: E402
from kvgen.loading.registry import resolve_model_path  # noqa: E402

Q8_0 = 8  # ggml type
BLOCK = 32


def q8_0_head(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """The output head's Q8_0 blocks: scales [V, nb] float32 and codes [V, nb, 32] int32."""
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    head = tensors.get("output.weight") or tensors["token_embd.weight"]  # tied: the embedding
    if int(head.tensor_type) != Q8_0:
        raise SystemExit(f"{path.name}: the head is {head.tensor_type.name}, not Q8_0; this measures Q8_0 heads")
    hidden, vocab = (int(n) for n in head.shape)
    raw = np.asarray(head.data).view(np.uint8).reshape(vocab, hidden // BLOCK, 2 + BLOCK)
    scales = raw[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = raw[:, :, 2:].copy().view(np.int8).astype(np.int32)
    return scales, codes


def head_inputs(model: str, steps: int) -> list[np.ndarray]:
    """The head's input row at each greedy step (torch path)."""
    llm = LLM.load(model, progress=False)
    llm.model.use_fast_decode = False  # the head's module runs, so a hook sees its input
    rows: list[np.ndarray] = []
    llm.model.lm_head.register_forward_hook(lambda _m, args, _out: rows.append(args[0].reshape(-1, args[0].shape[-1])[-1].float().numpy().copy()))
    llm.generate(llm.tokenizer.encode(FILLER[:120]), SamplingParams(max_new_tokens=steps, ignore_eos=True))
    return rows


def screen(scales: np.ndarray, codes: np.ndarray, x: np.ndarray) -> dict[str, float]:
    blocks = x.reshape(-1, BLOCK)
    d_x = np.abs(blocks).max(axis=1) / 127
    a = np.rint(blocks / np.where(d_x > 0, d_x, 1)[:, None]).astype(np.int32)  # [nb, 32]
    unit = scales * d_x[None, :]  # [V, nb]: d_w * d_x
    exact = (unit * np.einsum("vbj,bj->vb", codes, a)).sum(axis=1)
    high = codes >> 4  # arithmetic: the signed high nibble
    screened = (unit * (16 * np.einsum("vbj,bj->vb", high, a) + 7.5 * a.sum(axis=1)[None, :])).sum(axis=1)
    bound = 7.5 * (np.abs(unit) * np.abs(a).sum(axis=1)[None, :]).sum(axis=1)
    floor = (screened - bound).max()
    return {"candidates": int((screened + bound >= floor).sum()), "bound": float(bound.mean()),
            "error": float(np.abs(exact - screened).mean()), "spread": float(exact.std())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    scales, codes = q8_0_head(resolve_model_path(args.model))
    steps = [screen(scales, codes, x) for x in head_inputs(args.model, args.steps)]
    candidates = np.array([s["candidates"] for s in steps])
    row = {"model": args.model, "vocab": int(codes.shape[0]), "steps": len(steps),
           "candidates_median": float(np.median(candidates)), "candidates_p90": float(np.percentile(candidates, 90)),
           "candidates_max": int(candidates.max()), "candidate_share": float(np.median(candidates) / codes.shape[0]),
           "bound_mean": float(np.mean([s["bound"] for s in steps])),
           "error_mean": float(np.mean([s["error"] for s in steps])),
           "logit_spread": float(np.mean([s["spread"] for s in steps]))}
    print_table([row], list(row))
    print(f"wrote {write_results(f'head_screen-{model_label(args.model)}-{cpu_class()}', {'rows': [row], 'steps': steps})}")


if __name__ == "__main__":
    main()
