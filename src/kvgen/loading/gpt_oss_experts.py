"""gpt-oss checkpoints' experts under kvgen's per-expert names.

A Hugging Face gpt-oss layer stacks its experts: `mlp.experts.gate_up_proj` [E, H, 2 I] with gate
and up columns interleaved (gate even, up odd), `gate_up_proj_bias` [E, 2 I], `down_proj` [E, I, H]
and `down_proj_bias` [E, H], multiplied as x @ W. OpenAI's released checkpoints keep the two weights
in MXFP4 instead: `<name>_blocks` [E, rows, columns / 32, 16] bytes (two 4-bit e2m1 codes a byte,
the low one first) and `<name>_scales` [E, rows, columns / 32] (a power-of-two exponent, biased by
127, per 32 values), rows and columns as nn.Linear has them. The router is `mlp.router`. With
quantized weights (the default for such a folder) those experts keep MXFP4's codes and scales, as
they do from a GGUF file (loading/weight_format.py quantize_gguf_rows)."""

from __future__ import annotations

import numpy as np
import torch

from kvgen.kernels.formats import QuantizedWeight
from kvgen.loading.weight_format import quantize_gguf_rows

MXFP4_PARTS = ("_blocks", "_scales")
# Each stacked projection's rows (nn.Linear's [out, in]) per expert weight: gate_up's interleave.
_PROJECTION_ROWS = {"gate_up_proj": (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))),
                    "down_proj": (("down_proj", slice(None)),)}  # fmt: skip
# e2m1's 16 codes: sign bit, then 2 exponent and 1 mantissa bits.
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 bytes [..., G, 16] and exponents [..., G] -> fp32 values [..., G * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                         f"{scales.dtype} do not pair: expected uint8 [..., G, 16] and uint8 [..., G]")  # fmt: skip
    values = torch.ldexp(E2M1_VALUES[_codes(blocks).long()], scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2)


def _codes(blocks: torch.Tensor) -> torch.Tensor:
    """A checkpoint's MXFP4 bytes [..., G, 16] -> its codes [..., G, 32] in value order (low nibble first)."""
    return torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)


def gguf_mxfp4_rows(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """A checkpoint's MXFP4 rows [rows, G, 16] + [rows, G] -> GGUF's MXFP4 rows [rows, G * 17]: per
    32 values the exponent byte, then the codes with values j and j + 16 sharing byte j (the
    checkpoint pairs values 2j and 2j + 1)."""
    codes = _codes(blocks)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat((scales[..., None], packed), dim=-1).reshape(blocks.shape[0], -1).numpy()


def has_mxfp4_experts(tensors: dict[str, torch.Tensor | QuantizedWeight]) -> bool:
    return any(name.endswith("_blocks") and ".mlp.experts." in name for name in tensors)


def name_gpt_oss_experts(tensors: dict[str, torch.Tensor | QuantizedWeight], dtype: torch.dtype, mode: str) -> None:
    """In place: each layer's router as mlp.gate.{weight,bias} and expert e's projections as
    mlp.experts.{e}.{gate,up,down}_proj.{weight,bias} in nn.Linear layout; MXFP4 experts decoded to
    `dtype` (mode fp32) or kept as the kernels' blocks of their codes (int8, q4)."""
    for name in list(tensors):
        if name.endswith(".mlp.router.weight") or name.endswith(".mlp.router.bias"):
            tensors[name.replace(".mlp.router.", ".mlp.gate.")] = tensors.pop(name)
        elif name.endswith("_blocks") and ".mlp.experts." in name:  # stored as [E, out, in]: as x @ W has it
            stem = name.removesuffix("_blocks")
            blocks, scales = tensors.pop(name), tensors.pop(f"{stem}_scales")
            assert isinstance(blocks, torch.Tensor) and isinstance(scales, torch.Tensor)
            if mode == "fp32":
                tensors[stem] = decode_mxfp4(blocks, scales).transpose(1, 2).to(dtype)
            else:
                _keep_mxfp4(tensors, stem, blocks, scales, mode)
    for name in list(tensors):
        if not name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            continue
        stacked, bias = tensors.pop(name), tensors.pop(f"{name}_bias")
        assert isinstance(stacked, torch.Tensor) and isinstance(bias, torch.Tensor)
        prefix, projection = name.rsplit(".", 1)
        for e in range(stacked.shape[0]):
            for part, rows in _PROJECTION_ROWS[projection]:
                tensors[f"{prefix}.{e}.{part}.weight"] = stacked[e].T[rows].contiguous()  # x @ W -> nn.Linear's rows
                tensors[f"{prefix}.{e}.{part}.bias"] = bias[e][rows].contiguous()


def _keep_mxfp4(tensors: dict[str, torch.Tensor | QuantizedWeight], stem: str, blocks: torch.Tensor,
                scales: torch.Tensor, mode: str) -> None:  # fmt: skip
    """Expert e's rows of `stem` (gate_up: gate rows even, up rows odd) as quantized weights, exact,
    and its bias renamed with them."""
    prefix, projection = stem.rsplit(".", 1)
    bias = tensors.pop(f"{stem}_bias")
    assert isinstance(bias, torch.Tensor)
    for e in range(blocks.shape[0]):
        for part, rows in _PROJECTION_ROWS[projection]:
            raw = gguf_mxfp4_rows(blocks[e][rows], scales[e][rows])
            tensors[f"{prefix}.{e}.{part}.weight"] = quantize_gguf_rows("MXFP4", raw, None, mode)  # type: ignore[arg-type]
            tensors[f"{prefix}.{e}.{part}.bias"] = bias[e][rows].contiguous()
