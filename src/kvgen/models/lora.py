"""LoRA deltas added to the base linears' outputs, for a batch whose rows use different adapters.

Nothing is merged into the base weights, so one model serves every adapter and the base model at
once. Per (layer, fused linear) every loaded adapter's A and B are stacked, one slot per adapter,
zero-padded to the widest rank; the fused linears (q|k|v, gate|up) hold their projections' ranks
side by side, each B block writing only its own output columns. Scaling (alpha / r, or alpha /
sqrt(r) with rsLoRA) is folded into B.

A forward gets each row's adapter (or none). Prompt tokens are grouped by adapter once per
forward (Punica / S-LoRA's segmented gather): per adapter used in the batch, its tokens' rows meet
its A and B in two GEMMs and the deltas are added to those rows only, so rows without an adapter
keep exactly the base output. The work grows with the adapter tokens, and there is no Python per
row.

On quantized weights decodes, verifies and prompts add the same deltas inside the C steps instead
(kernels/lora_delta.c, described by models/fast_decode.py from `stacks` and `ranks`), each row from
its own slot in one sum order, so a prompt row's delta does not depend on its chunk; the GEMMs here
(the torch path: fp32 weights, caches the C step does not take) round by the row count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

def with_delta(stacks: "LoraStacks | None", layer: int, fused: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y, the output of layer `layer`'s `fused` linear for inputs x, plus the active rows' LoRA deltas
    (y itself where no adapters are loaded)."""
    return y if stacks is None else stacks.add_delta(layer, fused, x, y)


def adapter_slots(stacks: "LoraStacks | None", adapters: Sequence[str | None]) -> list[int]:
    """Each row's adapter slot in `stacks` (-1: the base model); ValueError naming the first adapter
    that is not loaded."""
    unknown = [a for a in adapters if a is not None and (stacks is None or a not in stacks.slots)]
    if unknown:
        raise ValueError(f"adapter {unknown[0]!r} is not loaded on this model: load it first (LLM.load_adapter)")
    return [-1] * len(adapters) if stacks is None else stacks.slots_of(adapters)


def refuse_adapters(architecture: str, adapters: Sequence[str | None] | None) -> None:
    """Models LoRA does not reach (Mamba, Mamba-2, T5) take the adapter arguments of the forward
    contract and refuse any adapter (the registry refuses to load one for them already)."""
    if adapters is not None and any(a is not None for a in adapters):
        raise ValueError(f"LoRA adapters are not supported for {architecture} models: leave adapter unset")


# Fused linear -> the projections it holds, in output order (models/layers.py fuses them so). A
# hybrid's state layers add their mixer's in_proj and out_proj (Mamba-2's or LFM2's short conv's).
FUSED_MODULES: dict[str, tuple[str, ...]] = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",),
                                             "mixer_in": ("mixer_in",), "mixer_out": ("mixer_out",)}  # fmt: skip
MODULE_OF = {proj: fused for fused, projs in FUSED_MODULES.items() for proj in projs}

