"""Token embeddings kept as a GGUF file's quantized rows.

A lookup reads a handful of rows a step, yet a float table of the whole vocabulary is what a
quantized model used to hold: Gemma 3's 262,144 x 640 is 671 MB in fp32 (its Q8_0 rows 178 MB),
Llama 3's 128,256 x 4,096 is 2.1 GB. `QuantizedRows` keeps a copy of the file's rows as they are
(178 MB for Gemma 3) and dequantizes only the rows a lookup reads, with gguf-py's dequantization, which works block by block: a row gets the bits it had in the
float table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import nn

FINITE_CHECK_ROWS = 16384  # rows dequantized at a time by the load-time check (a bounded buffer)
Q8_0 = 8  # GGML's type id: blocks of an f16 scale and 32 int8s (SmolLM2's and Gemma 3's embeddings)
Q8_0_BLOCK_BYTES = 34


@dataclass(frozen=True)
class QuantizedRows:
    """A [num_embeddings, embedding_dim] table as the file stores it: `raw` [V, bytes per row]."""

    raw: np.ndarray  # owned, not a view of the file: the file's mapping goes once the load is done
    type_id: int  # the GGML quantization type
    embedding_dim: int
    dtype: torch.dtype  # what a lookup returns (the model's float dtype)

    @property
    def num_embeddings(self) -> int:
        return self.raw.shape[0]

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


class QuantizedEmbedding(nn.Module):
    """Looks rows up in `QuantizedRows`: `embedding(ids)` as F.embedding does, `embedding[i]` and
    `embedding[ids]` as indexing a float table does."""

    def __init__(self, table: QuantizedRows):
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
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.table.raw.nbytes / 2**20:.1f} MiB quantized rows"
