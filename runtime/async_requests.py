"""The batching engine's generations for asyncio code, as async iterators.

    request = pipe.generate_async("Name a city.", max_new_tokens=16)  # checked here, submitted when first awaited
    async for chunk in request:                                        # Chunks as the engine commits them
        ...
    request.result                                                     # the GenerationResult, once the loop ends
    result = await pipe.generate_async(prompt).wait()

The request goes to the engine at its first `async for`, `wait()` or `next_event()`, inside the event loop that
awaits it: the engine's thread hands every event to that loop (call_soon_threadsafe), which never blocks on the
engine. A consumer that stops early (leaves the loop, or its task is cancelled: a client gone) stops the generation
at the engine's next step, as `cancel()` does.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from mirror_sd.runtime.batching import BatchEngine, Finished, Request
from mirror_sd.runtime.config import GenerationConfig
from mirror_sd.runtime.result import Chunk, GenerationResult


class AsyncRequest:
    """One generation for the engine, from an event loop. `async for` it once for its Chunks; `result` is set when
    the loop ends normally, and an engine failure (EngineClosed, a target error) is raised there."""

    def __init__(self, engine: BatchEngine, ids: list[int], config: GenerationConfig) -> None:
        self._engine, self._ids, self._config = engine, ids, config
        self._events: asyncio.Queue = asyncio.Queue()
        self._request: Request | None = None
        self._cancelled = False
        self._finished: Finished | None = None  # the last event, once read: iterating or waiting again gives it
        self.result: GenerationResult | None = None

    def submit(self) -> None:
        """Hand the request to the engine now, from the running loop (which then gets its events); the first await
        does it otherwise. A caller that checked the engine's room submits at once, before another task runs."""
        if self._request is None:
            loop = asyncio.get_running_loop()
            self._request = self._engine.submit(self._ids, self._config, listener=lambda event: (
                loop.call_soon_threadsafe(self._events.put_nowait, event)))
            if self._cancelled:
                self._request.cancel()

    @property
    def admitted(self) -> bool:
        """Whether the engine has given it a KV slot (it no longer waits in the queue)."""
        return self._request is not None and self._request.admitted is not None

    def cancel(self) -> None:
        """Stop at the engine's next step; the result then says finish_reason "cancelled"."""
        self._cancelled = True
        if self._request is not None:
            self._request.cancel()

    async def next_event(self) -> Chunk | Finished:
        """The next event as the engine sent it: a Chunk, then one Finished (for callers that time each wait), which
        every later call, iteration or wait gives again."""
        if self._finished is not None:
            return self._finished
        self.submit()
        event = await self._events.get()
        if isinstance(event, Finished):
            self._finished = event
            self.result = event.result if event.error is None else None
        return event

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        finished = False
        try:
            while True:
                event = await self.next_event()
                if isinstance(event, Finished):
                    finished = True
                    if event.error is not None:
                        raise event.error
                    return
                yield event
        finally:
            if not finished:  # left early or cancelled: nobody reads what comes next
                self.cancel()

    async def wait(self) -> GenerationResult:
        """Await the whole generation; its result."""
        async for _ in self:
            pass
        return self.result
