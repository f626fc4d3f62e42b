"""A request's inbox at the node front: the `Tokens` that wait there leave as one message, in order,
and the stream sends them as one `DecodeTokens` event; at a stream interval N the inbox waits for N
(pdserve/node/front/inbox.py, pdserve/node/front/servicers.py)."""

from __future__ import annotations

import asyncio

from pdserve.node.errors import ErrorCode
from pdserve.node.front.inbox import StreamInbox
from pdserve.node.front.servicers import _stream_events
from pdserve.node.messages import Logprobs, PromptLogprobs, Ready, RequestFailed, StreamSubmit, Tokens
from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import pdserve_pb2

LP = [Logprobs(-0.5 - i, [10 + i, 20 + i], [-0.5 - i, -2.0 - i]) for i in range(4)]
PROMPT = PromptLogprobs([4, 7], [Logprobs(-3.0, [9], [-0.5]), Logprobs(-0.25, [7], [-0.25])])


def filled(*messages, stream_interval: int = 1) -> StreamInbox:
    inbox = StreamInbox(stream_interval)
    for msg in messages:
        inbox.put(msg)
    return inbox


def taken(inbox: StreamInbox, count: int) -> list:
    async def take():
        return [await inbox.get() for _ in range(count)]
    return asyncio.run(take())


def test_waiting_tokens_leave_as_one_message_in_order_with_the_last_ones_end():
    inbox = filled(Tokens("r", [5], [LP[0]], prompt_logprobs=PROMPT), Tokens("r", [6, 7], [LP[1], LP[2]]),
                   Tokens("r", [8], [LP[3]], "stop", 8))
    [joined] = taken(inbox, 1)
    assert joined == Tokens("r", [5, 6, 7, 8], LP, "stop", 8, PROMPT)


def test_tokens_without_logprobs_keep_one_none_per_token():
    [joined] = taken(filled(Tokens("r", [5], [None]), Tokens("r", [6], [None], "length")), 1)
    assert (joined.token_ids, joined.logprobs, joined.finish_reason, joined.stop_token_id) == \
        ([5, 6], [None, None], "length", None)


def test_a_message_alone_leaves_as_it_came():
    alone = Tokens("r", [5], [None])
    assert taken(filled(alone), 1)[0] is alone


def test_joining_stops_at_the_message_that_ends_the_request():
    first, ended, after = Tokens("r", [5], [None]), Tokens("r", [6], [None], "length"), Tokens("r", [7], [None])
    joined, rest = taken(filled(first, ended, after), 2)
    assert (joined.token_ids, joined.finish_reason) == ([5, 6], "length")
    assert rest is after


def test_a_failure_behind_waiting_tokens_comes_next_and_ready_is_never_joined():
    ready, failed = Ready("r", "layout", [1, 2]), RequestFailed("r", ErrorCode.INTERNAL, "core died")
    got = taken(filled(ready, Tokens("r", [5], [None]), Tokens("r", [6], [None]), failed), 3)
    assert got[0] is ready
    assert got[1] == Tokens("r", [5, 6], [None, None])
    assert got[2] is failed


def one_token(token_id: int, finish: str | None = None) -> Tokens:
    return Tokens("r", [token_id], [None], finish)


def test_at_an_interval_the_first_tokens_leave_at_once_and_later_ones_wait_for_the_interval():
    async def scenario():
        inbox = StreamInbox(stream_interval=3)
        inbox.put(one_token(5))
        first = await inbox.get()  # alone: the stream's time to first token waits for nothing
        inbox.put(one_token(6))
        later = asyncio.ensure_future(inbox.get())
        await asyncio.sleep(0)
        held = not later.done()  # one token of three: held for the next two
        inbox.put(one_token(7))
        inbox.put(one_token(8))
        inbox.put(one_token(9))  # waiting already when the third comes: leaves with them
        return first, held, await later

    first, held, later = asyncio.run(scenario())
    assert first.token_ids == [5] and held
    assert later.token_ids == [6, 7, 8, 9]


def test_at_an_interval_the_request_s_end_and_a_failure_are_never_held():
    async def after_the_first(*messages):
        inbox = StreamInbox(stream_interval=8)
        inbox.put(one_token(5))
        await inbox.get()
        for msg in messages:
            inbox.put(msg)
        return [await inbox.get() for _ in range(len(messages) - 1)]

    [ended] = asyncio.run(after_the_first(one_token(6), one_token(7, "length")))
    assert (ended.token_ids, ended.finish_reason) == ([6, 7], "length")
    failed = RequestFailed("r", ErrorCode.INTERNAL, "core died")
    held, then = asyncio.run(after_the_first(one_token(6), failed, one_token(7)))
    assert held.token_ids == [6] and then is failed


class FilledClient:
    """The core side of `_stream_events`: an inbox whose messages have all arrived."""

    def __init__(self, inbox: StreamInbox) -> None:
        self.inbox, self.sent, self.aborted = inbox, [], []

    def open_stream(self, req_id: str, stream_interval: int) -> StreamInbox:
        return self.inbox

    def send(self, msg) -> None:
        self.sent.append(msg)

    def close_stream(self, req_id: str) -> None:
        pass

    def abort(self, req_id: str) -> None:
        self.aborted.append(req_id)


def test_the_stream_sends_waiting_tokens_as_one_decode_event_with_logprobs_in_order():
    client = FilledClient(filled(Ready("r", "layout", [3]), Tokens("r", [5], [LP[0]]),
                                 Tokens("r", [6, 7], [LP[1], LP[2]]), Tokens("r", [8], [LP[3]], "stop", 8)))

    async def events():
        submit = StreamSubmit("r", [1, 2], SamplingParams(logprobs=1), 0)
        return [e async for e in _stream_events(client, None, submit, 1)]

    ready, tokens = asyncio.run(events())
    assert list(ready.ready.block_ids) == [3]
    event = tokens.tokens
    assert list(event.token_ids) == [5, 6, 7, 8]
    assert [(e.token_id, e.logprob, [t.token_id for t in e.top]) for e in event.logprobs] == \
        [(5 + i, -0.5 - i, [10 + i, 20 + i]) for i in range(4)]
    assert (event.finish_reason, event.stop_token_id) == (pdserve_pb2.FINISH_REASON_STOP, 8)
    assert not client.aborted  # the request ended: nothing to abort
