"""AsyncLLMEngine: the engine stepped on its own thread, with an asyncio front for the server.

The event loop never waits for a forward pass: `generate` validates on the caller's thread (pure
work), then hands the request to the engine thread through a command queue, and receives outputs
through an asyncio.Queue fed with `call_soon_threadsafe`. Leaving the `async for` early (a client
that disconnected, a cancelled task) cancels the request, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterator, Sequence

from kvgen.engine.engine import LLMEngine
from kvgen.engine.request import Request, RequestOutput
from kvgen.sampling.params import SamplingParams
from kvgen.speculative.config import SpeculativeConfig

log = logging.getLogger(__name__)


@dataclass
class _Subscriber:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._subscribers: dict[str, _Subscriber] = {}
        self._wakeup = threading.Event()
        self._stopped = False
        self._state_lock = threading.Lock()  # guards reads of engine state from other threads (metrics)
        self._thread = threading.Thread(target=self._run, name="kvgen-engine", daemon=True)
        self._thread.start()

    async def generate(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams, priority: int = 0, salt: str = "",
        speculative: SpeculativeConfig | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they are produced; the last has finished=True.
        Raises ValueError (before anything is queued) when the request cannot run."""
        request = self.engine.make_request(request_id, prompt, params, priority, salt, speculative)
        async for output in self.run(request):
            yield output

    async def run(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Outputs of a request built (and so validated) already by `engine.make_request`."""
        subscriber = _Subscriber(asyncio.get_running_loop(), asyncio.Queue())
        self._subscribers[request.request_id] = subscriber
        self._submit(lambda: self._add(request))
        finished = False
        try:
            while not finished:
                output = await subscriber.outputs.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.cancel(request.request_id)

    def prompt_length(self, prompt: str | Sequence[int]) -> int:
        return len(self.engine.tokenizer.encode(prompt)) if isinstance(prompt, str) else len(prompt)

    def cancel(self, request_id: str) -> None:
        self._subscribers.pop(request_id, None)
        self._submit(lambda: self.engine.cancel(request_id))

    def run_locked(self, fn: Callable[[LLMEngine], object]) -> object:
        """Read engine state consistently from another thread (between steps)."""
        with self._state_lock:
            return fn(self.engine)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Hold the engine between steps: requests submitted meanwhile queue up and all reach the
        scheduler at the next step (a burst that arrives at once, whatever the machine's speed)."""
        with self._state_lock:
            yield

    def num_queued_commands(self) -> int:
        """Submissions and cancellations the engine thread has not taken yet."""
        return self._commands.qsize()

    def is_running(self) -> bool:
        """Whether the engine thread still steps (a replica's health check)."""
        return self._thread.is_alive() and not self._stopped

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)
        with self._state_lock:  # the prefix index goes to the disk tier, for the next start
            self.engine.close()

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _add(self, request: Request) -> None:
        if request.request_id not in self._subscribers:  # cancelled before it reached the engine
            request.release_speculation()
            return
        try:
            self.engine.add(request)
        except (ValueError, LookupError) as error:  # LookupError: its LoRA adapter was unloaded since it was built
            self._deliver([request.abort("error", str(error))])

    def _run(self) -> None:
        while not self._stopped:
            self._wakeup.wait(timeout=0.5)
            self._wakeup.clear()
            while self.engine.has_unfinished() or not self._commands.empty():
                forwards = self.engine.runner.num_forwards
                with self._state_lock:
                    while not self._commands.empty():
                        self._commands.get()()
                    try:
                        outputs = self.engine.step()
                    except Exception:  # noqa: BLE001 - a bug in one step must not stop the server
                        log.exception("engine step failed; failing every request")
                        outputs = [self.engine.fail(rid, "internal engine error") for rid in list(self.engine.requests)]
                        outputs = [o for o in outputs if o is not None]
                self._deliver(outputs)
                if self._stopped:
                    return
                if self.engine.runner.num_forwards == forwards:  # nothing could run: don't spin
                    self._wakeup.wait(timeout=0.01)
                    self._wakeup.clear()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            subscriber = self._subscribers.get(output.request_id)
            if subscriber is None:
                continue
            if output.finished:
                del self._subscribers[output.request_id]
            subscriber.loop.call_soon_threadsafe(subscriber.outputs.put_nowait, output)
