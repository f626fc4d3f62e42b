"""Several producers' items as one stream, in the order they come: a request's samples
(pdserve/router/dispatch/orchestrator.py), an HTTP request's prompts (pdserve/router/fronts/http_server.py).

Each producer is a coroutine function given `put(item)`; `merged` runs them all as tasks and
yields every item as it is put. The first producer that fails ends the stream with its
exception; leaving the stream early (the consumer stops, is cancelled or fails) cancels every
producer. Must never: leave a producer running after the stream has ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

Put = Callable[[Any], None]
Producer = Callable[[Put], Awaitable[None]]

_DONE = object()


async def merged(producers: list[Producer]) -> AsyncIterator[Any]:
    queue: asyncio.Queue[object] = asyncio.Queue()

    async def run(producer: Producer) -> None:
        try:
            await producer(queue.put_nowait)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the stream's reader, which raises it
            queue.put_nowait(exc)
            return
        queue.put_nowait(_DONE)

    tasks = [asyncio.create_task(run(producer)) for producer in producers]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
