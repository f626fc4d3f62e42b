"""One request's inbox at the front: the core's messages for it, in order, with the `Tokens`
that wait behind each other joined into one.

The core sends one `Tokens` per request per step. When the front falls behind (its event loop
busy sending other streams' events, as under load), several of one request's `Tokens` wait here
at once; `get` hands them over as one message, so the request's stream sends one event and the
router reads one where there were several (vLLM's output handler joins its outputs the same
way). With a stream interval of 1 nothing waits for more: a message alone in the inbox leaves as
it came.

A stream interval N > 1 (the request's `stream_interval`, set by the router's flag) also waits:
`get` holds a request's tokens until N are there, so its stream sends about one event per N
tokens, and the router relays one response per N (vLLM's and SGLang's --stream-interval). The
stream's first `Tokens` leaves at once (its time to first token), and so does one that ends the
request or is followed by another kind of message.

Must never: reorder messages, join past a message that ends the request, keep a message that has
arrived from the next `get` (at an interval of 1), or hold tokens once the request has ended.
"""

from __future__ import annotations

import asyncio

from pdserve.node.messages import Message, Tokens


class StreamInbox:
    def __init__(self, stream_interval: int = 1) -> None:
        self._queue: asyncio.Queue[Message] = asyncio.Queue()
        self._held: Message | None = None  # taken while joining, not a Tokens: what `get` returns next
        self._interval = max(1, stream_interval)
        self._sent_tokens = False  # the stream's first Tokens has left: later ones may wait for the interval

    def put(self, msg: Message) -> None:
        self._queue.put_nowait(msg)

    async def get(self) -> Message:
        """The next message; a `Tokens` joined with every `Tokens` already waiting behind it, and
        with the ones still to come until the stream interval is reached."""
        msg = self._held if self._held is not None else await self._queue.get()
        self._held = None
        if not isinstance(msg, Tokens):
            return msg
        parts = [msg]
        wanted = self._interval if self._sent_tokens else 1
        count = len(msg.token_ids)
        while parts[-1].finish_reason is None and (count < wanted or not self._queue.empty()):
            waiting = await self._queue.get()
            if not isinstance(waiting, Tokens):
                self._held = waiting
                break
            parts.append(waiting)
            count += len(waiting.token_ids)
        self._sent_tokens = True
        return msg if len(parts) == 1 else Tokens.joined(parts)
