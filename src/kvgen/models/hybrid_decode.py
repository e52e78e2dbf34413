"""The hybrids' decode step in C (Granite 4.0-H, Bamba, LFM2, Nemotron-H, Falcon-H1), where their
projections are quantized; a lone token's step runs every layer in one call (kernels/hybrid_step.c's
kvgen_hybrid_step, which makes the calls below for each layer in turn).

A Mamba layer's mixer runs as kernels/mamba_step.c's kvgen_mamba2_step_from over that one layer (the
residual multiplier on its output), an LFM2 short-conv layer's as kvgen_short_conv_step, then its
MLP or mixture as decode.c's kvgen_block_mlp (which alone is a Nemotron-H MLP layer; Nemotron-H's
Mamba layers have none); an attention layer as decode.c's kvgen_block_pre_into (QKV, turned by a
table of RoPE angles or, without RoPE, cos 1 and sin 0; the new key and value written into the
cache's buffer in place) and kvgen_block_post (attention, o-proj, then the MLP or mixture where the
layer has one).
These are the kernels the transformer families' C steps and the Mamba-2 step use, over the same
blocks; the torch path remains the reference (tests/parity/test_tiny_granite_hybrid.py and
test_tiny_lfm2.py compare the two).

The engine's rows of several sequences (`step_rows`) run in one C call too (kvgen_hybrid_rows),
each layer over all of them at once, so its weights are read once a step instead of once a row: a state layer's mixer over the rows and
its MLP as decode_rows.c's kvgen_mlp_rows, an attention layer as kvgen_decode_rows_own over each
row's own contiguous keys and values. A sequence may bring a few tokens (a speculative verify, a
short turn): its rows run as a chain, each row's mixer continuing the row before's states and its
attention reading the keys up to its own position, so every row is computed as the one-token step
computes it. A row's bits are those it gets alone (tests/support/recurrent.py checks them).

LoRA: every call takes its layer's lora_linear structs (kernels/lora_delta.c: attention's, the
MLP's and the mixer's in_proj and out_proj) and each row's adapter slot, so a row with an adapter
gets the same delta alone, beside other rows and in a prompt (`lora_delta`, the prompt's torch
mixers and MLPs), and a row without one the base step's bits.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from kvgen.kernels import load
from kvgen.kv.hybrid import HybridStateCache
from kvgen.kv.interface import KVLayout
from kvgen.models.fast_decode import (MAX_ROWS, BlockStruct, LoraTables, _QLinear, describe_block, layer_lora, mlp_linears,
                                      qlinear_struct, rows_scratch_for)  # fmt: skip
from kvgen.models.mamba_decode import MixerStructs, _Mamba2Block, chain_ends, layer_major, linked_rows, replayed, trace_for
from kvgen.models.recurrent import commit_chain
from kvgen.models.half_linear import C_STEP_LINEARS, has_half_linears
from kvgen.models.short_conv import ShortConvMixer

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class _ShortConvBlock(ctypes.Structure):  # kernels/mamba_step.c's short_conv_block_t
    _fields_ = [("hidden", _i64), ("kernel", _i64), ("eps", _f32), ("pad", _f32), ("norm", _ptr), ("in_proj", _QLinear),
                ("conv_w", _ptr), ("conv_b", _ptr), ("out_proj", _QLinear)]  # fmt: skip


class _HybridLayer(ctypes.Structure):  # kernels/hybrid_step.c's hybrid_layer_t
    _fields_ = [("attention", _ptr), ("mamba2", _ptr), ("conv", _ptr), ("mlp", _ptr), ("state_slot", _i64), ("kv_slot", _i64)]


class _Sublayers(NamedTuple):  # the part of a layer one C block struct describes (describe_block reads these)
    input_norm: nn.Module | None
    attn: nn.Module | None
    post_attn_norm: nn.Module | None
    mlp: nn.Module | None


class _Layer(NamedTuple):
    mixer: ctypes.Array | None  # a state layer's mixer struct
    attention: BlockStruct | None  # attention, with the layer's MLP where it is not parallel to a mixer
    mlp: BlockStruct | None  # the MLP or mixture of a layer whose attention struct does not carry it
    state_slot: int  # its state's index in the cache (-1: none)
    kv_slot: int  # its keys' index in the cache's K/V (-1: none)


def hybrid_runs_in_c(model: nn.Module) -> bool:
    """Whether every projection the C kernels read is quantized or 16-bit, and the kernels are built."""
    for block in model.layers:
        linears = mlp_linears(block.mlp)
        if block.mixer is not None:
            linears += [block.mixer.in_proj, block.mixer.out_proj]
        if block.attn is not None:  # a parallel layer (Falcon-H1) has both
            linears += [block.attn.qkv, block.attn.o_proj]
        if not all(isinstance(linear, C_STEP_LINEARS) for linear in linears):
            return False
    return load() is not None


def _slot_array(slots: list[int]) -> ctypes.Array:
    """Each row's LoRA adapter slot as the C calls read them (int64)."""
    return (_i64 * len(slots))(*slots)


