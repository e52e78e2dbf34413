"""Token embeddings kept as a GGUF file's quantized rows.

A lookup reads a handful of rows a step, yet a float table of the whole vocabulary is what a
quantized model used to hold: Gemma 3's 262,144 x 640 is 671 MB in fp32 (its Q8_0 rows 178 MB),
Llama 3's 128,256 x 4,096 is 2.1 GB. `QuantizedRows` keeps the file's rows as they are (quantized,
or F16 / BF16: half an fp32 table) and dequantizes only the rows a lookup reads, with gguf-py's
dequantization, which works block by block: a row gets the bits it had in the float table. A tied
Q8_0 table is read from the head's blocks instead (`HeadRows`), which hold the same rows: Gemma 3
keeps its 178 MB of rows once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch
from torch import nn

from kvgen.models.quantized_linear import INTERLEAVED_ROWS

FINITE_CHECK_ROWS = 16384  # rows dequantized at a time by the load-time check (a bounded buffer)
Q8_0 = 8  # GGML's type id: blocks of an f16 scale and 32 int8s (SmolLM2's and Gemma 3's embeddings)
Q8_0_BLOCK_BYTES = 34
Q8_0_VALUES = 32  # weights per block


@dataclass(frozen=True)
class QuantizedRows:
    """A [num_embeddings, embedding_dim] table as the file stores it: `raw` [V, bytes per row]."""

    raw: np.ndarray  # a view of the mapped file until `owned` copies it
    type_id: int  # the GGML quantization type
    embedding_dim: int
    dtype: torch.dtype  # what a lookup returns (the model's float dtype)

    @property
    def num_embeddings(self) -> int:
        return self.raw.shape[0]

    def owned(self) -> "QuantizedRows":
        """These rows copied out of the file: a view would keep the whole file mapped, and every page
        the load read resident with it."""
        return self if self.raw.flags.owndata else dataclasses.replace(self, raw=np.array(self.raw, copy=True))

    def rows(self, ids: np.ndarray) -> torch.Tensor:
        """The rows `ids` (any shape) -> [*ids.shape, embedding_dim]."""
        import gguf

        flat = np.asarray(ids, dtype=np.int64).reshape(-1)
        if self.type_id == Q8_0:  # a decode step's one row: gguf-py's generic path costs ~4x this
            values = q8_0_values(self.raw[flat])
        else:
            values = gguf.quants.dequantize(self.raw[flat], gguf.GGMLQuantizationType(self.type_id))
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(self.dtype).view(*np.shape(ids), -1)

    def dequantized(self) -> torch.Tensor:
        """The whole float table [V, embedding_dim] (what families that index it directly take)."""
        return self.rows(np.arange(self.num_embeddings))

    def all_finite(self) -> bool:
        """Whether every row decodes to finite values (a corrupted block has NaN or inf scales)."""
        for start in range(0, self.num_embeddings, FINITE_CHECK_ROWS):
            chunk = self.rows(np.arange(start, min(start + FINITE_CHECK_ROWS, self.num_embeddings)))
            if not bool(torch.isfinite(chunk).all()):
                return False
        return True


def q8_0_values(rows: np.ndarray) -> np.ndarray:
    """Q8_0 rows [n, bytes] -> float32 [n, 32 * blocks]: each f16 scale times its int8s, exact in
    float32 (an 11-bit by 8-bit product), so the bits are gguf-py's."""
    blocks = rows.reshape(rows.shape[0], -1, Q8_0_BLOCK_BYTES)
    scales = blocks[..., :2].copy().view(np.float16).astype(np.float32)  # [n, blocks, 1]
    return (scales * blocks[..., 2:].view(np.int8)).reshape(rows.shape[0], -1)


