"""Mamba's and Mamba-2's decode step in one C call (kernels/mamba_step.c) for models whose
projections are quantized, for one row or the engine's several (each weight read once for all).

The torch step runs ~15 small operations per block (a depthwise conv of one position, the scan's
update, four linears), and their overhead is most of a token's time on a small model; the C step
runs every block for one token inside one parallel region. The linears are the C kernels the torch
path calls for one row (int8 activations, the same blocks), so the two differ only in the order of
a few float sums and exps. States are written to fresh tensors, as the torch step's are: the cache
keeps earlier ones as checkpoints.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from kvgen.kernels import load
from kvgen.models.fast_decode import _QLinear, qlinear_struct
from kvgen.models.half_linear import C_STEP_LINEARS

_i64, _f32, _i32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int32, ctypes.c_void_p


class _MambaBlock(ctypes.Structure):
    _fields_ = [
        ("hidden", _i64), ("inner", _i64), ("state", _i64), ("kernel", _i64), ("rank", _i64),
        ("eps", _f32), ("dt_b_c_eps", _f32), ("norm", _ptr), ("in_proj", _QLinear), ("conv_w", _ptr), ("conv_b", _ptr),
        ("x_proj", _QLinear), ("dt_proj", _QLinear), ("dt_w", _ptr), ("dt_b", _ptr), ("A", _ptr), ("D", _ptr),
        ("out_proj", _QLinear), ("dt_quantized", _i32), ("pad", _i32),
    ]  # fmt: skip


class _Mamba2Block(ctypes.Structure):
    _fields_ = [
        ("hidden", _i64), ("heads", _i64), ("head_dim", _i64), ("groups", _i64), ("state", _i64), ("kernel", _i64),
        ("eps", _f32), ("gate_eps", _f32), ("norm", _ptr), ("in_proj", _QLinear), ("conv_w", _ptr), ("conv_b", _ptr),
        ("dt_bias", _ptr), ("A", _ptr), ("D", _ptr), ("gate_w", _ptr), ("out_proj", _QLinear), ("residual_scale", _f32),
        ("pad", _f32),
    ]  # fmt: skip


def runs_in_c(model: nn.Module) -> bool:
    """Whether every block's projections are quantized or 16-bit (what the C step reads: in_proj,
    out_proj and Mamba's x_proj) and the kernels are built."""
    parts = ("in_proj", "x_proj", "out_proj") if model.config.architecture == "mamba" else ("in_proj", "out_proj")
    quantized = all(isinstance(getattr(block.mixer, p), C_STEP_LINEARS) for block in model.layers for p in parts)
    return quantized and load() is not None


class MixerStructs:
    """Builds kernels/mamba_step.c's block structs, keeping alive the tensors they point into."""

    def __init__(self) -> None:
        self._keep: list[torch.Tensor] = []

    def _pointer(self, tensor: torch.Tensor | None) -> int | None:
        if tensor is None:
            return None
        tensor = tensor.detach().float().contiguous()
        self._keep.append(tensor)
        return tensor.data_ptr()

    def _describe(self, block: nn.Module, config) -> _MambaBlock:
        mixer = block.mixer
        dt_quantized = isinstance(mixer.dt_proj, C_STEP_LINEARS)
        return _MambaBlock(
            config.hidden_size, mixer.intermediate, mixer.state_size, mixer.conv_weight.shape[-1], mixer.rank,
            block.norm.eps, config.dt_b_c_rms_eps or 0.0, self._pointer(block.norm.weight), qlinear_struct(mixer.in_proj),
            self._pointer(mixer.conv_weight.reshape(mixer.intermediate, -1)), self._pointer(mixer.conv_bias),
            qlinear_struct(mixer.x_proj), qlinear_struct(mixer.dt_proj) if dt_quantized else _QLinear(),
            None if dt_quantized else self._pointer(mixer.dt_proj.weight), self._pointer(mixer.dt_proj.bias),
            self._pointer(mixer.A), self._pointer(mixer.D), qlinear_struct(mixer.out_proj), int(dt_quantized), 0,
        )  # fmt: skip

    def _describe2(self, block: nn.Module, config, norm: nn.Module | None = None, residual_scale: float = 1.0) -> _Mamba2Block:
        """norm: the norm before the mixer (a Mamba-2 block's own `norm` when None); residual_scale:
        on the mixer's output before its residual add (Granite 4.0-H's)."""
        mixer, norm = block.mixer, norm or block.norm
        return _Mamba2Block(
            config.hidden_size, mixer.heads, mixer.head_dim, mixer.groups, mixer.state_size, mixer.conv_weight.shape[-1],
            norm.eps, mixer.eps, self._pointer(norm.weight), qlinear_struct(mixer.in_proj),
            self._pointer(mixer.conv_weight.reshape(mixer.conv_weight.shape[0], -1)), self._pointer(mixer.conv_bias),
            self._pointer(mixer.dt_bias), self._pointer(mixer.A), self._pointer(mixer.D), self._pointer(mixer.norm_weight),
            qlinear_struct(mixer.out_proj), residual_scale if residual_scale != 1.0 else 0.0, 0.0,
        )  # fmt: skip



