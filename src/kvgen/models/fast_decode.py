"""FastDecoder: one-token, batch-1 decode steps run in C (kernels/decode.c), two calls per block.

Eligible when every block matmul is a QuantizedLinear (the int8 / q4 weight modes) or a HalfLinear (16bit) and the model is
a family decode.c knows (pre-norm Llama blocks, Gemma 3 sandwich blocks). The cache contract says
where keys and values live: fp32 storage read in place (`kernel_layout`, one C call per token),
packed codes the kernels read (`codes_view`, one C call per token), or anything else through
`cache.update()` (two C calls per block; the C attention reads the fp32 views update returns).
`step_rows` runs a batch of one-token rows over one paged store (fp32 blocks, or blocks of codes)
the same way, all rows' matmuls in one tiled GEMM per weight (the engine's decode steps).
Both steps add LoRA deltas in C (kernels/lora_delta.c) for rows whose request runs an adapter:
the model's LoraStacks, described once per restack as one table of [layers, 4] linears, and each
row's slot (-1: the base model, whose rows keep the base-only bits).

Prompts take the rows step too (`runs_prompts`): a prompt token is a kernel row computed as a lone
decode computes it, so its hidden state, logits and cache entries have the same bits however the
prompt is chunked, whatever rows share its step, and as if it had been decoded. Everything else
(fp32 weights, caches without an fp32 layout or batch view, KVGEN_PREFILL_GEMM=fp32|bf16 prompts)
runs the torch path, which stays the reference.
"""

from __future__ import annotations

import ctypes
import itertools
from typing import Any, Callable

import torch
from torch import nn

from kvgen.config import ModelConfig
from kvgen.kernels import load
from kvgen.kernels.formats import QK
from kvgen.kv.interface import CodesView, KVCache
from kvgen.models.layers import Attention, GatedMLP, RMSNorm
from kvgen.models.lora import LoraStacks
from kvgen.models.mla import LatentAttention
from kvgen.models.moe import SparseMoE
from kvgen.models.half_linear import C_STEP_LINEARS, has_half_linears
from kvgen.models.quantized_linear import X8_BLOCK_BYTES, QuantizedLinear
from kvgen.models.rotary import LongRopeEmbedding

_ptr, _i64, _f32, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int32

# Kernel rows per rows-step call: the engine's default step budget (EngineConfig.max_tokens_per_step),
# so one call takes a whole step; its scratch is ~26 KiB per row on SmolLM2, ~40 KiB on Gemma 3.
MAX_ROWS = 512
ROPE_CHUNK, ROPE_TABLES = 64, 4  # decode steps' cos/sin tables: positions per table, tables kept


class _QLinear(ctypes.Structure):
    _fields_ = [("kind", _i32), ("has_bias", _i32), ("blocks", _ptr), ("bias", _ptr), ("n", _i64), ("k", _i64)]


class _RowsScratch(ctypes.Structure):
    _fields_ = [("x", _ptr), ("y", _ptr), ("qkv_out", _ptr), ("attn", _ptr), ("mlp", _ptr), ("xq", _ptr)]


