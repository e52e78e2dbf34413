"""gpt-oss checkpoints' experts under kvgen's per-expert names.

A Hugging Face gpt-oss layer stacks its experts: `mlp.experts.gate_up_proj` [E, H, 2 I] with gate
and up columns interleaved (gate even, up odd), `gate_up_proj_bias` [E, 2 I], `down_proj` [E, I, H]
and `down_proj_bias` [E, H], multiplied as x @ W. OpenAI's released checkpoints keep the two weights
in MXFP4 instead: `<name>_blocks` [E, rows, columns / 32, 16] bytes (two 4-bit e2m1 codes a byte,
the low one first) and `<name>_scales` [E, rows, columns / 32] (a power-of-two exponent, biased by
127, per 32 values), rows and columns as nn.Linear has them. The router is `mlp.router`."""

from __future__ import annotations

import torch

from kvgen.kernels.formats import QuantizedWeight

MXFP4_PARTS = ("_blocks", "_scales")
# e2m1's 16 codes: sign bit, then 2 exponent and 1 mantissa bits.
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def decode_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 bytes [..., G, 16] and exponents [..., G] -> fp32 values [..., G * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                         f"{scales.dtype} do not pair: expected uint8 [..., G, 16] and uint8 [..., G]")  # fmt: skip
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # [..., G, 32], low nibble first
    values = torch.ldexp(E2M1_VALUES[codes], scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2)


def name_gpt_oss_experts(tensors: dict[str, torch.Tensor | QuantizedWeight], dtype: torch.dtype) -> None:
    """In place: each layer's router as mlp.gate.{weight,bias} and expert e's projections as
    mlp.experts.{e}.{gate,up,down}_proj.{weight,bias} in nn.Linear layout."""
    for name in list(tensors):
        if name.endswith(".mlp.router.weight") or name.endswith(".mlp.router.bias"):
            tensors[name.replace(".mlp.router.", ".mlp.gate.")] = tensors.pop(name)
        elif name.endswith("_blocks") and ".mlp.experts." in name:  # stored as [E, out, in]: as x @ W has it
            stem = name.removesuffix("_blocks")
            blocks, scales = tensors.pop(name), tensors.pop(f"{stem}_scales")
            assert isinstance(blocks, torch.Tensor) and isinstance(scales, torch.Tensor)
            tensors[stem] = decode_mxfp4(blocks, scales).transpose(1, 2).to(dtype)
    for name in list(tensors):
        if not name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            continue
        stacked, bias = tensors.pop(name), tensors.pop(f"{name}_bias")
        assert isinstance(stacked, torch.Tensor) and isinstance(bias, torch.Tensor)
        prefix, projection = name.rsplit(".", 1)
        for e in range(stacked.shape[0]):
            if projection == "down_proj":
                tensors[f"{prefix}.{e}.down_proj.weight"] = stacked[e].T.contiguous()
                tensors[f"{prefix}.{e}.down_proj.bias"] = bias[e].contiguous()
                continue
            for part, columns in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
                tensors[f"{prefix}.{e}.{part}.weight"] = stacked[e][:, columns].T.contiguous()
                tensors[f"{prefix}.{e}.{part}.bias"] = bias[e][columns].contiguous()
