"""Block files and the disk block store, without a model: round trip, checksum, truncation,
identity, the directory lock, the LRU budget across a restart, and PagedStorage export/import."""

from __future__ import annotations

import os

import pytest
import torch

from kvgen.kv.block_file import BlockFileError, read_block_file, read_header, write_block_file
from kvgen.kv.block_pool import BlockPool
from kvgen.kv.disk_store import DiskBlockStore
from kvgen.kv.interface import CacheSpec
from kvgen.kv.paged import PagedStorage

IDENTITY = {"model": "m" * 64, "weights": "fp32", "format": "fp32/fp32/bs4", "block_size": "4"}


def storage(num_blocks: int = 6, dtype: torch.dtype = torch.float32) -> PagedStorage:
    store = PagedStorage(CacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype), BlockPool(num_blocks, 4))
    torch.manual_seed(0)
    store.keys.copy_(torch.randn(store.keys.shape))
    store.values.copy_(torch.randn(store.values.shape))
    return store


def test_storage_export_import_round_trip() -> None:
    source, target = storage(), storage()
    target.keys.zero_()
    target.values.zero_()
    assert source.format_key == "fp32/fp32/bs4"
    assert storage(dtype=torch.bfloat16).format_key == "bf16/bf16/bs4"
    parts = source.export_block(2)
    assert parts["keys"].shape == (3, 2, 4, 8)  # [L, H, bs, D]
    source.keys[:, 2] = 0  # an export is a copy
    target.import_block(5, parts)
    assert torch.equal(target.keys[:, 5], parts["keys"]) and torch.equal(target.values[:, 5], parts["values"])
    assert not target.keys[:, :5].any()
    with pytest.raises(ValueError, match="holds tensors"):
        target.import_block(1, {"keys": parts["keys"]})
    with pytest.raises(ValueError, match="must be"):
        target.import_block(1, {"keys": parts["keys"][:2], "values": parts["values"]})
    with pytest.raises(ValueError, match="must be"):
        target.import_block(1, {"keys": parts["keys"].half(), "values": parts["values"]})
    assert not target.keys[:, 1].any()  # a rejected import writes nothing


def test_block_file_round_trip_and_checks(tmp_path) -> None:
    parts = storage().export_block(1)
    path = tmp_path / "a.kvblock"
    size = write_block_file(path, parts, {**IDENTITY, "tokens": "1,2,3,4"})
    assert size == path.stat().st_size and not list(tmp_path.glob("*.partial"))
    assert read_header(path)["tokens"] == "1,2,3,4"
    back, read_size = read_block_file(path, IDENTITY)
    assert read_size == size and all(torch.equal(back[n], parts[n]) for n in parts)
    with pytest.raises(BlockFileError, match="is for") as other:
        read_block_file(path, {**IDENTITY, "model": "x" * 64})
    assert other.value.mismatch

    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # a flipped payload byte: the header is fine, the checksum is not
    path.write_bytes(bytes(data))
    read_header(path)
    with pytest.raises(BlockFileError, match="sha256") as flipped:
        read_block_file(path, IDENTITY)
    assert not flipped.value.mismatch
    path.write_bytes(bytes(data[:-100]))
    with pytest.raises(BlockFileError, match="truncated"):
        read_header(path)
    path.write_bytes(b"not a block")
    with pytest.raises(BlockFileError):
        read_header(path)


def test_store_lock_budget_and_lru_across_restart(tmp_path, caplog) -> None:
    blocks = storage()
    size = write_block_file(tmp_path / "probe", blocks.export_block(0), {**IDENTITY, "tokens": "0"})
    os.remove(tmp_path / "probe")
    store = DiskBlockStore(tmp_path, budget_bytes=3 * size, identity=IDENTITY)
    with pytest.raises(ValueError, match="in use by another kvgen engine"):
        DiskBlockStore(tmp_path, 3 * size, IDENTITY)
    for i in range(3):
        assert store.put(f"k{i}", blocks.export_block(i), {"tokens": str(i)})
    assert store.get("k0", {"tokens": "0"}) is not None  # k0 is now the most recently used
    assert store.put("k3", blocks.export_block(3), {"tokens": "3"})
    assert list(store.entries) == ["k2", "k0", "k3"] and store.stats.files_evicted == 1  # k1 went
    assert store.bytes_used <= 3 * size and not store.path("k1").exists()
    assert store.get("k0", {"tokens": "1"}) is None  # wrong tokens for its key: not served, deleted
    assert not store.path("k0").exists() and store.stats.damaged_files == 1
    store.close()

    os.utime(store.path("k3"), ns=(1, 1))  # now the oldest use
    (tmp_path / "junk.kvblock").write_bytes(b"garbage")
    write_block_file(tmp_path / "other.kvblock", blocks.export_block(4), {**IDENTITY, "format": "int8/int4/bs4"})
    with caplog.at_level("WARNING", logger="kvgen.kv.disk"):
        again = DiskBlockStore(tmp_path, 3 * size, IDENTITY)
    assert list(again.entries) == ["k3", "k2"]
    assert again.stats.damaged_files == 1 and again.stats.mismatched_files == 1
    assert not (tmp_path / "junk.kvblock").exists() and (tmp_path / "other.kvblock").exists()
    assert "another model/format" in caplog.text and "damaged" in caplog.text
    again.close()


def test_unwritable_directory_is_refused(tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not writable"):
        DiskBlockStore(tmp_path / "file" / "cache", 1 << 20, IDENTITY)


def test_reading_a_path_stops_at_its_first_missing_or_damaged_block(tmp_path) -> None:
    blocks = storage()
    store = DiskBlockStore(tmp_path, 1 << 30, IDENTITY)
    for i in range(6):
        store.put(f"k{i}", blocks.export_block(i), {"tokens": str(i)})
    path = [(f"k{i}", {"tokens": str(i)}) for i in range(6)]
    read = list(store.get_path(path))
    assert len(read) == 6 and all(torch.equal(p["keys"], blocks.keys[:, i]) for i, p in enumerate(read))
    store.discard("k2")
    assert len(list(store.get_path(path))) == 2  # k3.. are not read past the gap
    data = bytearray(store.path("k1").read_bytes())
    data[-1] ^= 1
    store.path("k1").write_bytes(bytes(data))
    assert len(list(store.get_path(path))) == 1 and store.stats.damaged_files == 1 and "k1" not in store
    store.close()
