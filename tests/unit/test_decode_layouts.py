"""A prefill/decode pair agrees the decode node's KV layout once, not per request.

Two sides: the prefill node's front (`LayoutCache`: fetched from the decode node once per run of
it, handed to the core once) and its core (`DecodeLayouts`: parsed and checked once per id, a
restarted decode node's new layout replacing the old). Exact status codes and messages; no network
(the fetch is a function the test counts).
"""

from __future__ import annotations

import asyncio

import pytest

from pdserve.kv_transfer import KVCacheSpec, KVDescriptor
from pdserve.node.errors import ErrorCode, NodeError
from pdserve.ranks.kv_ranks import NodeKVDescriptor
from pdserve.prefill_node.decode_layouts import DecodeLayouts
from pdserve.prefill_node.layout_fetch import LayoutCache

SPEC = KVCacheSpec("m", "float32", 2, 4, 8, 4)
D_ADDRESS = "127.0.0.1:7001"  # the decode node's gRPC address


def layout(epoch: str, port: int = 5000, num_blocks: int = 16) -> NodeKVDescriptor:
    return NodeKVDescriptor((KVDescriptor("ucx", "127.0.0.1", port, num_blocks, SPEC),), epoch)


def text(desc: NodeKVDescriptor) -> str:
    return desc.to_bytes().decode()


# -- the core: each id parsed once ---------------------------------------------------------
def test_a_layout_id_names_the_node_and_its_run_and_survives_the_wire():
    desc = layout("run1")
    assert desc.layout_id == "127.0.0.1:5000/run1"
    assert NodeKVDescriptor.from_bytes(desc.to_bytes()) == desc


def test_the_core_parses_a_layout_once_and_later_requests_name_it_by_id():
    layouts = DecodeLayouts()
    desc = layout("run1")
    assert layouts.resolve(desc.layout_id, text(desc)) == desc
    assert layouts.resolve(desc.layout_id, None) == desc
    assert layouts.resolve(desc.layout_id, "not even JSON") == desc  # known: the text is never read again


def test_an_id_the_core_was_never_given_is_invalid_argument_naming_the_field():
    with pytest.raises(NodeError) as exc:
        DecodeLayouts().resolve("127.0.0.1:5000/run1", None)
    assert exc.value.code is ErrorCode.INVALID_ARGUMENT
    assert exc.value.message == "decode_kv_layout_id '127.0.0.1:5000/run1' names no decode node layout this node has"
    with pytest.raises(NodeError) as empty:
        DecodeLayouts().resolve("", None)
    assert (empty.value.code, empty.value.message) == (ErrorCode.INVALID_ARGUMENT,
                                                       "decode_kv_layout_id must not be empty")


def test_a_bad_layout_is_invalid_argument_naming_kv_layout_for_every_request_naming_it():
    layouts = DecodeLayouts()
    for given in ('{"ranks": "nope"}', None):  # the second request gets the remembered answer
        with pytest.raises(NodeError) as exc:
            layouts.resolve("127.0.0.1:5000/run1", given)
        assert exc.value.code is ErrorCode.INVALID_ARGUMENT
        assert exc.value.message.startswith("kv_layout of '127.0.0.1:5000/run1' is not a KV layout: ")


def test_a_layout_of_another_id_than_the_request_names_is_refused():
    desc = layout("run2")
    with pytest.raises(NodeError) as exc:
        DecodeLayouts().resolve("127.0.0.1:5000/run1", text(desc))
    assert (exc.value.code, exc.value.message) == (
        ErrorCode.INVALID_ARGUMENT,
        "kv_layout is the layout '127.0.0.1:5000/run2', not decode_kv_layout_id '127.0.0.1:5000/run1'")


