"""One request's inbox at the front: the core's messages for it, in order, with the `Tokens`
that wait behind each other joined into one.

The core sends one `Tokens` per request per step. When the front falls behind (its event loop
busy sending other streams' events, as under load), several of one request's `Tokens` wait here
at once; `get` hands them over as one message, so the request's stream sends one event and the
router reads one where there were several (vLLM's output handler joins its outputs the same
way). Nothing waits for more: a message alone in the inbox leaves as it came.

Must never: reorder messages, join past a message that ends the request, or keep a message
that has arrived from the next `get`.
"""

from __future__ import annotations

import asyncio

from pdserve.node.messages import Message, Tokens


class StreamInbox:
    def __init__(self) -> None:
        self._queue: asyncio.Queue[Message] = asyncio.Queue()
        self._held: Message | None = None  # taken while joining, not a Tokens: what `get` returns next

    def put(self, msg: Message) -> None:
        self._queue.put_nowait(msg)

    async def get(self) -> Message:
        """The next message; a `Tokens` joined with every `Tokens` already waiting behind it."""
        msg = self._held if self._held is not None else await self._queue.get()
        self._held = None
        if not isinstance(msg, Tokens):
            return msg
        parts = [msg]
        while parts[-1].finish_reason is None and not self._queue.empty():
            waiting = self._queue.get_nowait()
            if not isinstance(waiting, Tokens):
                self._held = waiting
                break
            parts.append(waiting)
        return msg if len(parts) == 1 else Tokens.joined(parts)
