"""CacheFactory: the one place where a CacheConfig becomes caches.

Every cache kvgen makes goes through here: the Generator's per-request caches (and so Session,
`generate_n`, speculative targets), the draft caches of speculative proposers (contiguous: exact
rewinds), the engine's block storage (so `generate_batch` and the server), and the quantized caches
`kv-check` scores. Each cache kind declares the options it takes
(config.KIND_OPTIONS; CacheConfig refuses the others); the engine's pool refuses the kinds and
options it cannot honour here, at start, with the option named.

kvquant3 codecs are calibrated on the model (kv/kvquant.py), so this module sits above kv/ and
models/ and imports both; kv/ imports no model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvgen.config import DEFAULT_RESIDUAL, CacheConfig
from kvgen.kv.block_pool import BlockPool
from kvgen.kv.codecs import Codec, key_codec, value_codec
from kvgen.kv.compressed import CompressedCache
from kvgen.kv.contiguous import ContiguousCache
from kvgen.kv.interface import CacheSpec, KVCache
from kvgen.kv.kvquant import KVQuantKeyCodec, KVQuantValueCodec
from kvgen.kv.layer_groups import LayerGroups
from kvgen.kvquant_calibration import codebooks_for, key_rope_of, outliers_for
from kvgen.kv.paged import PagedCache, PagedStorage
from kvgen.kv.paged_codes import QuantizedPagedStorage
from kvgen.kv.paged_codes_cache import QuantizedPagedCache
from kvgen.kv.paged_hybrid import HybridPagedCache
from kvgen.kv.quantized import QuantizedCache
from kvgen.kv.sinks import SinkCache
from kvgen.kv.tiered import TieredCache
from kvgen.kv.window import WindowedCache
from kvgen.models.base import DecoderLM
from kvgen.models.cuda_graphs import device_capacity

# Cache kinds the engine's block pool runs: fp32 blocks for contiguous and paged, blocks of codes
# for quantized. Window, sinks, chunked, compressed and tiered caches are per-sequence designs.
ENGINE_KINDS = ("contiguous", "paged", "quantized")
BlockStorage = PagedStorage | QuantizedPagedStorage


def check_engine_cache(config: CacheConfig) -> None:
    """Refuse, naming what to change, a cache config the engine's block pool cannot honour."""
    if config.kind not in ENGINE_KINDS:
        raise ValueError(
            f"the engine (server, generate_batch) runs requests on a paged block pool of fp32 blocks or blocks "
            f"of K/V codes; the {config.kind!r} cache is per-sequence: use --kv-cache paged, or --kv-cache "
            f"quantized with --kv-dtype-k/--kv-dtype-v"
        )
    if config.residual is not None:
        raise ValueError(
            f"the engine's quantized pool keeps each sequence's unfilled block in fp32, not a residual window: "
            f"drop residual ({config.residual}, --kv-residual)"
        )


