"""SSMStateCache: per-layer conv state + recurrent state of Mamba-style layers, with checkpoints.

A state-space layer carries a fixed-size state instead of keys and values: the last few inputs of
its causal convolution (conv state [B, C, K]) and the recurrent state [B, C, N]. The state after
token t summarizes tokens 0..t and cannot be rewound, so the cache keeps *checkpoints*: snapshots
of every layer's state at chosen lengths, taken automatically once `checkpoint_every` tokens have
passed since the last one (at a commit, so at the length the forward pass ended on) and on demand
(`checkpoint()`). The empty state (length 0) is always available.

A request sharing a prefix of length p with an earlier one resumes from `resume_point(p)` (the
latest checkpoint <= p) and recomputes only the rest. `truncate(n)` is exact, and allowed only to
the current length or a checkpoint; it drops the checkpoints past n.

Like the KV contract, a forward pass writes each layer's new state (`write`) and the cache takes
them all at `commit`, so a pass that fails half-way leaves the cache as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SSMSpec:
    num_layers: int
    conv_shape: tuple[int, ...]  # one layer's conv state, e.g. (B, channels, kernel)
    state_shape: tuple[int, ...]  # one layer's recurrent state, e.g. (B, channels, state_size)
    dtype: torch.dtype = torch.float32

    @property
    def bytes_per_snapshot(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * (torch.Size(self.conv_shape).numel() + torch.Size(self.state_shape).numel()) * element


class DeferredState(Protocol):
    """A recurrent state a pass did not write out, built on demand: a verify writes only its last
    position's (a state is megabytes) and keeps what rebuilds the others (models/mamba_decode.py's Replay)."""

    def materialize(self) -> torch.Tensor: ...


States = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: conv, recurrent (a kept position's: maybe a DeferredState)


def materialized(states: States) -> States:
    """The states with any deferred recurrent state built."""
    return [(conv, recurrent if isinstance(recurrent, torch.Tensor) else recurrent.materialize()) for conv, recurrent in states]


class SSMStateCache:
    positions_removed = False  # what a stream asks a KV cache: the state never drops single positions

    def __init__(self, spec: SSMSpec, checkpoint_every: int = 64, max_checkpoints: int = 32):
        if checkpoint_every <= 0 or max_checkpoints <= 0:
            raise ValueError(f"checkpoint_every and max_checkpoints must be positive, got {checkpoint_every}, {max_checkpoints}")
        self.spec, self.checkpoint_every, self.max_checkpoints = spec, checkpoint_every, max_checkpoints
        self._states: States = self._zeros()
        self._staged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # written by the pass in flight
        self._checkpoints: dict[int, States] = {}  # length -> snapshot (never modified once taken)
        self._seq_len = 0
        self._handed_over = 0  # the latest checkpoint length given away by take_checkpoints (cadence)
        # A speculative verify sets keep_positions: its pass keeps the state after every position
        # (_positions, apart from the checkpoints, which it neither adds to nor evicts), so the
        # rejected drafts roll back by truncate; the next commit or truncate drops them.
        self.keep_positions = False
        self._positions: dict[int, States] = {}

    def _zeros(self) -> States:
        return [(torch.zeros(self.spec.conv_shape, dtype=self.spec.dtype), torch.zeros(self.spec.state_shape, dtype=self.spec.dtype))
                for _ in range(self.spec.num_layers)]  # fmt: skip

    @property
    def seq_len(self) -> int:
        return self._seq_len

    @property
    def checkpoints(self) -> list[int]:
        """Lengths that can be resumed from, ascending (0, the empty state, always)."""
        return [0, *sorted(length for length in self._checkpoints if length)]

    def conv_state(self, layer: int) -> torch.Tensor:
        return self._states[layer][0]

    def recurrent_state(self, layer: int) -> torch.Tensor:
        return self._states[layer][1]

    def write(self, layer: int, conv: torch.Tensor, recurrent: torch.Tensor, owned: bool = False) -> None:
        """The state of `layer` after the tokens of the pass in flight (taken at `commit`). owned:
        the caller hands over tensors of the cache's dtype that nothing else holds, kept as they are
        (a C decode step's fresh outputs: a Mamba-2-130M state is 19 MB a token to copy)."""
        if conv.shape != self.spec.conv_shape or recurrent.shape != self.spec.state_shape:
            raise ValueError(
                f"layer {layer} state shapes {tuple(conv.shape)}, {tuple(recurrent.shape)} do not match the cache's "
                f"{self.spec.conv_shape}, {self.spec.state_shape}"
            )
        if owned and conv.dtype == recurrent.dtype == self.spec.dtype:
            self._staged[layer] = (conv.detach(), recurrent.detach())
        else:
            self._staged[layer] = (conv.detach().to(self.spec.dtype, copy=True), recurrent.detach().to(self.spec.dtype, copy=True))

    def commit(self, num_tokens: int, snapshots: dict[int, States] | None = None) -> None:
        """Take the written states as the state after `num_tokens` more tokens. `snapshots`: every
        layer's state after the first k tokens of this pass, for k < num_tokens, kept as checkpoints
        at seq_len + k (a model captures them during a long prefill)."""
        missing = [layer for layer in range(self.spec.num_layers) if layer not in self._staged]
        if missing:
            raise ValueError(f"commit after a pass that wrote no state for layers {missing}: write every layer first")
        self._settle_positions()
        kept = self._positions if self.keep_positions else self._checkpoints
        for offset, states in sorted((snapshots or {}).items()):
            if not 0 < offset < num_tokens or len(states) != self.spec.num_layers:
                raise ValueError(f"a snapshot after {offset} of {num_tokens} tokens with {len(states)} layers cannot be kept")
            if not self.keep_positions:  # a checkpoint holds tensors
                states = materialized(states)
            kept[self._seq_len + offset] = [(self._own(c), self._own(r)) for c, r in states]
        self._states = [self._staged[layer] for layer in range(self.spec.num_layers)]
        self._staged = {}
        self._seq_len += num_tokens
        while len(self._checkpoints) > self.max_checkpoints:
            del self._checkpoints[min(self._checkpoints)]
        if not self.keep_positions and self._due():  # a kept pass checkpoints once it is settled
            self.checkpoint()

    def _own(self, state: "torch.Tensor | DeferredState") -> "torch.Tensor | DeferredState":
        return state.detach().to(self.spec.dtype) if isinstance(state, torch.Tensor) else state

    def _due(self, length: int | None = None) -> bool:
        """Whether the cadence takes a checkpoint at `length` (None: seq_len)."""
        length = self._seq_len if length is None else length
        return length - max(self.checkpoints[-1], self._handed_over) >= self.checkpoint_every

    def _settle_positions(self) -> None:
        """Take from a keep_positions pass's states, now that truncate (or the next commit) has
        settled how many of its tokens stay, the checkpoints one-token commits would have taken at
        those positions and at seq_len; drop the rest."""
        if not self._positions:  # every commit comes here: most hold none
            return
        held, self._positions = self._positions, {}
        for length in sorted(p for p in held if p < self._seq_len):
            if self._due(length):
                self._checkpoints[length] = materialized(held[length])
        if self._due():
            self.checkpoint()
        while len(self._checkpoints) > self.max_checkpoints:
            del self._checkpoints[min(self._checkpoints)]

    def checkpoint(self) -> None:
        """Snapshot the current state at seq_len (the oldest snapshot goes past max_checkpoints)."""
        if self._seq_len == 0:
            return
        self._checkpoints[self._seq_len] = [(conv.clone(), rec.clone()) for conv, rec in self._states]
        while len(self._checkpoints) > self.max_checkpoints:
            del self._checkpoints[min(self._checkpoints)]

    def resume_point(self, num_tokens: int) -> int:
        """The latest length <= num_tokens whose state is held (a checkpoint, the current length, or 0)."""
        if num_tokens >= self._seq_len:
            return self._seq_len
        return max(length for length in self.checkpoints if length <= num_tokens)

    def truncate(self, num_tokens: int) -> None:
        """Back to the state after `num_tokens`: a checkpoint's, or one the last pass kept under
        keep_positions (a speculative verify's rejected drafts)."""
        if not 0 <= num_tokens <= self._seq_len:
            raise ValueError(f"cannot truncate to {num_tokens}: the cache holds {self._seq_len} tokens")
        point = num_tokens if num_tokens in self._positions else self.resume_point(num_tokens)
        if point != num_tokens:
            raise ValueError(
                f"cannot truncate a recurrent state to {num_tokens}: the nearest checkpoint is {point}; "
                f"truncate to {point} (resume_point) and recompute the tokens after it"
            )
        if num_tokens in self._positions and num_tokens < self._seq_len:
            # a verify's own states (nothing modifies a state in place: the next step writes new ones)
            self._states = self._positions[num_tokens] = materialized(self._positions[num_tokens])
        elif num_tokens < self._seq_len:
            snapshot = self._checkpoints.get(num_tokens)
            self._states = [(c.clone(), r.clone()) for c, r in snapshot] if snapshot else self._zeros()
        self._checkpoints = {length: s for length, s in self._checkpoints.items() if length <= num_tokens}
        self._staged, self._seq_len = {}, num_tokens
        self._handed_over = min(self._handed_over, num_tokens)
        self._settle_positions()

    def take_checkpoints(self) -> dict[int, States]:
        """Hand the checkpoints over (length -> snapshot) and keep none: the engine's prefix index
        holds them instead, so a request's own memory stays one live state. Later checkpoints keep
        the cadence, counted from the latest one handed over."""
        taken, self._checkpoints = self._checkpoints, {}
        if taken:
            self._handed_over = max(self._handed_over, max(taken))
        return taken

    def restore(self, length: int, states: States) -> None:
        """Start an empty cache from a snapshot of the state after `length` tokens (copied: snapshots
        are shared and never modified)."""
        if self._seq_len != 0:
            raise ValueError(f"restore needs an empty cache; this one holds {self._seq_len} tokens")
        if len(states) != self.spec.num_layers:
            raise ValueError(f"a snapshot of {len(states)} layers cannot start a cache of {self.spec.num_layers}")
        self._states = [(c.clone(), r.clone()) for c, r in states]
        self._seq_len = self._handed_over = length

    def resume(self, shared_tokens: int) -> int:
        """Rewind to the latest state within the first `shared_tokens`; returns the length to recompute from."""
        point = self.resume_point(shared_tokens)
        self.truncate(point)
        return point

    def reset(self) -> None:
        self.truncate(0)

    def release(self) -> None:
        self.reset()

    def fork(self) -> "SSMStateCache":
        """Checkpoints are never modified, so the twin shares them; the live state is copied."""
        twin = SSMStateCache(self.spec, self.checkpoint_every, self.max_checkpoints)
        twin._states = [(c.clone(), r.clone()) for c, r in self._states]
        twin._checkpoints, twin._seq_len, twin._handed_over = dict(self._checkpoints), self._seq_len, self._handed_over
        return twin

    def memory_bytes(self) -> int:
        held = 1 + len(self._checkpoints) + len(self._positions) + (1 if self._staged else 0)
        return held * self.spec.bytes_per_snapshot

    def check_invariants(self) -> None:
        assert self._seq_len >= 0
        assert all(0 < length <= self._seq_len for length in self._checkpoints), "checkpoint past seq_len"
        assert len(self._checkpoints) <= self.max_checkpoints, "too many checkpoints"
        for conv, rec in self._states:
            assert conv.shape == self.spec.conv_shape and rec.shape == self.spec.state_shape, "state shape"
