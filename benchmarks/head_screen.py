"""Could greedy decoding skip most of a Q8_0 output head and still pick its exact argmax?

A step's head reads every row of [V, H] int8 codes. A screen would read only each code's high 4 bits
(half the bytes: code = 16 * high + low, low in 0..15), bound what the low bits can add to each
row's logit, and compute exactly only the rows whose upper bound reaches the best lower bound. With
nothing else read, the bound on a row is the worst case, 7.5 * sum over blocks |d_w d_x| sum |a|
(low bits centred on 7.5, a the int8 activation codes of the block), whatever the low bits are.

This measures, for greedy steps of a real model, how many rows stay candidates: the screen pays
only when few do. The hidden states are the torch path's last normed rows (the input of the head),
quantized to int8 blocks of 32 by kvgen's own quantizer (kvgen_quantize_x8); the codes and scales are
the GGUF file's own Q8_0 head, read as kvgen reads it (its q8s blocks).

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
from kvgen.kernels import load  # noqa: E402
from kvgen.kernels.formats import QK, from_gguf_blocks  # noqa: E402
from kvgen.loading.registry import resolve_model_path  # noqa: E402
from kvgen.models.quantized_linear import X8_BLOCK_BYTES  # noqa: E402

Q8_0 = 8  # ggml type


def q8_0_head(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """The output head's Q8_0 blocks: scales [V, nb] float32 and codes [V, nb, 32] int32."""
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    head = tensors.get("output.weight") or tensors["token_embd.weight"]  # tied: the embedding
    if int(head.tensor_type) != Q8_0:
        raise SystemExit(f"{path.name}: the head is {head.tensor_type.name}, not Q8_0; this measures Q8_0 heads")
    vocab = int(head.shape[1])
    weight = from_gguf_blocks("Q8_0", np.asarray(head.data).view(np.uint8).reshape(vocab, -1), "q8s")
    blocks = weight.blocks.numpy().reshape(vocab, -1, 2 + QK)
    return weight.scales()[..., 0], blocks[..., 2:].view(np.int8).astype(np.int32)


def activation_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [H] as kvgen's kernels quantize it: each block's scale [nb] and int8 codes [nb, 32]."""
    library = load()
    if library is None:
        raise SystemExit("the kernels are not built (a C compiler is needed)")
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(len(x) // QK * X8_BLOCK_BYTES, dtype=np.uint8)  # block_x8: f32 d, f32 s, int8 qs[32]
    library.kvgen_quantize_x8(x.ctypes.data, 1, len(x), out.ctypes.data)
    out = out.reshape(-1, X8_BLOCK_BYTES)
    return out[:, :4].copy().view(np.float32)[:, 0], out[:, 8:].view(np.int8).astype(np.int32)


def head_inputs(model: str, steps: int) -> list[np.ndarray]:
    """The head's input row at each greedy step (torch path)."""
    llm = LLM.load(model, progress=False)
    llm.model.use_fast_decode = False  # the head's module runs, so a hook sees its input
    rows: list[np.ndarray] = []
    llm.model.lm_head.register_forward_hook(lambda _m, args, _out: rows.append(args[0].reshape(-1, args[0].shape[-1])[-1].float().numpy().copy()))
    llm.generate(llm.tokenizer.encode(FILLER[:120]), SamplingParams(max_new_tokens=steps, ignore_eos=True))
    return rows


def screen(scales: np.ndarray, codes: np.ndarray, x: np.ndarray) -> dict[str, float]:
    d_x, a = activation_blocks(x)  # [nb], [nb, 32]
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