# (layer, projection) -> (A [r, in], B [out, r] with the scaling folded in)
LoraWeights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
# (layer, fused linear, x [..., in], y [..., out], slot) -> y plus slot's delta for every row
RowDelta = Callable[[int, str, torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass
class _Active:
    """One forward's rows: the used slots and the tokens that take each."""

    used: list[int]  # slot numbers
    token_rows: list[torch.Tensor]  # per used slot: the flat indices [n] int64 of its tokens
    all_same: bool  # every token takes used[0]
    decode: tuple[torch.Tensor, torch.Tensor] | None  # one-token rows: (slot per row clamped to >= 0, [N, 1] 0/1 has-adapter)
    exact: "RowDelta | None" = None  # one sequence's rows: the C steps' delta, the same bits however many rows


class LoraStacks:
    """Every loaded adapter's weights, stacked per (layer, fused linear); `activate` chooses each
    row's adapter for one forward, `add_delta` adds it to a linear's output."""

    def __init__(self, out_sizes: dict[str, tuple[int, ...]]):
        self.out_sizes = out_sizes  # fused linear -> its projections' output sizes
        self.slots: dict[str, int] = {}  # adapter key -> slot
        self.stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}  # A [n, R, in], B [n, R, out]
        # Per stack, each slot's rank per projection ([n, parts] int32, the parts' rank rows side by
        # side from 0): the C decode steps skip the zero padding with it (kernels/lora_delta.c).
        self.ranks: dict[tuple[int, str], torch.Tensor] = {}
        self.generation = 0  # bumped by every rebuild (the C steps' view of the stacks follows it)
        self._active: _Active | None = None

    def rebuild(self, adapters: Sequence[tuple[str, LoraWeights]]) -> None:
        """Stack these adapters (key, weights), slot i for the i-th; replaces what was stacked."""
        self.slots = {key: i for i, (key, _) in enumerate(adapters)}
        targets = sorted({(layer, MODULE_OF[proj]) for _, weights in adapters for layer, proj in weights})
        stacks, rank_tables = {}, {}
        for layer, fused in targets:
            projs = FUSED_MODULES[fused]
            outs = self.out_sizes[fused]
            ranks = [sum(w[(layer, p)][0].shape[0] for p in projs if (layer, p) in w) for _, w in adapters]
            in_features = next(w[(layer, p)][0].shape[1] for _, w in adapters for p in projs if (layer, p) in w)
            width = max(ranks)
            a_stack = torch.zeros(len(adapters), width, in_features)
            b_stack = torch.zeros(len(adapters), width, sum(outs))
            part_ranks = torch.zeros(len(adapters), len(projs), dtype=torch.int32)
            for slot, (_, weights) in enumerate(adapters):
                rank_at, out_at = 0, 0
                for proj, out in zip(projs, outs):
                    if (layer, proj) in weights:
                        a, b = weights[(layer, proj)]
                        a_stack[slot, rank_at : rank_at + a.shape[0]] = a
                        b_stack[slot, rank_at : rank_at + a.shape[0], out_at : out_at + out] = b.T
                        rank_at += a.shape[0]
                        part_ranks[slot, projs.index(proj)] = a.shape[0]
                    out_at += out
            stacks[layer, fused] = (a_stack, b_stack)
            rank_tables[layer, fused] = part_ranks
        self.stacks, self.ranks = stacks, rank_tables
        self.generation += 1

    def slots_of(self, row_keys: Sequence[str | None]) -> list[int]:
        """Each row's slot (-1: the base model) for the C decode steps."""
        return [self.slots[key] if key is not None else -1 for key in row_keys]

    def activate(self, row_keys: Sequence[str | None], row_tokens: Sequence[int]) -> bool:
        """Rows of the next forward use these adapter keys (None: the base model); row i brings
        row_tokens[i] positions (padded rows: the padded length). False when no row has one."""
        return self.activate_slots(self.slots_of(row_keys), row_tokens)

    def activate_slots(self, slots: Sequence[int], row_tokens: Sequence[int], exact: "RowDelta | None" = None) -> bool:
        """As `activate`, by slot (-1: the base model). `exact`: where every token takes one slot, a
        delta computed row by row in C (a hybrid's prompt rows, so they do not round by the chunk)."""
        used = sorted({s for s in slots if s >= 0})
        if not used or not self.stacks:
            self._active = None
            return False
        local = torch.tensor([used.index(s) if s >= 0 else -1 for s in slots])
        token_slot = local.repeat_interleave(torch.tensor(list(row_tokens)))
        decode = None
        if all(n == 1 for n in row_tokens):
            slot_tensor = torch.tensor(slots)
            decode = (slot_tensor.clamp(min=0), (slot_tensor >= 0).float()[:, None])
        token_rows = [torch.nonzero(token_slot == k).flatten() for k in range(len(used))]
        all_same = len(used) == 1 and bool((local == 0).all())
        self._active = _Active(used, token_rows, all_same, decode, exact if all_same else None)
        return True

    def deactivate(self) -> None:
        self._active = None

    def add_delta(self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y = base_linear(x) [..., out] -> y + B(A x) for each token's adapter."""
        active, stack = self._active, self.stacks.get((layer, fused))
        if active is None or stack is None:
            return y
        if active.exact is not None:
            return active.exact(layer, fused, x, y, active.used[0])
        a_stack, b_stack = stack
        if active.decode is not None:
            return y + self._decode_delta(active.decode, a_stack, b_stack, x).view(y.shape).to(y.dtype)
        rows = x.reshape(-1, x.shape[-1]).float()  # [N, in]
        if active.all_same:
            a, b = a_stack[active.used[0]], b_stack[active.used[0]]
            return y + ((rows @ a.T) @ b).view(y.shape).to(y.dtype)
        out = y.reshape(-1, y.shape[-1]).clone()  # [N, out]; base rows keep their bits
        for slot, index in zip(active.used, active.token_rows):
            delta = (rows.index_select(0, index) @ a_stack[slot].T) @ b_stack[slot]  # [n, out]
            out.index_add_(0, index, delta.to(y.dtype))
        return out.view(y.shape)

    @staticmethod
    def _decode_delta(decode: tuple[torch.Tensor, torch.Tensor], a_stack: torch.Tensor, b_stack: torch.Tensor,
                      x: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """One-token rows: each row's own A and B gathered (BGMV) and reduced row by row, so a row's
        delta has the same bits in a batch of one or of many (GEMMs round by their row count):
        decodes stay batch-invariant. [N, out]."""
        slots, has_adapter = decode
        rows = x.reshape(-1, x.shape[-1]).float()  # [N, in]
        xa = (rows[:, None, :] * a_stack[slots]).sum(-1) * has_adapter  # [N, R]
        return (xa[:, :, None] * b_stack[slots]).sum(1)  # [N, out]
