"""HybridStateCache: a hybrid model's per-sequence memory (Granite 4.0-H: Mamba-2 layers beside
attention layers). The Mamba layers' conv and recurrent states, with checkpoints, are this
SSMStateCache itself; the attention layers' keys and values are `kv`, a ContiguousCache over those
layers only (the model numbers its attention layers 0, 1, ... for it).

The two move together: a forward pass writes the states and updates `kv`, and `commit` takes both;
`truncate` goes only to a length whose recurrent state is held (a checkpoint or the current length,
as SSMStateCache's) and cuts `kv` to the same length, so a session resuming inside a shared prefix
recomputes the same tokens for both kinds of layer. The engine's prefix cache starts one from a
snapshot of the states and the keys and values of the positions before it (`restore`), which it
keeps block by block (`kv_block`, kv/state_prefix.py).
"""

from __future__ import annotations

import torch

from kvgen.kv.contiguous import ContiguousCache
from kvgen.kv.ssm import SSMSpec, SSMStateCache, States


class HybridStateCache(SSMStateCache):
    def __init__(self, spec: SSMSpec, kv: ContiguousCache, checkpoint_every: int = 64, max_checkpoints: int = 32):
        super().__init__(spec, checkpoint_every, max_checkpoints)
        self.kv = kv

    def commit(self, num_tokens: int, snapshots: dict[int, States] | None = None) -> None:
        super().commit(num_tokens, snapshots)
        self.kv.commit(num_tokens)

    def truncate(self, num_tokens: int) -> None:
        super().truncate(num_tokens)  # refuses a length whose state is not held, before kv changes
        self.kv.truncate(num_tokens)

    def restore(self, length: int, states: States, kv_blocks: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """Start an empty cache from a snapshot of the states after `length` tokens and the keys and
        values of those positions, in blocks ([attention layers, 1, H, n, D] each, in order)."""
        if kv_blocks is None or sum(keys.shape[3] for keys, _ in kv_blocks) != length:
            raise ValueError(f"a hybrid cache starts from its states and the keys and values of all {length} positions "
                             "before them; a state snapshot alone cannot start it")  # fmt: skip
        if self.kv.seq_len != 0:
            raise ValueError(f"restore needs an empty cache; this one holds {self.kv.seq_len} positions of keys")
        super().restore(length, states)
        if length:
            keys, values = (torch.cat(parts, dim=3) for parts in zip(*kv_blocks))
            for layer in range(self.kv.spec.num_layers):
                self.kv.update(layer, keys[layer], values[layer])
            self.kv.commit(length)

    def kv_block(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the attention layers' keys and values at positions start..end-1 (what the
        engine's prefix cache keeps of a block)."""
        return self.kv.copy_positions(start, end)

    def fork(self) -> "HybridStateCache":
        twin = HybridStateCache(self.spec, self.kv.fork(), self.checkpoint_every, self.max_checkpoints)  # type: ignore[arg-type]
        twin._states = [(c.clone(), r.clone()) for c, r in self._states]
        twin._checkpoints, twin._seq_len, twin._handed_over = dict(self._checkpoints), self._seq_len, self._handed_over
        return twin

    def memory_bytes(self) -> int:
        return super().memory_bytes() + self.kv.memory_bytes()

    def check_invariants(self) -> None:
        super().check_invariants()
        assert self.kv.seq_len == self.seq_len, f"keys and values for {self.kv.seq_len} tokens, states for {self.seq_len}"
