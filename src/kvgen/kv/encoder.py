"""EncoderCache: cross-attention keys and values, computed once per distinct encoder input.

In an encoder-decoder model (T5, Whisper, BART) every decoder layer's cross-attention reads K/V
projected from the encoder's output. They depend on the encoder input only, never on the decoder's
positions, so requests that share an input (the same audio, the same document) can share them
whatever they have decoded so far. Entries are keyed by a sha256 of the encoder states' bytes,
shape and dtype and of a model/adapter id (the same states through different projections are
different K/V). Requests hold references (`acquire` / `release`, or `with cache.acquire(...)`);
an entry nobody references stays for the next request until the byte budget needs its room, least
recently used first. An entry in use is never evicted, so the cache may exceed its budget while
more distinct inputs are in use than fit; it shrinks back as they are released.

The cache takes `compute`, which maps an encoder input to per-layer K/V: T5 (models/t5.py) passes
its encoder + cross-attention projections and keys entries by the input's token ids; a forked
request (several samples of one input) takes another reference to its entry (`share`).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]  # per decoder layer: K, V [B, H, S_enc, D]
ComputeKV = Callable[[torch.Tensor], LayerKV]


@dataclass
class EncoderEntry:
    key: str
    layers: LayerKV
    num_bytes: int
    refs: int = 0


class EncoderHandle:
    """One request's reference to an entry; `release()` (or leaving the `with`) gives it back once."""

    def __init__(self, cache: "EncoderCache", entry: EncoderEntry, hit: bool):
        self._cache, self.entry, self.hit, self._released = cache, entry, hit, False

    @property
    def layers(self) -> LayerKV:
        return self.entry.layers

    def share(self) -> "EncoderHandle":
        """Another reference to the same entry (a forked request), released on its own."""
        if self._released:
            raise ValueError("cannot share an encoder entry through a released handle")
        return self._cache._add_ref(self.entry)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._cache._release(self.entry.key)

    def __enter__(self) -> "EncoderHandle":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class EncoderCache:
    def __init__(self, compute: ComputeKV, model_id: str, budget_bytes: int):
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        self.compute, self.model_id, self.budget_bytes = compute, model_id, budget_bytes
        self._entries: OrderedDict[str, EncoderEntry] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.stats = {"hits": 0, "misses": 0, "evictions": 0}

    @staticmethod
    def key_for(encoder_states: torch.Tensor, model_id: str) -> str:
        states = encoder_states.detach().contiguous().cpu()
        digest = hashlib.sha256(f"{model_id}|{states.dtype}|{tuple(states.shape)}|".encode())
        digest.update(states.view(torch.uint8).numpy().tobytes() if states.numel() else b"")
        return digest.hexdigest()

    def acquire(self, encoder_states: torch.Tensor, namespace: str = "") -> EncoderHandle:
        """The K/V for these encoder states (computed on a miss), referenced until released.
        Requests under different namespaces (cache salts, tenants) never share an entry."""
        key = self.key_for(encoder_states, f"{self.model_id}|{namespace}" if namespace else self.model_id)
        with self._lock:
            entry = self._entries.get(key)
            hit = entry is not None
            if entry is None:
                layers = [(k.detach(), v.detach()) for k, v in self.compute(encoder_states)]  # a failure stores nothing
                num_bytes = sum(t.numel() * t.element_size() for kv in layers for t in kv)
                entry = self._entries[key] = EncoderEntry(key, layers, num_bytes)
            self._entries.move_to_end(key)
            entry.refs += 1
            self.stats["hits" if hit else "misses"] += 1
            self._evict()
            return EncoderHandle(self, entry, hit)

    def _add_ref(self, entry: EncoderEntry) -> EncoderHandle:
        with self._lock:
            entry.refs += 1
            return EncoderHandle(self, entry, hit=True)

    def _release(self, key: str) -> None:
        with self._lock:
            entry = self._entries[key]
            assert entry.refs > 0, f"entry {key[:12]} released more often than acquired"
            entry.refs -= 1
            self._evict()

    def _evict(self) -> None:
        """Drop unreferenced entries, least recently used first, until the budget holds."""
        for key in list(self._entries):
            if self.memory_bytes() <= self.budget_bytes:
                return
            if self._entries[key].refs == 0:
                del self._entries[key]
                self.stats["evictions"] += 1

    def __contains__(self, encoder_states: torch.Tensor) -> bool:
        return self.key_for(encoder_states, self.model_id) in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def memory_bytes(self) -> int:
        return sum(entry.num_bytes for entry in self._entries.values())

    def check_invariants(self) -> None:
        for key, entry in self._entries.items():
            assert entry.key == key and entry.refs >= 0, f"entry {key[:12]} inconsistent"
        unreferenced = sum(e.num_bytes for e in self._entries.values() if e.refs == 0)
        assert self.memory_bytes() <= self.budget_bytes or unreferenced == 0, "over budget with evictable entries"
