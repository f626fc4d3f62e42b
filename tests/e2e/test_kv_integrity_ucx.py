"""KV integrity at the UCX transport: two real processes on 127.0.0.1 (the harness of
test_kv_transfer_ucx.py). The sender's drill (`debug_corrupt_push=1`) flips a byte of its first
push after sealing it: a receiver with checksums fails that push with an error ACK, counts it,
and delivers its request's done message as `INTEGRITY_REFUSAL`, while the next request's push
and done message go through; a receiver without checksums asks for no seal and checks nothing.
Both data paths: data on the worker by tag (shared memory) and on the control endpoint (TCP).
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import asdict
from typing import Any

import pytest

from pdserve.kv_transfer import KVCacheSpec
from tests.e2e.test_kv_transfer_ucx import (DST_BLOCKS, STEP_TIMEOUT_S, Cluster, expect, make_caches, sender_main,
                                            spec_kwargs)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx (ucxx-cu12) is not installed")

REFUSAL = b"pdkv:refused:kv-checksum-mismatch"  # pdserve/kv_transfer/integrity.py, spelled out: the wire contract
SCRIPT = [("push", "req-a", [0, 1, 2], [10, 11, 12]), ("done", "req-a", b"token1-a"),
          ("push", "req-b", [3, 4], [20, 21]), ("done", "req-b", b"token1-b")]


def two_dones_receiver(spec_kw: dict[str, Any], cfg_kw: dict[str, Any], out: Any, cmd: Any) -> None:
    from pdserve.kv_transfer import KVTransferConfig, UcxTransport

    k, v = make_caches(spec_kw, DST_BLOCKS, seed=2)
    transport = UcxTransport(KVTransferConfig(**cfg_kw))
    out.put(("desc", transport.register(k, v, KVCacheSpec(**spec_kw)).to_bytes()))
    cmd.get(timeout=STEP_TIMEOUT_S * 2)
    deadline, dones = time.monotonic() + STEP_TIMEOUT_S, []
    while len(dones) < 2 and time.monotonic() < deadline:
        dones += transport.poll_done()
        time.sleep(0.005)
    out.put(("report", dict(dones=dones, stats=asdict(transport.recv_stats()))))
    transport.close()


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("checksums", [True, False])
def test_a_corrupted_push_is_refused_only_where_checksums_are_asked_for(fast: bool, checksums: bool) -> None:
    pair = Cluster()
    try:
        spec_kw = spec_kwargs("float32")
        common = dict(fast_data_path=fast, chunk_bytes=4096, transfer_timeout_s=20.0)
        _, r_out, r_cmd = pair.start(two_dones_receiver, spec_kw, {**common, "checksums": checksums})
        desc = expect(r_out, "desc")
        _, s_out, s_cmd = pair.start(sender_main, spec_kw, {**common, "debug_corrupt_push": 1}, desc, SCRIPT)
        expect(s_out, "connected")
        s_cmd.put("go")
        sent = expect(s_out, "sent")
        r_cmd.put("report")
        report = expect(r_out, "report")
    finally:
        pair.stop()
    states = [state for state, _ in sent["states"]]
    if not checksums:
        assert states == ["SUCCESS"] * 4
        assert report["dones"] == [("req-a", b"token1-a"), ("req-b", b"token1-b")]
        assert (report["stats"]["checksum_failures"], report["stats"]["transfers"]) == (0, 2)
        return
    assert states == ["FAILED", "SUCCESS", "SUCCESS", "SUCCESS"]
    assert sent["states"][0][1].endswith("KV checksum mismatch in data message 0 of 4 of 'req-a': "
                                         "the request is refused here")
    assert report["dones"] == [("req-a", REFUSAL), ("req-b", b"token1-b")]
    stats = report["stats"]
    assert (stats["checksum_failures"], stats["failures"], stats["transfers"], stats["blocks"]) == (1, 1, 1, 2)
