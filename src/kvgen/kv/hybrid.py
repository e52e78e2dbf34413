"""HybridStateCache: a hybrid model's per-sequence memory (Granite 4.0-H: Mamba-2 layers beside
attention layers). The Mamba layers' conv and recurrent states, with checkpoints, are this
SSMStateCache itself; the attention layers' keys and values are `kv`, a ContiguousCache over those
layers only (the model numbers its attention layers 0, 1, ... for it).

The two move together: a forward pass writes the states and updates `kv`, and `commit` takes both;
`truncate` goes only to a length whose recurrent state is held (a checkpoint or the current length,
as SSMStateCache's) and cuts `kv` to the same length, so a session resuming inside a shared prefix
recomputes the same tokens for both kinds of layer.
"""

from __future__ import annotations

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

    def restore(self, length: int, states: States) -> None:
        raise NotImplementedError("a hybrid's state snapshot holds no keys and values: it cannot start a cache")

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