class HeadRows:
    """A tied model's embedding read from its output head's `q8s` blocks, which hold the file's Q8_0
    rows unchanged, so the rows are kept once, not twice (Gemma 3's 178 MB). The kernels' layout
    (kernels/interleaved.c, block_q8sx8): per group of 8 rows and 32 columns, the 8 rows' f16 scales,
    then the int8s with weight j of row r at (j / 4) * 32 + r * 4 + j % 4. A row is its scales times
    its int8s, the same exact product as the file's."""

    def __init__(self, head: nn.Module, dtype: torch.dtype):
        self.head, self.dtype = head, dtype
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        blocks = self.embedding_dim // Q8_0_VALUES
        # [groups, blocks, 16 bytes of scales + 256 of int8s]: a view of the head's buffer
        self._groups = head.blocks.numpy().reshape(-1, blocks, 2 * INTERLEAVED_ROWS + INTERLEAVED_ROWS * Q8_0_VALUES)

    def rows(self, ids: np.ndarray) -> torch.Tensor:
        flat = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(flat) == 1:  # a decode step's: slices, no fancy indexing
            return self._row(int(flat[0])).to(self.dtype).view(*np.shape(ids), -1)
        group, row = np.divmod(flat, INTERLEAVED_ROWS)
        picked = self._groups[group]  # [n, blocks, 272]
        n, blocks = len(flat), picked.shape[1]
        scales = picked[..., : 2 * INTERLEAVED_ROWS].copy().view(np.float16)[np.arange(n), :, row].astype(np.float32)
        values = picked[..., 2 * INTERLEAVED_ROWS :].view(np.int8).reshape(n, blocks, Q8_0_VALUES // 4, INTERLEAVED_ROWS, 4)
        values = values[np.arange(n), :, :, row].reshape(n, blocks, Q8_0_VALUES)  # [n, blocks, 32]: weight j at j
        rows = (scales[..., None] * values).reshape(n, -1)
        return torch.from_numpy(rows).to(self.dtype).view(*np.shape(ids), -1)

    def _row(self, token: int) -> torch.Tensor:
        group, row = divmod(token, INTERLEAVED_ROWS)
        picked = self._groups[group]  # [blocks, 272]
        scales = picked[:, : 2 * INTERLEAVED_ROWS].view(np.float16)[:, row].astype(np.float32)
        values = picked[:, 2 * INTERLEAVED_ROWS :].view(np.int8).reshape(-1, Q8_0_VALUES // 4, INTERLEAVED_ROWS, 4)[:, :, row]
        return torch.from_numpy((scales[:, None, None] * values).reshape(-1))

    def dequantized(self) -> torch.Tensor:
        return self.rows(np.arange(self.num_embeddings))


class EmbeddingRows(Protocol):
    num_embeddings: int
    embedding_dim: int
    dtype: torch.dtype

    def rows(self, ids: np.ndarray) -> torch.Tensor: ...

    def dequantized(self) -> torch.Tensor: ...


class QuantizedEmbedding(nn.Module):
    """Looks rows up in a quantized table (`QuantizedRows`, or a tied head's `HeadRows`):
    `embedding(ids)` as F.embedding does, `embedding[i]` and `embedding[ids]` as indexing a float
    table does."""

    def __init__(self, table: EmbeddingRows):
        super().__init__()
        self.table = table
        self.dtype = table.dtype
        self.num_embeddings, self.embedding_dim = table.num_embeddings, table.embedding_dim

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> [..., embedding_dim]; an id out of range is an IndexError, as F.embedding's."""
        array = ids.cpu().numpy()
        if array.size and not (0 <= array.min() and array.max() < self.num_embeddings):
            raise IndexError(f"token ids must be in [0, {self.num_embeddings}), got {array.min()}..{array.max()}")
        return self.table.rows(array)

    def __getitem__(self, index: int | Sequence[int] | torch.Tensor) -> torch.Tensor:
        if isinstance(index, int):
            return self(torch.tensor([index]))[0]
        return self(torch.as_tensor(index))

    def dequantized(self) -> torch.Tensor:
        return self.table.dequantized()

    def extra_repr(self) -> str:
        where = "the head's q8s blocks" if isinstance(self.table, HeadRows) else f"{self.table.raw.nbytes / 2**20:.1f} MiB of rows"
        return f"{self.num_embeddings}, {self.embedding_dim}, {where}"


def token_embedding(weight: torch.Tensor | QuantizedRows, head: nn.Module, tied: bool) -> nn.Parameter | QuantizedEmbedding:
    """A model's token embedding: a float table as it is; a quantized file's rows read from the
    head where a tied head holds them unchanged (Q8_0 as `q8s`), else copied out of the file."""
    if isinstance(weight, torch.Tensor):
        return nn.Parameter(weight, requires_grad=False)
    in_head = (tied and weight.type_id == Q8_0 and getattr(head, "kind", None) == "q8s"
               and (head.out_features, head.in_features) == (weight.num_embeddings, weight.embedding_dim))  # fmt: skip
    return QuantizedEmbedding(HeadRows(head, weight.dtype) if in_head else weight.owned())