def chained_states(first: torch.Tensor, rows: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One layer's states for a chain of `rows` rows of one sequence -> (inputs, outputs): a fresh
    output per row, and inputs that link them (row 0 reads `first`, row r row r-1's output), as the
    C steps run a chain (kernels/mamba_step.c). An empty state (a short conv's recurrent one) is
    handed over as it is."""
    outputs = [torch.empty_like(first) for _ in range(rows)] if first.numel() else [first] * rows
    return [first, *outputs[:-1]], outputs


def linked_rows(states: list[list[torch.Tensor]], counts: list[int]) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Sequences' states per layer (states[i][layer]) and how many rows each runs -> (inputs,
    outputs) per row and layer, each sequence's rows linked as a chain (`chained_states`)."""
    inputs: list[list[torch.Tensor]] = []
    outputs: list[list[torch.Tensor]] = []
    for layers, count in zip(states, counts):
        linked = [chained_states(state.float().contiguous(), count) for state in layers]
        inputs += [[ins[r] for ins, _ in linked] for r in range(count)]
        outputs += [[outs[r] for _, outs in linked] for r in range(count)]
    return inputs, outputs


def nullable(tensors: list[torch.Tensor | None]) -> ctypes.Array:
    """Pointers to the tensors' data, NULL for a None (a chain's state the kernel keeps to itself)."""
    return (_ptr * len(tensors))(*(None if t is None else t.data_ptr() for t in tensors))


def layer_major(per_row: list[list[torch.Tensor | None]]) -> ctypes.Array:
    """States [row][layer] as the C steps' pointers: layer l's rows at l * rows (None: NULL)."""
    return nullable([row[layer] for layer in range(len(per_row[0])) for row in per_row])


class Replay:
    """A Mamba-2 layer's recurrent state after the first rows of a chain, which the chain did not
    write out (kv/ssm.py's DeferredState): kvgen_mamba2_replay rebuilds it from the state the chain
    started from and the rows' trace, with the bits the step computed. blocks[index] is the layer's
    struct (the array is kept alive with it)."""

    def __init__(self, library: ctypes.CDLL, blocks: ctypes.Array, index: int, start: torch.Tensor, trace: torch.Tensor):
        self.library, self.blocks, self.index, self.start, self.trace = library, blocks, index, start, trace

    def materialize(self) -> torch.Tensor:
        state = torch.empty_like(self.start)
        block = ctypes.addressof(self.blocks) + self.index * ctypes.sizeof(_Mamba2Block)
        self.library.kvgen_mamba2_replay(block, self.trace.shape[0], self.trace.data_ptr(), self.start.data_ptr(), state.data_ptr())
        return state


def chain_ends(states: list[list[torch.Tensor]], counts: list[int]) -> tuple[list[list[torch.Tensor | None]], list[list[torch.Tensor | None]]]:
    """Sequences' recurrent states per layer (states[i][layer]) and how many rows each runs ->
    (inputs, outputs) per row and layer as kvgen_mamba2_step_from reads a chain: a sequence's first
    row reads its state and its last gets a fresh output; the rows between are None (NULL: the
    kernel carries the state on and writes it to the trace only). An empty state (a short conv's
    recurrent one) is handed over as it is, every row."""
    inputs: list[list[torch.Tensor | None]] = []
    outputs: list[list[torch.Tensor | None]] = []
    for sequence, count in zip(states, counts):
        starts = [state.float().contiguous() for state in sequence]
        kept = [start if not start.numel() else None for start in starts]
        inputs += [starts] + [kept] * (count - 1)
        outputs += [kept] * (count - 1) + [[torch.empty_like(start) if start.numel() else start for start in starts]]
    return inputs, outputs


def replayed(library: ctypes.CDLL, blocks: list[tuple[ctypes.Array, int]], inputs: list[list[torch.Tensor | None]],
             outputs: list[list[torch.Tensor | None]], counts: list[int], traces: list[torch.Tensor | None]) -> list[list["torch.Tensor | Replay"]]:  # fmt: skip
    """`chain_ends`' outputs after the C step, each None (a chain's row before its last) as its
    Replay: layer l's struct at blocks[l] (an array and the index in it), its trace traces[l] [rows, width]."""
    first = 0
    for count in counts:
        for j in range(count - 1):
            row = outputs[first + j]
            outputs[first + j] = [state if state is not None else Replay(library, *blocks[l], inputs[first][l], traces[l][first : first + j + 1])
                                  for l, state in enumerate(row)]  # type: ignore[index]  # fmt: skip
        first += count
    return outputs  # type: ignore[return-value]


def trace_for(block: _Mamba2Block, layers: int, rows: int, counts: list[int]) -> torch.Tensor | None:
    """The trace of `layers` Mamba-2 layers shaped as `block` over rows where some sequence runs a
    chain ([layers, rows, conv_dim + heads]), or None where every sequence runs one row."""
    if rows == len(counts):
        return None
    return torch.empty(layers, rows, block.heads * block.head_dim + 2 * block.groups * block.state + block.heads)


def mamba2_step_rows(library: ctypes.CDLL, blocks: ctypes.Array, rows: int, x_ptr: int, h_ptr: int, conv_in: ctypes.Array,
                     conv_out: ctypes.Array, states: list[list[torch.Tensor]], counts: list[int]) -> list[list["torch.Tensor | Replay"]]:  # fmt: skip
    """kvgen_mamba2_step_from over `blocks`' layers for rows that are sequence i's next counts[i]
    tokens (a chain), the conv states' pointers given (layer-major); states[i][layer]: sequence i's
    recurrent states -> each row's recurrent states after it ([row][layer]). A sequence's last row
    gets fresh tensors; a chain's other rows are not written out but kept as a trace, each its
    Replay (a state is megabytes: writing one a draft cost most of a verify)."""
    layers = len(blocks)
    inputs, outputs = chain_ends(states, counts)
    trace = trace_for(blocks[0], layers, rows, counts)

    library.kvgen_mamba2_step_from(ctypes.addressof(blocks), layers, rows, x_ptr, h_ptr, conv_in, conv_out, layer_major(inputs),
                                   layer_major(outputs), None, None, trace.data_ptr() if trace is not None else None)  # fmt: skip
    traces = list(trace) if trace is not None else [None] * layers
    return replayed(library, [(blocks, i) for i in range(layers)], inputs, outputs, counts, traces)


class StateStep(MixerStructs):
    """The C step over a MambaModel's or Mamba2Model's blocks (which must pass `runs_in_c`)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.library = load()
        mamba2 = model.config.architecture == "mamba2"
        describe, struct = (self._describe2, _Mamba2Block) if mamba2 else (self._describe, _MambaBlock)
        blocks = [describe(block, model.config) for block in model.layers]
        self._blocks = (struct * len(blocks))(*blocks)
        self._mamba2 = mamba2
        self.num_layers = len(blocks)

    def __call__(self, h: torch.Tensor, conv: list[list[torch.Tensor]], ssm: list[list[torch.Tensor]],
                 counts: list[int] | None = None) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:  # fmt: skip
        """h [rows, hidden] (updated in place): sequence i's next counts[i] tokens (None: one each),
        its rows consecutive; conv[i][layer], ssm[i][layer]: its conv and recurrent states (any
        leading batch dimension of 1) -> each row's states after its token ([row][layer], new
        tensors; in a Mamba-2 chain, the rows before a sequence's last give Replays). A sequence's rows run as a chain (row r continues row r-1's states) and every row
        as a one-token step of its token runs; the rows share each weight read, and a row's bits do
        not depend on the others."""
        rows, layers = h.shape[0], self.num_layers
        counts = counts or [1] * len(conv)
        conv_in, conv_out = linked_rows(conv, counts)

        assert h.dtype == torch.float32 and h.is_contiguous() and h.dim() == 2 and rows == sum(counts)
        if self._mamba2:
            return conv_out, mamba2_step_rows(self.library, self._blocks, rows, h.data_ptr(), h.data_ptr(), layer_major(conv_in),
                                              layer_major(conv_out), ssm, counts)  # fmt: skip
        ssm_in, ssm_out = linked_rows(ssm, counts)
        self.library.kvgen_mamba_step(ctypes.addressof(self._blocks), layers, rows, h.data_ptr(), layer_major(conv_in), layer_major(conv_out),
                                      layer_major(ssm_in), layer_major(ssm_out))  # fmt: skip
        return conv_out, ssm_out
