"""The engine's budget and scheduler for models that keep their own state (Mamba, Mamba-2, T5) instead of
K/V in the paged block pool (engine/state_scheduler.py says how they are scheduled)."""

from __future__ import annotations

from kvgen.config import CacheConfig
from kvgen.engine.config import EngineConfig
from kvgen.engine.state_scheduler import StateBudget, StateScheduler
from kvgen.kv.state_prefix import StatePrefixIndex
from kvgen.models.granite_hybrid import GraniteHybridModel
from kvgen.models.mamba import MambaModel
from kvgen.models.mamba2 import Mamba2Model
from kvgen.models.t5 import T5Model


def state_backend(model: MambaModel | Mamba2Model | GraniteHybridModel | T5Model, config: EngineConfig, cache: CacheConfig) -> tuple[StateBudget, StateScheduler]:
    """(budget, scheduler) for a state model; ValueError naming the option the engine cannot honour."""
    name = model.config.architecture
    if cache != CacheConfig():
        raise ValueError(f"KV cache option {cache.kind!r} does not apply to {name} models, which keep their own state; "
                         "use the default cache settings")  # fmt: skip
    if config.kv_cache_dir is not None:
        raise ValueError(f"kv_cache_dir keeps K/V blocks on disk; {name} models have none: leave kv_cache_dir unset")
    if config.eviction != "lru":
        raise ValueError(f"eviction {config.eviction!r}: the {name} engine's prefix cache evicts least recently used "
                         "snapshots only; use eviction='lru'")  # fmt: skip
    budget_bytes = int(config.kv_budget_mb * 2**20)
    if isinstance(model, GraniteHybridModel):
        return _hybrid_backend(model, config, budget_bytes)
    if isinstance(model, (MambaModel, Mamba2Model)):
        unit = model.new_state_cache().spec.bytes_per_snapshot  # one live state, or one prefix snapshot
        budget = StateBudget(f"{name}-state-{unit}", unit, config.num_blocks or budget_bytes // unit, config.block_size,
                             lambda num_prompt, num_new: 1)  # fmt: skip
        # One forward captures at most a step's worth of block boundaries; they are handed over before the next.
        keep = config.max_tokens_per_step // config.block_size + 2
        prefix = StatePrefixIndex(config.block_size, budget.num_units) if config.prefix_cache else None
        scheduler = StateScheduler(budget, config, lambda _: model.new_state_cache(config.block_size, keep), False, prefix)
        return budget, scheduler
    if isinstance(model, T5Model):
        c = model.config
        element = model.dtype.itemsize
        unit = c.num_decoder_layers * 2 * c.num_heads * c.d_kv * element  # K and V of one position, every decoder layer
        # The encoder input's cross-attention K/V (counted per request, though requests with the same
        # input share it) and the decoder's self-attention K/V: the start token plus every new token.
        budget = StateBudget(f"t5-kv-{unit}", unit, config.num_blocks or budget_bytes // unit, config.block_size,
                             lambda num_prompt, num_new: num_prompt + num_new + 1)  # fmt: skip
        # A request's salt keys its encoder entry: tenants never share one.
        return budget, StateScheduler(budget, config, lambda request: model.new_state_cache(request.salt), True, None)
    raise ValueError(f"{name} models are not served by the engine: it runs decoder-only transformers, Mamba, Mamba-2, Granite 4.0-H and T5")


def _hybrid_backend(model: GraniteHybridModel, config: EngineConfig, budget_bytes: int) -> tuple[StateBudget, StateScheduler]:
    """A hybrid request reserves its Mamba layers' state and its attention layers' K/V for its
    longest length, counted in positions of K/V (the state as that many positions' bytes). Its
    prefix cache keeps the states at block boundaries with each block's keys and values."""
    cache = model.new_state_cache()
    unit = cache.kv.spec.bytes_per_token
    state_units = -(-cache.spec.bytes_per_snapshot // unit)
    budget = StateBudget(f"granitemoehybrid-{unit}", unit, config.num_blocks or budget_bytes // unit, config.block_size,
                         lambda num_prompt, num_new: state_units + num_prompt + num_new)  # fmt: skip
    keep = config.max_tokens_per_step // config.block_size + 2
    prefix = StatePrefixIndex(config.block_size, budget.num_units, state_units, config.block_size) if config.prefix_cache else None
    return budget, StateScheduler(budget, config, lambda _: model.new_state_cache(config.block_size, keep), False, prefix)
