"""Request streams: the event-loop side of a request, where its deltas merge into chunks a client reads.

Each request's deltas are merged into one pending `StreamChunk` (a queue of depth one that
coalesces), so a slow client receives bigger chunks instead of stalling anyone. Used on the event
loop's thread only; the AsyncEngine pushes deltas in with `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ppserve.engine.messages import RequestTimes, TokenDelta
from ppserve.request import TokenLogprob


@dataclass
class StreamChunk:
    """New output of one request since the last chunk the client took (its deltas merged)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    token_times: list[float] = field(default_factory=list)  # engine clock
    num_output_tokens: int = 0  # cumulative
    finished: bool = False
    finish_reason: str | None = None
    times: RequestTimes | None = None  # on the last chunk
    logprobs: list[TokenLogprob] = field(default_factory=list)  # aligned with token_ids, when asked for
    num_cached_tokens: int = 0  # on the last chunk: prompt tokens the prefix cache supplied

    def merge(self, d: TokenDelta) -> None:
        self.token_ids.extend(d.token_ids)
        self.logprobs.extend(d.logprobs)
        self.text += d.text
        self.token_times.extend(d.token_times)
        if d.finished:
            self.finished, self.finish_reason, self.times = True, d.finish_reason, d.times
            self.num_cached_tokens = d.num_cached_tokens


class RequestStream:
    """The event-loop side of one request: merges deltas; iterate it to receive chunks."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = 0
        self._pending: StreamChunk | None = None
        self._event = asyncio.Event()
        self._num_output = 0
        self._done = False

    def push(self, delta: TokenDelta) -> None:
        """Merge a delta into the pending chunk (event loop only; a finished stream drops it)."""
        if self._done or (self._pending is not None and self._pending.finished):
            return
        if self._pending is None:
            self._pending = StreamChunk(self.request_id)
        self._pending.merge(delta)
        self._event.set()

    async def next_chunk(self) -> StreamChunk | None:
        """The merged output since the last call; None after the final chunk."""
        if self._done:
            return None
        await self._event.wait()
        self._event.clear()
        chunk, self._pending = self._pending, None
        assert chunk is not None
        self._num_output += len(chunk.token_ids)
        chunk.num_output_tokens = self._num_output
        self._done = chunk.finished
        return chunk

    def __aiter__(self) -> AsyncIterator[StreamChunk]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[StreamChunk]:
        while (chunk := await self.next_chunk()) is not None:
            yield chunk


async def merge_choices(streams: list[RequestStream]) -> AsyncIterator[tuple[int, StreamChunk]]:
    """(choice index, chunk) from several streams as each has output, until every one has finished."""
    if len(streams) == 1:
        async for chunk in streams[0]:
            yield 0, chunk
        return
    waiting = {asyncio.ensure_future(st.next_chunk()): i for i, st in enumerate(streams)}
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=waiting.__getitem__):
                i = waiting.pop(fut)
                got = fut.result()
                if got is None:
                    continue
                if not got.finished:
                    waiting[asyncio.ensure_future(streams[i].next_chunk())] = i
                yield i, got
    finally:
        for fut in waiting:
            fut.cancel()