class CacheFactory:
    def __init__(self, config: CacheConfig, model: DecoderLM, tokenizer: Any, max_context: int,
                 num_layers: int | None = None):  # fmt: skip
        """num_layers: caches for the model's first layers only (a layer-skip draft)."""
        self.config, self.model, self.tokenizer, self.max_context = config, model, tokenizer, max_context
        self._num_layers = num_layers
        self._paged_storage: PagedStorage | None = None  # the "paged" kind's pool, shared by all requests

    @property
    def paged_storage(self) -> PagedStorage | None:
        """The pool the "paged" kind's requests share (None until the first one)."""
        return self._paged_storage

    @property
    def spec(self) -> CacheSpec:
        """What one K/V cache of this model stores (asked only of models with K/V caches)."""
        spec = CacheSpec.for_model(self.model.config, self.model.dtype)
        return dataclasses.replace(spec, num_layers=self._num_layers or spec.num_layers)

    def codecs(self, k_dtype: str, v_dtype: str) -> tuple[Codec, Codec]:
        """The key and value codecs of two KV dtypes; kvquant3 is calibrated on the model (once)."""
        scaling = self.model.config.rope_scaling
        if k_dtype == "kvquant3" and scaling is not None and scaling.kind == "longrope":
            # Keys stored before RoPE are turned at read time by position alone; LongRoPE's rotation
            # also depends on how long the sequence has grown, so the read would be wrong.
            raise ValueError("k_dtype 'kvquant3' stores keys before RoPE, which LongRoPE (Phi-3) models cannot use; "
                             "choose another key dtype (e.g. int8 or int4)")
        books = codebooks_for(self.model, self.tokenizer) if "kvquant3" in (k_dtype, v_dtype) else None
        key = KVQuantKeyCodec(books.keys, outliers_for(self.spec.head_dim)) if books and k_dtype == "kvquant3" else None
        value = KVQuantValueCodec(books.values) if books and v_dtype == "kvquant3" else None
        return key or key_codec(k_dtype), value or value_codec(v_dtype)

    def quantized(self, capacity: int, k_dtype: str, v_dtype: str, residual: int | None = None) -> QuantizedCache:
        """A single-sequence QuantizedCache (also what kv-check scores)."""
        key, value = self.codecs(k_dtype, v_dtype)
        residual = DEFAULT_RESIDUAL if residual is None else residual
        return QuantizedCache(self.spec, capacity, self.max_context, key, value, residual, key_rope=key_rope_of(self.model))

    def new_cache(self, num_tokens: int) -> KVCache:
        """An empty cache of the configured kind, with room for `num_tokens` (more can come later)."""
        c, capacity = self.config, min(num_tokens, self.max_context)
        if hasattr(self.model, "new_state_cache"):  # Mamba's fixed-size state, T5's encoder entry + decoder KV
            if c != CacheConfig():
                raise ValueError(f"KV cache option {c.kind!r} does not apply to {self.model.config.architecture} "
                                 "models, which keep their own state; use the default cache settings")
            return self.model.new_state_cache()  # type: ignore[operator]
        if self.model.device.type != "cpu":
            return self._device_cache(capacity)
        if c.kind == "paged":
            if self._paged_storage is None:
                self._paged_storage = PagedStorage.create(self.spec, c.budget_mb, c.block_size)
            return PagedCache(self._paged_storage)
        if c.kind in ("window", "chunked"):
            return WindowedCache.for_model(self.model.config, self.model.dtype, capacity, c.window, c.chunk, c.extra)
        if c.kind == "sinks":
            assert c.window is not None  # CacheConfig checked it
            return SinkCache.for_model(self.model.config, self.model.dtype, c.sinks, c.window, self.model.rerotate)
        if c.kind == "quantized":
            return self.quantized(capacity, c.k_dtype, c.v_dtype, c.residual)
        if c.kind == "tiered":
            return TieredCache(self.spec, c.block_size, c.hot_tokens, c.warm_tokens, c.warm_dtype)
        if c.kind == "compressed":
            if any(self.model.config.window_for(i) for i in range(self.model.config.num_layers)):
                raise ValueError("the compressed cache is for full-attention models; for sliding-window layers use --kv-cache window")
            return CompressedCache(self.spec, c.pool_chunk, c.exact_window, c.sinks, capacity=capacity)
        return ContiguousCache(self.spec, capacity=capacity, max_capacity=self.max_context)

    def _device_cache(self, capacity: int) -> ContiguousCache:
        """A GPU model's cache: contiguous, on its device, sized in powers of two so that requests
        of similar lengths reuse the same buffers (and the CUDA graphs captured over them)."""
        device = self.model.device
        if self.config != CacheConfig():
            raise ValueError(f"KV cache kind {self.config.kind!r} and its options run on the CPU; a model on {device} "
                             "keeps its keys and values in the default contiguous cache: drop the --kv-* options")
        return ContiguousCache(self.spec, device_capacity(capacity, self.max_context), max_capacity=self.max_context,
                               device=device)  # fmt: skip

    @staticmethod
    def engine_cache(storage: BlockStorage) -> PagedCache:
        """An empty sequence over the engine's block storage, whatever its format."""
        if isinstance(storage, QuantizedPagedStorage):
            return QuantizedPagedCache(storage)
        return PagedCache(storage) if storage.groups.is_single else HybridPagedCache(storage)

    def block_storage(self, block_size: int, num_slots: int, budget_mb: float | None = None,
                      num_blocks: int | None = None, layer_groups: bool = True) -> BlockStorage:  # fmt: skip
        """The engine's block storage: fp32 blocks, or blocks of codes with `num_slots` fp32 staging
        slots whose bytes come out of `budget_mb` (or exactly `num_blocks` blocks). Blocks of a
        model with sliding-window layers are split into layer groups (kv/layer_groups.py), so the
        pages a window no longer sees go back to the pool, unless `layer_groups` is False."""
        check_engine_cache(self.config)
        c = self.config
        if c.kind != "quantized":
            groups = LayerGroups.for_model(self.model.config) if layer_groups else None
            if num_blocks is not None:
                return PagedStorage(self.spec, BlockPool(num_blocks, block_size), groups)
            return PagedStorage.create(self.spec, budget_mb or 0, block_size, groups)
        key, value = self.codecs(c.k_dtype, c.v_dtype)
        if num_blocks is None:
            slots = num_slots * QuantizedPagedStorage.slot_bytes(self.spec, block_size)
            per_block = QuantizedPagedStorage.bytes_per_block_for(self.spec, key, value, block_size)
            num_blocks = int((budget_mb or 0) * 2**20 - slots) // per_block
            if num_blocks < 1:
                raise ValueError(
                    f"a KV budget of {budget_mb} MB does not hold the {num_slots} fp32 staging slots "
                    f"({slots / 2**20:.1f} MB) and one block of {c.k_dtype}/{c.v_dtype} codes "
                    f"({per_block / 2**20:.2f} MB): raise --kv-budget-mb or lower --max-num-seqs"
                )
        pool = BlockPool(num_blocks, block_size)
        rope = key_rope_of(self.model) if key.keys_before_rope else None
        return QuantizedPagedStorage(self.spec, pool, key, value, num_slots, rope, self.max_context)


def build_quantized_cache(model: DecoderLM, tokenizer: Any, capacity: int, max_capacity: int, k_dtype: str,
                          v_dtype: str, residual: int | None = None) -> QuantizedCache:  # fmt: skip
    """A single-sequence QuantizedCache for `model` (kvquant3 codecs calibrated on it)."""
    return CacheFactory(CacheConfig(), model, tokenizer, max_capacity).quantized(capacity, k_dtype, v_dtype, residual)