def test_a_restarted_decode_node_replaces_its_old_layout_and_the_old_connection_is_forgotten():
    forgotten: list[str] = []
    layouts = DecodeLayouts(forgotten.append)
    old, new, other = layout("run1"), layout("run2", num_blocks=32), layout("run1", port=6000)
    layouts.resolve(old.layout_id, text(old))
    layouts.resolve(other.layout_id, text(other))
    assert layouts.resolve(new.layout_id, text(new)).num_blocks == 32
    assert forgotten == [old.layout_id]  # the other decode node keeps its layout and connection
    assert layouts.resolve(other.layout_id, None) == other
    for given in (None, text(old)):  # a request READY'd by the old run never reaches the new caches
        with pytest.raises(NodeError) as exc:
            layouts.resolve(old.layout_id, given)
        assert (exc.value.code, exc.value.message) == (
            ErrorCode.UNAVAILABLE,
            "decode_kv_layout_id '127.0.0.1:5000/run1' is gone: its decode node started again with "
            "'127.0.0.1:5000/run2'")


# -- the front: fetched once per decode node run, handed to the core once ----------------------
class Fetches:
    """The decode node's GetKVLayout, counted; `serving` is the layout it answers now."""

    def __init__(self, serving: NodeKVDescriptor) -> None:
        self.serving = serving
        self.calls: list[str] = []
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.fail: NodeError | None = None

    async def __call__(self, address: str) -> tuple[str, str]:
        self.calls.append(address)
        self.started.set()
        await self.release.wait()
        if self.fail is not None:
            raise self.fail
        return self.serving.layout_id, text(self.serving)


def test_concurrent_requests_fetch_once_and_only_the_first_sent_carries_the_layout():
    async def scenario():
        fetches = Fetches(layout("run1"))
        cache = LayoutCache(fetches)
        layout_id = fetches.serving.layout_id
        waiting = [asyncio.ensure_future(cache.ensure(D_ADDRESS, layout_id)) for _ in range(3)]
        await fetches.started.wait()  # the fetch runs after every request above started waiting on it
        fetches.release.set()
        await asyncio.gather(*waiting)
        await cache.ensure(D_ADDRESS, layout_id)  # known: no fetch
        given = [cache.take_unsent(D_ADDRESS, layout_id) for _ in range(3)]
        return fetches.calls, given

    calls, given = asyncio.run(scenario())
    assert calls == [D_ADDRESS]
    assert given == [text(layout("run1")), None, None]


def test_a_restarted_decode_node_is_fetched_again_and_a_request_of_its_old_run_is_unavailable():
    async def scenario():
        fetches = Fetches(layout("run1"))
        fetches.release.set()
        cache = LayoutCache(fetches)
        await cache.ensure(D_ADDRESS, layout("run1").layout_id)
        first = cache.take_unsent(D_ADDRESS, layout("run1").layout_id)
        fetches.serving = layout("run2")
        await cache.ensure(D_ADDRESS, layout("run2").layout_id)
        second = cache.take_unsent(D_ADDRESS, layout("run2").layout_id)
        with pytest.raises(NodeError) as stale:
            await cache.ensure(D_ADDRESS, layout("run1").layout_id)
        return fetches.calls, first, second, stale.value

    calls, first, second, stale = asyncio.run(scenario())
    assert calls == [D_ADDRESS] * 3  # run1, run2, and the stale request's look (the node serves run2)
    assert (first, second) == (text(layout("run1")), text(layout("run2")))
    assert stale.code is ErrorCode.UNAVAILABLE
    assert stale.message == ("decode_kv_layout_id '127.0.0.1:5000/run1' is not the layout of the decode node at "
                             "127.0.0.1:7001, which serves '127.0.0.1:5000/run2': it started again since its READY")


def test_a_failed_fetch_fails_the_requests_waiting_on_it_and_the_next_request_fetches_again():
    async def scenario():
        fetches = Fetches(layout("run1"))
        fetches.fail = NodeError(ErrorCode.UNAVAILABLE, "cannot fetch")
        fetches.release.set()
        cache = LayoutCache(fetches)
        with pytest.raises(NodeError) as failed:
            await cache.ensure(D_ADDRESS, layout("run1").layout_id)
        fetches.fail = None
        await cache.ensure(D_ADDRESS, layout("run1").layout_id)
        return fetches.calls, failed.value, cache.take_unsent(D_ADDRESS, layout("run1").layout_id)

    calls, failed, given = asyncio.run(scenario())
    assert (failed.code, failed.message) == (ErrorCode.UNAVAILABLE, "cannot fetch")
    assert calls == [D_ADDRESS, D_ADDRESS] and given == text(layout("run1"))
