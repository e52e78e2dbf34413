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

from kvgen.kernels.formats import QK, X8_GROUP_BYTES
from kvgen.models.half_linear import row_major
from kvgen.models.quantized_linear import INTERLEAVED_ROWS

FINITE_CHECK_ROWS = 16384  # rows dequantized at a time by the load-time check (a bounded buffer)
Q8_0 = 8  # GGML's type id: blocks of an f16 scale and 32 int8s (SmolLM2's and Gemma 3's embeddings)
F16, BF16 = 1, 30  # GGML's type ids of 16-bit float rows
SCALE_BYTES = 2 * INTERLEAVED_ROWS  # a q8s group block's 8 f16 scales, before its int8s
Q8SX8_BLOCK_BYTES = X8_GROUP_BYTES["q8s"]  # 8 rows x 32 weights: the scales, then 256 int8s


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


class HeadRows:
    """A tied model's embedding read from its output head's `q8s` blocks, which hold the file's Q8_0
    rows unchanged, so the rows are kept once, not twice (Gemma 3's 178 MB). The kernels' layout
    (kernels/interleaved.c, block_q8sx8): per group of 8 rows and 32 columns, the 8 rows' f16 scales,
    then the int8s with weight j of row r at (j / 4) * 32 + r * 4 + j % 4. A row is its scales times
    its int8s, the same exact product as the file's."""

    def __init__(self, head: nn.Module, dtype: torch.dtype):
        self.head, self.dtype = head, dtype
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        blocks = self.embedding_dim // QK
        self._group_bytes = blocks * Q8SX8_BLOCK_BYTES  # 8 rows, every block
        flat = head.blocks.numpy()  # a view of the head's buffer
        self._int8s, self._f16s = flat.view(np.int8), flat.view(np.float16)
        # Where row r of a group keeps its int8s (weight j of block b) and its scales (block b), from
        # the group's start, in bytes and in f16 words: one gather per lookup, whatever the row.
        block, weight = np.divmod(np.arange(self.embedding_dim), QK)
        rows = np.arange(INTERLEAVED_ROWS)[:, None]
        self._int8_at = block * Q8SX8_BLOCK_BYTES + SCALE_BYTES + (weight // 4) * 32 + rows * 4 + weight % 4  # [8, H]
        self._scale_at = np.arange(blocks) * (Q8SX8_BLOCK_BYTES // 2) + rows  # [8, blocks]

    def rows(self, ids: np.ndarray) -> torch.Tensor:
        group, row = np.divmod(np.asarray(ids, dtype=np.int64).reshape(-1, 1), INTERLEAVED_ROWS)  # [n, 1]
        start = group * self._group_bytes
        values = self._int8s.take(start + self._int8_at[row[:, 0]]).reshape(len(start), -1, QK)  # [n, blocks, 32]
        scales = self._f16s.take(start // 2 + self._scale_at[row[:, 0]]).astype(np.float32)  # [n, blocks]
        rows = (scales[..., None] * values).reshape(len(start), -1)
        return torch.from_numpy(rows).to(self.dtype).view(*np.shape(ids), -1)

    def dequantized(self) -> torch.Tensor:
        return self.rows(np.arange(self.num_embeddings))


class HalfRows:
    """A table of float16 / bfloat16 rows (a 16bit model's embedding, or its tied head's weight),
    each row widened to `dtype` as it is looked up: exact, at half an fp32 table's memory. A BF16
    head keeps its rows pair-interleaved (models/half_linear.py); `pair_interleaved` reads them so."""

    def __init__(self, table: torch.Tensor, dtype: torch.dtype, pair_interleaved: bool = False):
        self.table, self.dtype, self.pair_interleaved = table, dtype, pair_interleaved
        self.num_embeddings, self.embedding_dim = table.shape

    def rows(self, ids: np.ndarray) -> torch.Tensor:
        flat = torch.from_numpy(np.asarray(ids, dtype=np.int64).reshape(-1))
        rows = self.table.index_select(0, flat)
        return (row_major(rows) if self.pair_interleaved else rows).to(self.dtype).view(*np.shape(ids), -1)

    def dequantized(self) -> torch.Tensor:
        return (row_major(self.table) if self.pair_interleaved else self.table).to(self.dtype)


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
        if isinstance(self.table, HeadRows):
            where = "the head's q8s blocks"
        elif isinstance(self.table, HalfRows):
            where = f"{self.table.table.dtype} rows"
        else:
            where = f"{self.table.raw.nbytes / 2**20:.1f} MiB of rows"
        return f"{self.num_embeddings}, {self.embedding_dim}, {where}"