class HybridStep(MixerStructs):
    """The C step over a GraniteHybridModel's layers (which must pass `hybrid_runs_in_c`)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.library, self._arrays = load(), []  # _arrays: expert linears the block structs point into
        decoder = model.config.decoder
        self.layers: list[_Layer] = []
        for block in model.layers:
            mixer = None
            if isinstance(block.mixer, ShortConvMixer):
                mixer = (_ShortConvBlock * 1)(self._describe_conv(block))
            elif block.mixer is not None:
                mixer = (_Mamba2Block * 1)(self._describe2(block, decoder, block.input_norm, decoder.residual_multiplier))
            attention = mlp = None
            if block.attn is not None:  # a parallel layer's attention alone, its MLP a struct of its own
                carried = block if block.mixer is None else _Sublayers(block.input_norm, block.attn, None, None)
                attention = describe_block(decoder, carried, self._scratch, self._arrays)
            if block.mlp is not None and (block.attn is None or block.mixer is not None):
                mlp = describe_block(decoder, _Sublayers(None, None, block.post_attn_norm, block.mlp), self._scratch, self._arrays)
            self.layers.append(_Layer(mixer, attention, mlp, block.state_slot, block.kv_slot))
        d = decoder
        self.cos, self.sin = torch.ones(d.head_dim), torch.zeros(d.head_dim)  # no RoPE (Granite 4.0-H): the identity turn
        self.rope = model.rope if model.config.rope else None
        self._rope_table = torch.empty(0, 2, d.head_dim)  # _turn's
        self._one_layer = torch.zeros(1, dtype=torch.int64)  # rope kind 0 and full attention (window 0) for one block
        self._rows_capacity, self._rows_buffers, self._rows_struct = 0, [], None
        self._float_rows = has_half_linears(model.layers)
        self._input = torch.empty(0)  # a parallel layer's mixer input: h's rows before its attention adds into h
        self._decoder = d
        self._lora_tables = LoraTables(model, len(self.layers))
        self._step_layers = (_HybridLayer * len(self.layers))(*(self._step_layer(layer) for layer in self.layers))
        mixers = {layer.state_slot: layer.mixer for layer in self.layers if layer.mixer is not None}
        self._state_layers = len(mixers)
        self._replay_blocks = [(mixers[slot], 0) for slot in range(len(mixers))]  # each state slot's mixer, for a Replay
        mamba2 = [mixer[0] for mixer in mixers.values() if isinstance(mixer[0], _Mamba2Block)]
        # one trace per state slot, each of the first Mamba-2 layer's width (replayed() slices them so)
        assert all((b.heads, b.head_dim, b.groups, b.state) == (mamba2[0].heads, mamba2[0].head_dim, mamba2[0].groups, mamba2[0].state)
                   for b in mamba2), "a hybrid's Mamba-2 layers share one shape"  # fmt: skip
        self._mamba2_shape = mamba2[0] if mamba2 else None
        self._hidden = d.hidden_size

    @staticmethod
    def _step_layer(layer: _Layer) -> _HybridLayer:
        """A layer as kvgen_hybrid_step reads it: its structs' addresses (NULL where it has none)."""
        address = lambda struct: ctypes.addressof(struct) if struct is not None else None  # noqa: E731
        mamba2 = layer.mixer is not None and isinstance(layer.mixer[0], _Mamba2Block)
        return _HybridLayer(address(layer.attention), address(layer.mixer) if mamba2 else None,
                            None if mamba2 else address(layer.mixer), address(layer.mlp), layer.state_slot, layer.kv_slot)  # fmt: skip

    def _describe_conv(self, block: nn.Module) -> "_ShortConvBlock":
        mixer, norm = block.mixer, block.input_norm
        return _ShortConvBlock(mixer.hidden, mixer.kernel, norm.eps, 0.0, self._pointer(norm.weight), qlinear_struct(mixer.in_proj),
                               self._pointer(mixer.conv_weight.reshape(mixer.hidden, -1)), self._pointer(mixer.conv_bias),
                               qlinear_struct(mixer.out_proj))  # fmt: skip

    def _states(self, caches: list[HybridStateCache], counts: list[int]) -> tuple[list[list[torch.Tensor]], ...]:
        """Each row's states for the C call, [row][state slot]: the conv windows in and out (cache
        i's rows linked as a chain: `linked_rows`), the recurrent states in and out (`chain_ends`)."""
        slots = range(self._state_layers)
        conv_in, conv_out = linked_rows([[cache.conv_state(s) for s in slots] for cache in caches], counts)
        ssm_in, ssm_out = chain_ends([[cache.recurrent_state(s) for s in slots] for cache in caches], counts)
        return conv_in, conv_out, ssm_in, ssm_out  # type: ignore[return-value]

    def _mixer_inputs(self, rows: int) -> int:
        """A buffer for a parallel layer's mixer input, rows x hidden (grown to the most rows seen)."""
        if self._input.numel() < rows * self._hidden:
            self._input = torch.empty(rows * self._hidden)
        return self._input.data_ptr()

    @staticmethod
    def _layer_store(layout: KVLayout, slot: int) -> tuple[int, int]:
        """Addresses of attention layer `slot`'s keys and values in a cache's buffer (fp32)."""
        return layout.keys.data_ptr() + 4 * slot * layout.layer_stride, layout.values.data_ptr() + 4 * slot * layout.layer_stride

    def _scratch(self, size: int) -> int:
        buffer = torch.zeros(size)
        self._keep.append(buffer)
        return buffer.data_ptr()

    def step(self, h: torch.Tensor, cache: HybridStateCache, slot: int = -1) -> None:
        """h [hidden] (updated in place) through every layer at position cache.seq_len, under LoRA
        adapter slot `slot` (-1: none), in one C call (kernels/hybrid_step.c: each layer's attention,
        mixer and MLP calls in turn); the states and keys written, then committed (one position)."""
        position = cache.seq_len
        assert h.dtype == torch.float32 and h.is_contiguous() and h.numel() == self._hidden
        cos, sin = self._turn(position)
        layout = cache.kv.kernel_layout(position + 1)  # room for the new key, written in place
        table = self._lora_tables.for_slots([slot])
        conv_in, conv_out, ssm_in, ssm_out = self._states([cache], [1])
        self.library.kvgen_hybrid_step(self._step_layers, len(self.layers), h.data_ptr(), self._mixer_inputs(1), h.numel(),
                                       cos.data_ptr(), sin.data_ptr(), layout.keys.data_ptr(), layout.values.data_ptr(),
                                       layout.layer_stride, layout.head_stride, layout.pos_stride, position,
                                       layer_major(conv_in), layer_major(conv_out), layer_major(ssm_in),
                                       layer_major(ssm_out), layer_lora(table, 0), slot)  # fmt: skip
        commit_chain(cache, [list(zip(conv_out[0], ssm_out[0]))])

    def lora_delta(self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor, slot: int) -> torch.Tensor:
        """y (a linear's output for one sequence's rows x) plus adapter slot `slot`'s delta of
        `fused` in layer `layer`, each row reduced in C as the decode steps reduce it, so a prompt's
        rows do not round by how many there are (models/lora.py's `RowDelta`)."""
        table = self._lora_tables.for_slots([slot])
        assert table is not None
        x, y = x.float().contiguous(), y.float().contiguous()
        rows = x.numel() // x.shape[-1]
        self.library.kvgen_lora_delta(layer_lora(table, layer, fused), x.shape[-1], y.shape[-1], x.data_ptr(), y.data_ptr(), rows,
                                      _slot_array([slot] * rows))  # fmt: skip
        return y

    def _turn(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [rotary_dim] at `position` (no RoPE: the identity turn), from a table of the
        positions so far, grown by doubling, so a step computes none (the rows step reads it too)."""
        if self.rope is None:
            return self.cos, self.sin
        table = self._rope_table
        if position >= table.shape[0]:
            count = max(2 * table.shape[0], position + 1, 256)
            cos, sin = self.rope(torch.arange(count)[None], torch.float32)  # [1, 1, count, rotary_dim] each
            table = self._rope_table = torch.stack([cos[0, 0], sin[0, 0]], dim=1).contiguous()  # [count, 2, rotary_dim]
        return table[position, 0], table[position, 1]

    def step_rows(self, h: torch.Tensor, caches: list[HybridStateCache], slots: list[int] | None = None,
                  counts: list[int] | None = None) -> None:  # fmt: skip
        """h [rows, hidden] (updated in place): cache i's next counts[i] tokens (None: one each), its
        rows consecutive, every layer for all rows in one call; a cache's rows run as a chain, each
        row as the one-token step computes its token (attention over its cache up to its own
        position, the keys of every row written first; a mixer's row continuing the row before's
        states); cache i's rows under LoRA adapter slot slots[i] (-1 or None: none). Each cache's
        states and keys written, then committed (`commit_chain`: a verify keeps every position's)."""
        lib, rows, counts = self.library, h.shape[0], counts or [1] * len(caches)
        slots = [slot for slot, count in zip(slots or [-1] * len(caches), counts) for _ in range(count)]  # per row
        table = self._lora_tables.for_slots(slots)
        row_slots = _slot_array(slots) if table is not None else None  # no adapter: the C calls read no slots
        assert h.dtype == torch.float32 and h.is_contiguous() and h.dim() == 2 and rows == sum(counts) == len(slots)
        scratch, h_ptr = ctypes.byref(self._scratch_for_rows(rows)), h.data_ptr()
        positions = torch.tensor([cache.seq_len + j for cache, count in zip(caches, counts) for j in range(count)], dtype=torch.int64)
        layouts = [layout for cache, count in zip(caches, counts) for layout in [cache.kv.kernel_layout(cache.seq_len + count)] * count]
        rope = self._rows_rope(positions)
        kv = torch.tensor([[layout.keys.data_ptr(), layout.values.data_ptr(), layout.layer_stride, layout.head_stride]
                           for layout in layouts], dtype=torch.int64)  # fmt: skip
        conv_in, conv_out, ssm_in, ssm_out = self._states(caches, counts)
        trace = trace_for(self._mamba2_shape, self._state_layers, rows, counts) if self._mamba2_shape is not None else None
        lib.kvgen_hybrid_rows(self._step_layers, len(self.layers), rows, h_ptr, self._mixer_inputs(rows), self._hidden,
                              rope.data_ptr(), kv.data_ptr(), layouts[0].pos_stride, positions.data_ptr(), scratch,
                              layer_major(conv_in), layer_major(conv_out), layer_major(ssm_in),
                              layer_major(ssm_out), trace.data_ptr() if trace is not None else None,
                              trace.shape[2] if trace is not None else 0, layer_lora(table, 0), row_slots)  # fmt: skip
        traces = list(trace) if trace is not None else [None] * self._state_layers
        recurrent = replayed(lib, self._replay_blocks, ssm_in, ssm_out, counts, traces)
        first = 0
        for cache, count in zip(caches, counts):
            commit_chain(cache, [list(zip(conv_out[row], recurrent[row])) for row in range(first, first + count)])
            first += count

    def prompt_block(self, layer: int, h: torch.Tensor, cache: HybridStateCache, start: int, slot: int = -1) -> bool:
        """Attention layer `layer`'s C block (attention, o-proj, and the MLP or mixture where the
        block carries it: not in a parallel layer) for a prompt's rows h [S, hidden] (updated in
        place) at positions start.. of `cache`, in calls of at most MAX_ROWS rows: each row's key and
        value go into the cache's buffer before any row attends, and each row is computed as a decode
        of its token would be, so the rows' bits do not depend on how the prompt was split. The keys
        count once the caller commits the pass. `slot`: the sequence's LoRA adapter slot (-1: none).
        Returns whether the block ran the layer's MLP."""
        lib, chosen = self.library, self.layers[layer]
        struct, kv_slot = chosen.attention, chosen.kv_slot
        lora = layer_lora(self._lora_tables.for_slots([slot]), layer)
        assert h.dtype == torch.float32 and h.is_contiguous() and h.dim() == 2
        # room for the whole prompt first: growing the buffer later would copy only the committed
        # positions and drop the rows this pass wrote
        layout = cache.kv.kernel_layout(start + h.shape[0])
        for first in range(0, h.shape[0], MAX_ROWS):
            part = h[first : first + MAX_ROWS]
            rows = part.shape[0]
            positions = torch.arange(start + first, start + first + rows, dtype=torch.int64)
            stores = torch.tensor([[*self._layer_store(layout, kv_slot), layout.head_stride]], dtype=torch.int64).expand(rows, 3).contiguous()
            rope = self._rows_rope(positions)
            lib.kvgen_decode_rows_own(ctypes.byref(struct), 1, rows, part.data_ptr(), rope.data_ptr(), 1, self._one_layer.data_ptr(),
                                      self._one_layer.data_ptr(), stores.data_ptr(), layout.pos_stride, positions.data_ptr(),
                                      ctypes.byref(self._scratch_for_rows(rows)), lora,
                                      _slot_array([slot] * rows) if lora is not None else None)  # fmt: skip
        return chosen.mlp is None

    def prompt_mlp(self, layer: int, h: torch.Tensor, slot: int = -1) -> None:
        """Layer `layer`'s MLP or mixture (the one its attention block does not carry) over a
        prompt's rows h [S, hidden] (updated in place: h += the sublayer's output), in calls of at
        most MAX_ROWS rows of kvgen_mlp_rows, each row as a decode of its token computes it: a
        mixture routes each row as the step does, so the prompt's bits do not depend on how it was
        split (a chunk of a few tokens takes the C step). `slot`: the LoRA adapter slot (-1: none)."""
        chosen = self.layers[layer]
        lora = layer_lora(self._lora_tables.for_slots([slot]), layer)
        assert chosen.mlp is not None and h.dtype == torch.float32 and h.is_contiguous() and h.dim() == 2
        for first in range(0, h.shape[0], MAX_ROWS):
            rows = min(MAX_ROWS, h.shape[0] - first)
            self.library.kvgen_mlp_rows(ctypes.byref(chosen.mlp), rows, h[first].data_ptr(), ctypes.byref(self._scratch_for_rows(rows)),
                                        lora, _slot_array([slot] * rows) if lora is not None else None)  # fmt: skip

    def _rows_rope(self, positions: torch.Tensor) -> torch.Tensor:
        """[rows, 1, 2, head_dim]: each row's cos and sin (without RoPE the identity turn; partial
        rotary: the turned channels' angles first, zeros after, as the kernel reads them)."""
        if self.rope is None:
            return torch.stack([self.cos, self.sin]).expand(len(positions), 1, 2, -1).contiguous()
        self._turn(int(positions.max()))  # the batch-1 step's table, so a row turns by the same bits alone
        return F.pad(self._rope_table[positions][:, None], (0, len(self.cos) - self._rope_table.shape[-1])).contiguous()

    def _scratch_for_rows(self, rows: int) -> ctypes.Structure:
        if rows > self._rows_capacity:
            self._rows_buffers, self._rows_struct = rows_scratch_for(self._decoder, rows, self._float_rows)
            self._rows_capacity = rows
        return self._rows_struct
