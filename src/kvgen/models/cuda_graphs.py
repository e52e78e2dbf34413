"""One-token decode steps of a model on a CUDA GPU, replayed from captured CUDA graphs.

A small model's decode step is hundreds of tiny kernels; launched one by one from Python, the GPU
waits on the host between them. Captured once into a CUDA graph, a step is one launch. A graph
bakes in every address and shape, so what changes between steps lives in device tensors the graph
reads: the token, and the position — written in place by a fill kernel before a replay, or
advanced by the graph itself when it runs several greedy steps back to back (`greedy`), so those
steps need no host work at all between them.

The cache offers storage through the contract's `static_buffers` (a GPU ContiguousCache:
zero-filled, keys and values in one allocation). A graph attends over a fixed bucket of its
positions (a power of two, at least MIN_BUCKET) under a mask built on the device from the
position, and writes the step's keys and values with index_copy_ at that position; one graph per
(buffers, capacity, bucket), captured on first use and kept (few: a released GPU cache hands its
memory back, so the next cache of that size gets the same address). Steps the graphs cannot run —
LongRoPE (it picks factors on the host), attention sinks or chunked spans, a biased cache, a cache
without static buffers on the model's device — take the eager torch path (`step` returns None).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

from kvgen.kv.interface import KVCache
from kvgen.models.layers import AttentionMask
from kvgen.models.rotary import LongRopeEmbedding

MIN_BUCKET = 256  # fewest positions a graph attends over: short sequences share one graph
MAX_GRAPHS = 32  # captured graphs kept (least recently used go first)


def device_capacity(num_tokens: int, max_context: int) -> int:
    """A GPU cache's first capacity: a power of two >= MIN_BUCKET (so few shapes recur), capped."""
    return min(bucket_for(num_tokens - 1, 1 << 62), max_context)


def bucket_for(position: int, capacity: int) -> int:
    """Positions 0..position fit in the smallest power of two >= MIN_BUCKET (capped by capacity)."""
    bucket = MIN_BUCKET
    while bucket <= position:
        bucket *= 2
    return min(bucket, capacity)


class _PositionedKV:
    """What a block's attention sees while a graph is captured: `update` writes the step's keys and
    values at the device-side position and returns the bucket's keys and values."""

    def __init__(self, buffers: tuple[torch.Tensor, torch.Tensor], position: torch.Tensor, bucket: int):
        self.keys, self.values = buffers  # [L, 1, H, C, D]
        self.position, self.bucket = position, bucket

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys[layer].index_copy_(2, self.position, keys)  # keys [1, H, 1, D] at position
        self.values[layer].index_copy_(2, self.position, values)
        return self.keys[layer, :, :, : self.bucket], self.values[layer, :, :, : self.bucket]


class _Graph:
    """A captured step (or greedy step) and the static tensor it writes its result to."""

    def __init__(self, run: Callable[[], torch.Tensor], capture: bool, pool: object | None):
        self.run: Callable[[], torch.Tensor] | None = run
        self.graph: torch.cuda.CUDAGraph | None = None
        if capture:  # warm up on a side stream (lazy inits, autotuning), then capture
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                run()
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.output = run()
            self.run = None  # the graph holds addresses only: nothing keeps the cache buffers alive

    def replay(self) -> torch.Tensor:
        if self.graph is None:  # eager: the same computation, for CPU tests of the graphs' math
            assert self.run is not None
            return self.run()
        self.graph.replay()
        return self.output


