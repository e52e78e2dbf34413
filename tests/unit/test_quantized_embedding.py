"""A quantized GGUF's token embedding stays the file's rows (models/embedding.py): a lookup gives
the bits the float table made from the file held, the model never holds that table, and a
corrupted table is still caught at load (tied: through its head; untied: by a scan)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kvgen import LLM, ModelLoadError
from kvgen.loading.gguf_file import GGUFFile
from kvgen.models.embedding import HeadRows, QuantizedEmbedding, QuantizedRows
from tests.support.models import model_path
from tests.support.tiny_gguf import write_gguf_from_hf, write_tiny_gguf
from tests.support.tiny_hf import save_tiny_decoder, tokenizer_folder

Q = gguf.GGMLQuantizationType


def test_default_weights_look_up_the_float_tables_bits(smollm2, smollm2_q4) -> None:
    table = smollm2_q4.model.embed_tokens
    assert isinstance(table, QuantizedEmbedding) and isinstance(smollm2.model.embed_tokens, torch.nn.Parameter)
    every_row = table(torch.arange(table.num_embeddings))
    assert torch.equal(every_row, smollm2.model.embed_tokens.data)  # the fp32 load's table, from gguf-py
    ids = torch.tensor([[5, 49151, 0], [17, 17, 3]])
    assert torch.equal(table(ids), smollm2.model.embed_tokens.data[ids])
    assert torch.equal(table[49151], every_row[49151]) and torch.equal(table[[3, 4]], every_row[3:5])
    assert torch.equal(smollm2_q4.model.embedding_table(), every_row)
    with pytest.raises(IndexError, match=r"token ids must be in \[0, 49152\)"):
        table(torch.tensor([49152]))


def test_a_tied_q8_0_table_is_read_from_its_head_and_held_once(smollm2_q4) -> None:
    table = smollm2_q4.model.embed_tokens
    assert not list(table.parameters()) and not list(table.buffers())
    assert isinstance(table.table, HeadRows) and table.table.head is smollm2_q4.model.lm_head  # no copy of its own
    # Every row of the last group too (49,152 rows: six full groups of 8 at the end).
    ids = torch.arange(49152 - 16, 49152)
    assert torch.equal(table(ids), QuantizedEmbedding(_file_rows()).forward(ids))


def _file_rows() -> QuantizedRows:
    file = GGUFFile(model_path("smollm2"))
    info = file.tensors["token_embd.weight"]
    return QuantizedRows(np.array(file.raw(info)), info.type_id, int(info.shape[-1]), torch.float32)


@pytest.mark.parametrize("embedding_type", [Q.Q8_0, Q.Q4_1, Q.F16, Q.BF16])
def test_an_untied_quantized_embedding_gives_the_fp32_loads_rows_and_tokens(embedding_type, tmp_path: Path) -> None:
    model = save_tiny_decoder("qwen3", tmp_path / "hf", tokenizer_folder(tmp_path / "tokenizer"))
    path = write_gguf_from_hf(tmp_path / "m.gguf", model, model_path("smollm2"), Q.Q8_0, embedding_type=embedding_type)
    exact, quantized = LLM.load(path, progress=False, weights="fp32"), LLM.load(path, progress=False)
    assert isinstance(quantized.model.embed_tokens, QuantizedEmbedding)
    assert "output.weight" in GGUFFile(path).tensors  # untied: its own head
    assert quantized.model.embed_tokens.table.raw.flags.owndata  # copied: a view would keep the whole file mapped
    assert torch.equal(quantized.model.embedding_table(), exact.model.embed_tokens.data)
    ids = torch.tensor([quantized.tokenizer.encode("The cat sat on the mat")])
    assert torch.equal(quantized.model._embed(ids), exact.model._embed(ids))  # what every forward starts from


def _corrupt_first_scale(path: Path, tensor: str) -> None:
    info = GGUFFile(path).tensors[tensor]
    data = bytearray(path.read_bytes())
    data[info.offset : info.offset + 2] = np.array([np.inf], dtype=np.float16).tobytes()
    path.write_bytes(bytes(data))


def test_a_corrupted_tied_embedding_is_caught_through_its_head(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", weight_type=Q.Q8_0)
    _corrupt_first_scale(path, "token_embd.weight")
    with pytest.raises(ModelLoadError, match=r"'token_embd.weight'.*NaN or infinite"):
        LLM.load(path, progress=False, weights="q4")


def test_a_corrupted_untied_embedding_is_caught_by_its_scan(tmp_path: Path) -> None:
    model = save_tiny_decoder("qwen3", tmp_path / "hf", tokenizer_folder(tmp_path / "tokenizer"))
    path = write_gguf_from_hf(tmp_path / "m.gguf", model, model_path("smollm2"), Q.Q8_0, embedding_type=Q.Q8_0)
    _corrupt_first_scale(path, "token_embd.weight")
    with pytest.raises(ModelLoadError, match=r"'token_embd.weight'.*NaN or infinite.*corrupted"):
        LLM.load(path, progress=False)
