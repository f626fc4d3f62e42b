"""`merged`: several producers' items as one stream; the first failure ends it, and leaving the
stream, however it ends, cancels every producer still running."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.requests.merge import merged


def test_items_come_as_they_are_put_and_the_stream_ends_when_every_producer_has():
    async def go():
        async def slow(put):
            await asyncio.sleep(0.01)
            put("slow")

        async def quick(put):
            put("quick-1")
            put("quick-2")

        return [item async for item in merged([slow, quick])]

    assert asyncio.run(go()) == ["quick-1", "quick-2", "slow"]


def test_a_failing_producer_ends_the_stream_with_its_error_and_cancels_the_others():
    cancelled = []

    async def go():
        async def forever(put):
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.append("forever")
                raise

        async def broken(put):
            put("first")
            raise ValueError("broken producer")

        seen = []
        with pytest.raises(ValueError, match="broken producer"):
            async for item in merged([forever, broken]):
                seen.append(item)
        return seen

    assert asyncio.run(go()) == ["first"] and cancelled == ["forever"]