class CudaGraphDecoder:
    """Decode steps of one model (on a CUDA device) from CUDA graphs; `capture=False` runs the very
    same computation eagerly (how the tests check its math on the CPU)."""

    def __init__(self, model, capture: bool | None = None, compiled: bool = False):  # model: DecoderLM
        self.model = model
        device = model.device
        self.capture = device.type == "cuda" if capture is None else capture
        # compiled: the step runs through torch.compile before it is captured, so the norms, rotary
        # and activations replay as a few fused kernels instead of many small ones (an H200, random
        # weights on the real shapes: 1.7-2.9x the plain graphs; each new bucket compiles once).
        # Fused bf16 rounds apart from the unfused kernels: logits stay as close to fp32.
        self._step = torch.compile(self._forward, dynamic=False) if compiled else self._forward
        self.token = torch.zeros((1, 1), dtype=torch.long, device=device)  # the step's input token
        self.position = torch.zeros((1,), dtype=torch.long, device=device)  # where it goes in the cache
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.captures = 0  # graphs captured so far (tests check that requests reuse them)
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None  # graphs replay one at a time
        config = model.config
        self.windows = [config.window_for(i) for i in range(config.num_layers)]
        self.runs_graphs = not any(isinstance(rope, LongRopeEmbedding) for rope in model.ropes)
        if compiled and not self.runs_graphs:
            raise ValueError("torch_compile compiles the decode step that CUDA graphs replay, and this model's "
                             "LongRoPE picks its factors on the host each step, so its steps run eagerly: "
                             "load it without torch_compile")  # fmt: skip

    def supports(self, cache: KVCache) -> bool:
        """Whether graphs can run this cache's steps (else the eager path runs them)."""
        if not self.runs_graphs or cache.key_bias() is not None:
            return False
        buffers = cache.static_buffers(cache.seq_len)
        if buffers is None or buffers[0].device != self.model.device:
            return False
        span = cache.attention_span(0, None)  # what the cache imposes on every layer (checked once a step)
        return not span.sinks and span.chunk is None

    def _buffers(self, cache: KVCache, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The cache's storage with room for num_tokens, where graphs can run its steps."""
        return cache.static_buffers(num_tokens) if self.supports(cache) else None

    def step(self, input_ids: torch.Tensor, cache: KVCache) -> torch.Tensor | None:
        """input_ids [1, 1] -> logits [1, 1, V] (a copy), the token's keys and values appended to the
        cache; None when a graph cannot run this step."""
        start = cache.seq_len
        buffers = self._buffers(cache, start + 1)
        if buffers is None:
            return None
        self.token.copy_(input_ids)
        self.position.fill_(start)
        graph = self._graph(buffers, bucket_for(start, buffers[0].shape[3]), steps=1)
        logits = graph.replay().clone()
        cache.commit(1)
        return logits

    def greedy(self, token: int, cache: KVCache, steps: int) -> list[int] | None:
        """Feed `token` and greedy-decode `steps` tokens without returning to the host in between:
        each replay appends its input's keys and values, writes the argmax as the next input and
        advances the device-side position. -> the `steps` new tokens (the cache then holds `token`
        and all but the last of them); None when a graph cannot run them."""
        start = cache.seq_len
        buffers = self._buffers(cache, start + steps)
        if buffers is None:
            return None
        out = torch.empty(steps, dtype=torch.long, device=self.token.device)
        self.token.fill_(token)
        self.position.fill_(start)
        done = 0
        while done < steps:  # one bucket's graph at a time: a run stays inside its bucket
            bucket = bucket_for(start + done, buffers[0].shape[3])
            run = min(steps - done, bucket - (start + done))
            graph = self._graph(buffers, bucket, steps=0)
            for _ in range(run):
                out[done] = graph.replay()[0]  # a device copy, queued: no host sync
                done += 1
        cache.commit(steps)
        return out.tolist()  # the one sync of the run

    def _graph(self, buffers: tuple[torch.Tensor, torch.Tensor], bucket: int, steps: int) -> _Graph:
        """steps=1: a step that returns logits; steps=0: a greedy step (argmax fed back, position
        advanced) that returns its token."""
        keys, values = buffers
        key = (keys.data_ptr(), values.data_ptr(), keys.shape, bucket, steps)
        graph = self.graphs.get(key)
        if graph is None:
            view = _PositionedKV(buffers, self.position, bucket)
            run = (lambda: self._step(view)) if steps == 1 else (lambda: self._greedy_step(view))
            # The warm-up runs the step for real: it writes this very step's keys and values (the
            # replay writes them again), but a greedy step also moves the token and position on.
            token, position = self.token.clone(), self.position.clone()
            graph = _Graph(run, self.capture, self._pool)
            self.token.copy_(token)
            self.position.copy_(position)
            self.captures += self.capture
            self.graphs[key] = graph
            while len(self.graphs) > MAX_GRAPHS:
                self.graphs.popitem(last=False)
        self.graphs.move_to_end(key)
        return graph

    def _greedy_step(self, view: _PositionedKV) -> torch.Tensor:
        logits = self._step(view)[0, -1]  # [V]
        chosen = torch.argmax(logits).view(1)  # the first of equal maxima, as the host sampler picks
        self.token.copy_(chosen.view(1, 1))
        self.position.add_(1)
        return chosen

    def _forward(self, view: _PositionedKV) -> torch.Tensor:
        """The step itself, all device tensors: embed the token, run every block over the bucket, logits."""
        model, bucket = self.model, view.bucket
        h = model._embed(self.token)  # [1, 1, H]
        positions = self.position.view(1, 1)
        ropes = [rope(positions, h.dtype) for rope in model.ropes]
        keys = torch.arange(bucket, device=h.device)
        seen = keys <= self.position  # [bucket]: causal, and written slots only
        masks: dict[int | None, AttentionMask] = {}
        for i, block in enumerate(model.layers):
            window = self.windows[i]
            if window not in masks:
                allowed = seen if window is None else seen & (self.position - keys < window)
                masks[window] = AttentionMask(allowed.view(1, 1, 1, bucket), False)
            h = block(h, ropes[model.rope_index[i]], view, masks[window])
        return model._logits(h)  # [1, 1, V]