def rows_scratch(rows: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, float_rows: bool = False) -> tuple[list[torch.Tensor], _RowsScratch]:  # fmt: skip
    """The rows step's scratch for `rows` rows of blocks of these widths: the buffers (keep them
    alive) and the struct that points into them. float_rows: some linear is a 16-bit float kind,
    whose activations the scratch holds as floats instead of int8 blocks."""
    widest = max(hidden, heads * head_dim, intermediate)
    sizes = [(widest, torch.float32), (hidden, torch.float32), ((heads + 2 * kv_heads) * head_dim, torch.float32),
             (heads * head_dim, torch.float32), (2 * intermediate, torch.float32),
             (widest * 4 if float_rows else widest // QK * X8_BLOCK_BYTES, torch.uint8)]  # fmt: skip
    buffers = [torch.zeros(rows * size, dtype=dtype) for size, dtype in sizes]
    return buffers, _RowsScratch(*(buffer.data_ptr() for buffer in buffers))


def rows_scratch_for(config: ModelConfig, rows: int, float_rows: bool = False) -> tuple[list[torch.Tensor], _RowsScratch]:
    """rows_scratch for `rows` rows of any of this model's blocks (attention, MLP, mixture)."""
    widest_mlp = max(config.intermediate_size, config.expert_intermediate_size, config.shared_expert_intermediate_size,
                     _latent_projection_width(config) // 2 + 1)  # the rows' mlp scratch holds latent attention's raw projection
    return rows_scratch(rows, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, widest_mlp, float_rows)


def _latent_projection_width(config) -> int:
    """DeepSeek's fused q_proj + kv_a output width (0 for other models)."""
    if not config.kv_lora_rank:
        return 0
    return config.num_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim) + config.kv_lora_rank + config.qk_rope_head_dim


class BlockStruct(ctypes.Structure):
    """One pre-norm block as kernels/decode.c's block_t describes it (kvgen_decode_layers' blocks)."""

    _fields_ = [
        ("hidden", _i64), ("num_heads", _i64), ("num_kv_heads", _i64), ("head_dim", _i64), ("intermediate", _i64),
        ("eps", _f32), ("scale", _f32), ("softcap", _f32), ("act", _i32), ("rotary_dim", _i32), ("pad", _i32),
        ("input_norm", _ptr), ("attn_out_norm", _ptr), ("mlp_in_norm", _ptr), ("mlp_out_norm", _ptr),
        ("q_norm", _ptr), ("k_norm", _ptr),
        ("qkv", _QLinear), ("o", _QLinear), ("gate_up", _QLinear), ("down", _QLinear),
        ("x", _ptr), ("qkv_out", _ptr), ("attn", _ptr), ("mlp", _ptr),
        # a mixture of experts (num_experts 0: the gated MLP above)
        ("num_experts", _i64), ("top_k", _i64), ("normalize", _i64), ("pad2", _i64),
        ("router", _ptr), ("router_out", _ptr), ("expert_gate_up", _ptr), ("expert_down", _ptr),
        # gpt-oss (NULL / unused elsewhere)
        ("sinks", _ptr), ("router_bias", _ptr), ("swiglu_alpha", _f32), ("swiglu_limit", _f32),
        # Qwen2-MoE's shared expert (shared_intermediate 0: none)
        ("shared_intermediate", _i64), ("shared_gate", _ptr), ("shared_gate_up", _QLinear), ("shared_down", _QLinear),
        # DeepSeek-V2's latent attention (mla_rank 0: none)
        ("mla_rank", _i64), ("mla_nope", _i64), ("mla_rope", _i64), ("mla_v", _i64),
        ("mla_kv_norm", _ptr), ("w_uk", _ptr), ("w_uv", _ptr), ("mla_raw", _ptr), ("mla_out", _ptr),
        ("routed_scale", _f32), ("pad3", _f32),
        # DeepSeek-V3's routing (softmax, no bias, one group elsewhere)
        ("expert_sigmoid", _i64), ("expert_groups", _i64), ("expert_groups_used", _i64), ("pad4", _i64), ("choice_bias", _ptr),
        # latent attention's per-head linears over quantized weights (NULL: w_uk / w_uv above)
        ("mla_uk", _ptr), ("mla_uv", _ptr),
        ("residual_scale", _f32), ("qk_norm_full", _i32),  # Granite's residual multiplier (0: 1); OLMo 2's QK-norm
    ]  # fmt: skip


class _LoraLinear(ctypes.Structure):
    _fields_ = [("a", _ptr), ("b", _ptr), ("ranks", _ptr), ("slots", _i64), ("width", _i64), ("parts", _i64),
                ("part_out", _i64 * 4)]  # fmt: skip


LORA_LINEARS = ("qkv", "o", "gate_up", "down", "mixer_in", "mixer_out")  # a layer's lora_linear order in kernels/lora_delta.c
_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "swiglu_oai": 2, "relu2": 3}  # decode.c block_t's act


def lora_table(stacks: LoraStacks, num_layers: int) -> ctypes.Array:
    """stacks -> [num_layers * len(LORA_LINEARS)] lora_linear structs (kernels/lora_delta.c; a = NULL where no
    adapter touches a linear). They point into the stacks' tensors, valid until the next rebuild."""
    table = (_LoraLinear * (num_layers * len(LORA_LINEARS)))()
    for (layer, fused), (a, b) in stacks.stacks.items():
        assert a.is_contiguous() and b.is_contiguous() and a.dtype == b.dtype == torch.float32
        offsets = list(itertools.accumulate(stacks.out_sizes[fused], initial=0))
        table[layer * len(LORA_LINEARS) + LORA_LINEARS.index(fused)] = _LoraLinear(
            a.data_ptr(), b.data_ptr(), stacks.ranks[layer, fused].data_ptr(), a.shape[0], a.shape[1],
            len(offsets) - 1, (_i64 * 4)(*offsets, *[offsets[-1]] * (4 - len(offsets))),
        )  # fmt: skip
    return table


class LoraTables:
    """A model's LoRA stacks as the C steps read them (lora_table), rebuilt after each restack."""

    def __init__(self, model: nn.Module, num_layers: int):
        self.model, self.num_layers = model, num_layers
        self._stacks: LoraStacks | None = None  # the stacks (and generation) _table describes
        self._generation = -1
        self._table: ctypes.Array | None = None

    def for_slots(self, slots: list[int]) -> ctypes.Array | None:
        """The table when some row has an adapter (slots[r] >= 0), else None (the base-only step)."""
        stacks = self.model.lora
        if stacks is None or not stacks.stacks or all(s < 0 for s in slots):
            return None
        if stacks is not self._stacks or stacks.generation != self._generation:
            self._table = lora_table(stacks, self.num_layers)
            self._stacks, self._generation = stacks, stacks.generation
        return self._table


def layer_lora(table: ctypes.Array | None, layer: int, linear: str = LORA_LINEARS[0]) -> Any:
    """A pointer to layer `layer`'s LORA_LINEARS structs in `table`, from `linear`'s (None: no table)."""
    if table is None:
        return None
    return ctypes.byref(table, (layer * len(LORA_LINEARS) + LORA_LINEARS.index(linear)) * ctypes.sizeof(_LoraLinear))


# qlinear.kind in decode.c; f16 and bf16: a HalfLinear's 16-bit rows (kernels/half_linear.c)
_KIND_CODES = {"q4": 0, "q8": 1, "q8s": 2, "q5": 3, "q4k": 4, "q6k": 5, "q4h": 6, "iq4": 7, "q5m": 8, "mx4": 9, "f16": 10, "bf16": 11}


def qlinear_struct(layer: nn.Module) -> _QLinear:
    """A QuantizedLinear (or HalfLinear) as decode.c's qlinear (pointing into its blocks or rows)."""
    assert isinstance(layer, C_STEP_LINEARS)
    bias = layer.bias
    weights = layer.blocks if isinstance(layer, QuantizedLinear) else layer.weight16
    return _QLinear(_KIND_CODES[layer.kind], int(bias is not None), weights.data_ptr(),
                    bias.data_ptr() if bias is not None else None, layer.out_features, layer.in_features)  # fmt: skip


def _norm_ptr(norm: RMSNorm | None) -> int | None:
    return norm.weight.data_ptr() if norm is not None else None


def mlp_linears(mlp: nn.Module | None) -> list[nn.Module]:
    """A block's MLP linears the C steps read: its gate_up and down, or every expert's and the shared
    one's (none for a block without an MLP: Nemotron-H's attention and Mamba layers)."""
    if mlp is None:
        return []
    gated = [*mlp.experts, *filter(None, [mlp.shared_expert])] if isinstance(mlp, SparseMoE) else [mlp]
    return [*(m.gate_up for m in gated), *(m.down for m in gated)]


def describe_block(config: ModelConfig, block: nn.Module, scratch: Callable[[int], int], keep: list[ctypes.Array]) -> BlockStruct:
    """A block as decode.c's block_t: `scratch(n)` gives n zeroed floats the struct may point into,
    `keep` holds the arrays of expert linears it points into. A block without attention (`attn`
    None: a hybrid's Mamba layer, whose MLP alone runs as kvgen_block_mlp) leaves those fields empty;
    one without an MLP (`mlp` None: Nemotron-H's attention layers) has intermediate 0, which the
    kernels read as no MLP sublayer."""
    attn, mlp = block.attn, block.mlp
    gemma = hasattr(block, "pre_mlp_norm")
    qkv_width = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    experts = mlp.experts if isinstance(mlp, SparseMoE) else []
    intermediate = experts[0].intermediate if experts else mlp.intermediate if mlp is not None else 0
    shared = mlp.shared_expert if experts else None
    struct = BlockStruct(
        config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, intermediate,
        config.rms_norm_eps, attn.scale if attn is not None else 0.0, config.attn_logit_softcapping or 0.0, _ACTIVATIONS[config.hidden_act],
        config.rotary_dim or config.head_dim, 0,
        _norm_ptr(block.input_norm),
        _norm_ptr(block.post_attn_norm) if gemma else None,
        _norm_ptr(block.pre_mlp_norm) if gemma else _norm_ptr(block.post_attn_norm),
        _norm_ptr(block.post_mlp_norm) if gemma else None,
        _norm_ptr(getattr(attn, "q_norm", None)), _norm_ptr(getattr(attn, "k_norm", None)),
        qlinear_struct(attn.qkv) if attn is not None else _QLinear(), qlinear_struct(attn.o_proj) if attn is not None else _QLinear(),
        _QLinear() if experts or mlp is None else qlinear_struct(mlp.gate_up), _QLinear() if experts or mlp is None else qlinear_struct(mlp.down),
        scratch(config.hidden_size), scratch(qkv_width), scratch(config.num_heads * config.head_dim),
        scratch(2 * max(intermediate, shared.intermediate if shared is not None else 0)),
    )  # fmt: skip
    struct.sinks = attn.sinks.data_ptr() if attn is not None and attn.sinks is not None else None
    if isinstance(attn, LatentAttention):
        struct.mla_rank, struct.mla_nope, struct.mla_rope, struct.mla_v = attn.rank, attn.nope_dim, attn.rope_dim, attn.v_dim
        struct.mla_kv_norm, struct.w_uk, struct.w_uv = _norm_ptr(attn.kv_norm), attn.w_uk.data_ptr(), attn.w_uv.data_ptr()
        struct.mla_raw, struct.mla_out = scratch(attn.qkv.out_features), scratch(attn.num_heads * attn.v_dim)
        if attn.uk_heads is not None:
            uk = (_QLinear * attn.num_heads)(*(qlinear_struct(m) for m in attn.uk_heads))
            uv = (_QLinear * attn.num_heads)(*(qlinear_struct(m) for m in attn.uv_heads))
            keep += [uk, uv]  # the block struct points into them
            struct.mla_uk, struct.mla_uv = ctypes.addressof(uk), ctypes.addressof(uv)
    struct.swiglu_alpha, struct.swiglu_limit = config.swiglu_alpha, config.swiglu_limit
    struct.residual_scale = config.residual_multiplier if config.residual_multiplier != 1.0 else 0.0
    struct.qk_norm_full = int(getattr(attn, "qk_norm_full", False))
    if experts:
        struct.router_bias = mlp.router_bias.data_ptr() if mlp.router_bias is not None else None
        gate_ups = (_QLinear * len(experts))(*(qlinear_struct(e.gate_up) for e in experts))
        downs = (_QLinear * len(experts))(*(qlinear_struct(e.down) for e in experts))
        keep += [gate_ups, downs]  # the block struct points into them
        struct.num_experts, struct.top_k, struct.normalize = len(experts), mlp.top_k, int(mlp.normalize)
        struct.routed_scale = mlp.scaling
        struct.expert_sigmoid, struct.expert_groups, struct.expert_groups_used = int(mlp.sigmoid), mlp.groups, mlp.groups_used
        struct.choice_bias = mlp.choice_bias.data_ptr() if mlp.choice_bias is not None else None
        struct.router, struct.router_out = mlp.router.data_ptr(), scratch(len(experts))
        struct.expert_gate_up, struct.expert_down = ctypes.addressof(gate_ups), ctypes.addressof(downs)
    if shared is not None:
        struct.shared_intermediate = shared.intermediate
        struct.shared_gate = mlp.shared_gate.data_ptr() if mlp.shared_gate is not None else None
        struct.shared_gate_up, struct.shared_down = qlinear_struct(shared.gate_up), qlinear_struct(shared.down)
    return struct


class FastDecoder:
    def __init__(self, model: nn.Module):
        self.model = model
        self.library = load()
        config = model.config
        self.hidden, self.num_kv_heads, self.head_dim = config.hidden_size, config.num_kv_heads, config.head_dim
        self._buffers: list[torch.Tensor] = []  # scratch memory the C structs point into
        self._structs: list[ctypes.Array] = []  # the experts' qlinear arrays the block structs point into
        self.blocks = [self._describe(block) for block in model.layers]
        self.k_new = torch.empty(1, config.num_kv_heads, 1, config.head_dim)  # [B, H_kv, S, D]
        self.v_new = torch.empty(1, config.num_kv_heads, 1, config.head_dim)
        self._block_array = (BlockStruct * len(self.blocks))(*self.blocks)  # for the one-call path
        self._windows = torch.tensor([config.window_for(i) or 0 for i in range(config.num_layers)])
        self._rope_index = torch.tensor(model.rope_index)  # [layers] int64, for the C side
        # Kernel rows per C call (its scratch holds that many rows); longer prompts run in several
        # calls, each seeing the positions the earlier ones stored.
        self.max_rows = MAX_ROWS
        # Prompts run the rows step when the C kernel is the many-row path (quantized weights' default,
        # 16-bit weights' on AVX-512 without BF16); with KVGEN_PREFILL_GEMM=fp32|bf16, and 16-bit
        # weights' bf16 kernel or widened GEMM (HalfLinear's default elsewhere), the torch forward.
        self.runs_prompts = all(
            getattr(block.attn.qkv, "prefill", None) == "int8" for block in model.layers  # type: ignore[union-attr]
        )
        self._float_rows = has_half_linears(model.layers)
        self._rows_buffers: list[torch.Tensor] = []  # step_rows' scratch, grown to the most rows seen
        self._rows_scratch = _RowsScratch()
        self._rows_capacity = 0
        self._lora_tables = LoraTables(model, len(self.blocks))
        # Decode steps read cos/sin from tables of ROPE_CHUNK positions (the most recent few kept):
        # computing them per step cost ~0.15 ms of torch calls. LongRoPE picks its factors from
        # the largest position of a call, so its steps compute their own position alone.
        self._rope_tables: dict[int, torch.Tensor] = {}
        self._rope_tabled = not any(isinstance(rope, LongRopeEmbedding) for rope in model.ropes)

    @staticmethod
    def supports(model: nn.Module) -> bool:
        if load() is None or model.dtype != torch.float32:
            return False
        for block in model.layers:
            attn, mlp = getattr(block, "attn", None), getattr(block, "mlp", None)
            latent = isinstance(attn, LatentAttention) and attn.qkv is not None  # V2's query latent: torch path
            if not (isinstance(attn, Attention) or latent) or not isinstance(mlp, GatedMLP | SparseMoE):
                return False
            if not all(isinstance(layer, C_STEP_LINEARS) for layer in (attn.qkv, attn.o_proj, *mlp_linears(mlp))):
                return False
        return True

    def _scratch(self, size: int, dtype: torch.dtype = torch.float32) -> int:
        buffer = torch.zeros(size, dtype=dtype)
        self._buffers.append(buffer)
        return buffer.data_ptr()

    def _describe(self, block: nn.Module) -> BlockStruct:
        return describe_block(self.model.config, block, self._scratch, self._structs)

    def lora(self, slots: list[int]) -> ctypes.Array | None:
        """The C description of the model's LoRA stacks when some row has an adapter (slots[r] >= 0),
        else None (the base-only step). Rebuilt after each restack."""
        return self._lora_tables.for_slots(slots)

    def rope_at(self, position: int) -> torch.Tensor:
        """cos/sin of every RoPE kind at `position`: [kinds, 2, head_dim], the bits a prompt row at
        that position gets (the table is computed as a prompt's rows are, by model._rows_rope)."""
        if not self._rope_tabled:
            return self.model._rows_rope(torch.tensor([position]), torch.float32)[0]
        chunk = position // ROPE_CHUNK
        return self._rope_table(chunk)[position - chunk * ROPE_CHUNK]

    def rope_rows(self, first: int, count: int) -> torch.Tensor:
        """cos/sin of positions first .. first + count - 1: [count, kinds, 2, head_dim], each row
        rope_at's bits. A verify's few rows are sliced from the tables (computing them took ~0.15
        ms a verify); a long prompt's are computed."""
        if not self._rope_tabled or count > ROPE_CHUNK:
            return self.model._rows_rope(torch.arange(first, first + count), torch.float32)
        pieces, position, end = [], first, first + count
        while position < end:  # at most two tables
            chunk = position // ROPE_CHUNK
            stop = min(end, (chunk + 1) * ROPE_CHUNK)
            pieces.append(self._rope_table(chunk)[position - chunk * ROPE_CHUNK : stop - chunk * ROPE_CHUNK])
            position = stop
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _rope_table(self, chunk: int) -> torch.Tensor:
        """cos/sin of the ROPE_CHUNK positions of `chunk`: [ROPE_CHUNK, kinds, 2, head_dim]."""
        table = self._rope_tables.get(chunk)
        if table is None:
            if len(self._rope_tables) >= ROPE_TABLES:
                del self._rope_tables[next(iter(self._rope_tables))]  # the oldest
            first = chunk * ROPE_CHUNK
            table = self.model._rows_rope(torch.arange(first, first + ROPE_CHUNK), torch.float32)
            self._rope_tables[chunk] = table
        return table

    def step(self, h: torch.Tensor, rope: torch.Tensor, cache: KVCache, slot: int = -1,
             num_layers: int | None = None) -> bool:  # fmt: skip
        """Run every block on h [hidden] (updated in place) at position cache.seq_len; commits 1 position.

        rope: [kinds, 2, head_dim] cos/sin of this position for each of model.ropes. slot: the
        token's LoRA adapter slot in model.lora (-1: the base model). num_layers: only the first
        blocks (a layer-skip draft, over its own cache or the target's), over an fp32 cache layout only;
        False (nothing run) where the cache offers none.
        """
        lora = self.lora([slot])
        layout = cache.kernel_layout(cache.seq_len + 1)
        num_layers = len(self.blocks) if num_layers is None else num_layers
        if num_layers != len(self.blocks) and (layout is None or not 1 <= num_layers < len(self.blocks)):
            return False  # the first layers only over an fp32 layout
        codes = cache.codes_view(cache.seq_len + 1) if layout is None else None
        if codes is not None:
            self._step_over_codes(h, rope, cache, codes, lora, slot)
            return True
        if layout is None:
            self._step_through_update(h, rope, cache, lora, slot)
            return True
        keys, values = layout.keys, layout.values
        assert keys.stride() == values.stride() and keys.stride(-1) == 1 and keys.dtype == torch.float32
        table = layout.block_table
        self.library.kvgen_decode_layers(
            self._block_array, num_layers, h.data_ptr(), rope.data_ptr(), self._rope_index.data_ptr(),
            self._windows.data_ptr(), keys.data_ptr(), values.data_ptr(), layout.layer_stride, layout.head_stride,
            layout.pos_stride, layout.block_stride, layout.block_size, table.data_ptr() if table is not None else None,
            cache.seq_len, lora, slot,
        )  # fmt: skip
        cache.commit(1)
        return True

    def step_rows(self, h: torch.Tensor, rope: torch.Tensor, kernel: tuple[str, tuple], positions: torch.Tensor,
                  slots: list[int] | None = None) -> None:  # fmt: skip
        """Every block for one-token rows over one paged store whose batch view offered `kernel`
        (the C step's name and the storage's arguments; the view reserved the rows' slots): h
        [rows, hidden] updated in place; rope [rows, kinds, 2, head_dim]; positions [rows] int64;
        slots: each row's LoRA adapter slot (-1 or None: the base model). The caller commits each
        row's cache."""
        rows = h.shape[0]
        assert h.is_contiguous() and rope.is_contiguous()
        assert slots is None or len(slots) == rows
        name, storage = kernel
        lora = self.lora(slots) if slots is not None else None
        row_slots = torch.tensor(slots, dtype=torch.int64) if lora is not None else None
        getattr(self.library, name)(
            self._block_array, len(self.blocks), rows, h.data_ptr(), rope.data_ptr(), rope.shape[1],
            self._rope_index.data_ptr(), self._windows.data_ptr(), *storage, positions.data_ptr(),
            ctypes.byref(self._scratch_for_rows(rows)), lora, row_slots.data_ptr() if row_slots is not None else None,
        )  # fmt: skip

    def step_tokens(self, h: torch.Tensor, rope: torch.Tensor, cache: KVCache, positions: torch.Tensor, slot: int = -1,
                    num_layers: int | None = None) -> bool:  # fmt: skip
        """Several new tokens of one sequence (a speculative verify, or a piece of a prompt of at
        most `max_rows` tokens), each a kernel row of the rows step at its position, on the cache's
        fp32 layout: h [S, hidden] updated in place, rope
        [S, kinds, 2, head_dim]; commits S positions. Each layer stores every row's key and value
        before any row attends, so row i sees the rows before it, and each row is computed as
        `step` computes a lone token (slot: its LoRA adapter slot, -1: none). num_layers: the first
        blocks only (a layer-skip draft catching up), as in `step`. False (nothing done) when the
        cache offers no fp32 layout."""
        rows = h.shape[0]
        end = cache.seq_len + rows
        layout = cache.kernel_layout(end)
        num_layers = len(self.blocks) if num_layers is None else num_layers
        if layout is None or not 1 <= num_layers <= len(self.blocks):
            return False
        keys, values = layout.keys, layout.values
        assert keys.stride() == values.stride() and keys.stride(-1) == 1 and keys.dtype == torch.float32
        if layout.block_table is not None:
            table, block_size = layout.block_table, layout.block_size
        else:  # one contiguous buffer: one "block" that holds every position
            table, block_size = torch.zeros(1, dtype=torch.int64), end
        tables = table.repeat(rows).contiguous()  # one table per kernel row
        lora = self.lora([slot])
        row_slots = torch.full((rows,), slot, dtype=torch.int64)
        self.library.kvgen_decode_rows(
            self._block_array, num_layers, rows, h.data_ptr(), rope.data_ptr(), rope.shape[1],
            self._rope_index.data_ptr(), self._windows.data_ptr(), keys.data_ptr(), values.data_ptr(),
            layout.layer_stride, layout.head_stride, layout.pos_stride, layout.block_stride, block_size,
            tables.data_ptr(), table.numel(), None, None, positions.data_ptr(), ctypes.byref(self._scratch_for_rows(rows)),
            lora, row_slots.data_ptr(),
        )  # fmt: skip
        cache.commit(rows)
        return True

    def step_tree(self, h: torch.Tensor, cache: KVCache, parents: list[int]) -> bool:
        """The rows of a token tree after the cache (a speculative verify of several drafts at a
        position): row i's parent is row parents[i] (-1: the cache's last position; each parent
        comes before its children). Row i is the token at position seq_len + d (d: how many of its
        ancestors are rows), computed as `step` computes that token after its ancestors: it
        attends to the cache and to its ancestors' keys, in position order. Its key and value go to slot
        seq_len + i; commits len(parents) slots (the caller keeps the accepted path's). h [S, hidden]
        updated in place. False (nothing done) when the cache offers no fp32 layout or the tree is
        wider than one call."""
        rows, start = h.shape[0], cache.seq_len
        assert len(parents) == rows and all(-1 <= p < i for i, p in enumerate(parents)), "parents come first"
        layout = cache.kernel_layout(start + rows) if rows <= self.max_rows else None
        if layout is None:
            return False
        keys, values = layout.keys, layout.values
        assert keys.stride() == values.stride() and keys.stride(-1) == 1 and keys.dtype == torch.float32
        paths: list[list[int]] = []  # each row's ancestors and itself, root first: their slots
        for parent in parents:
            paths.append((paths[parent] if parent >= 0 else []) + [start + len(paths)])
        deepest = max(len(path) for path in paths)
        # Each row reads the cache as it is, then its path's keys and values at their element offsets.
        tails = layout.position_offsets(torch.tensor([path + [start] * (deepest - len(path)) for path in paths])).contiguous()
        depth = torch.tensor([len(path) - 1 for path in paths])
        positions = start + depth
        rope = self.rope_rows(start, deepest)[depth].contiguous()
        table = layout.block_table
        self.library.kvgen_decode_tree(
            self._block_array, len(self.blocks), rows, h.data_ptr(), rope.data_ptr(), rope.shape[1],
            self._rope_index.data_ptr(), self._windows.data_ptr(), keys.data_ptr(), values.data_ptr(),
            layout.layer_stride, layout.head_stride, layout.pos_stride, layout.block_stride, layout.block_size,
            table.data_ptr() if table is not None else None, tails.data_ptr(), deepest, start,
            positions.data_ptr(), ctypes.byref(self._scratch_for_rows(rows)),
        )  # fmt: skip
        cache.commit(rows)
        return True

    def _scratch_for_rows(self, rows: int) -> _RowsScratch:
        if rows > self._rows_capacity:
            config = self.model.config
            self._rows_buffers, self._rows_scratch = rows_scratch_for(config, rows, self._float_rows)
            self._rows_capacity = rows
        return self._rows_scratch

    def _step_over_codes(self, h: torch.Tensor, rope: torch.Tensor, cache: KVCache, codes: CodesView,
                         lora: ctypes.Array | None, slot: int) -> None:  # fmt: skip
        """Every block in one call over a cache of packed codes: attention reads the codes."""
        self.library.kvgen_decode_layers_over_codes(
            self._block_array, len(self.blocks), h.data_ptr(), rope.data_ptr(), self._rope_index.data_ptr(),
            self._windows.data_ptr(), ctypes.byref(codes.storage), codes.num_packed_blocks, cache.seq_len, lora, slot,
        )  # fmt: skip
        cache.commit(1)

    def _step_through_update(self, h: torch.Tensor, rope: torch.Tensor, cache: KVCache, lora: ctypes.Array | None,
                             slot: int) -> None:  # fmt: skip
        """The general path: each block's new key/value goes through cache.update()."""
        config, lib = self.model.config, self.library
        position = cache.seq_len
        ropes = [(rope[kind, 0], rope[kind, 1]) for kind in self.model.rope_index]
        h_ptr, k_ptr, v_ptr = h.data_ptr(), self.k_new.data_ptr(), self.v_new.data_ptr()
        for layer, block in enumerate(self.blocks):
            cos, sin = ropes[layer]
            this_lora = layer_lora(lora, layer)
            lib.kvgen_block_pre(ctypes.byref(block), h_ptr, cos.data_ptr(), sin.data_ptr(), k_ptr, v_ptr, this_lora, slot)
            keys, values = cache.update(layer, self.k_new, self.v_new)  # [1, H_kv, L, D] views
            assert keys.dtype == torch.float32 and keys.stride(3) == 1 and values.stride(3) == 1
            span = cache.attention_span(layer, config.window_for(layer))
            start, end = span.decode_start(position, cache.visible_start(layer)), keys.shape[2]
            lib.kvgen_block_post(ctypes.byref(block), h_ptr, keys.data_ptr(), keys.stride(1), keys.stride(2),
                                 values.data_ptr(), values.stride(1), values.stride(2), start, end, this_lora, slot)  # fmt: skip
        cache.commit(1)
