"""KV integrity's pieces (pdserve/kv_transfer/integrity.py): the digest, its SEAL encoding, the drill's
sealer, and the decode node's refusal of a request whose push failed its checksum."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.kv_transfer.integrity import (INTEGRITY_REFUSAL, CorruptingSealer, Sealer, check_payload,
                                           decode_digests, digest, encode_digests, make_sealer)
from pdserve.node.config import NodeConfig
from pdserve.engine.config import EngineConfig


def chunk(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, 4096, dtype=np.uint8)


def test_the_digest_changes_with_one_flipped_byte_and_round_trips_through_a_seal():
    data = chunk(0)
    before = digest(data)
    data[1234] ^= 1
    assert digest(data) != before
    assert decode_digests(encode_digests([before, 0, 2**64 - 1])) == [before, 0, 2**64 - 1]
    with pytest.raises(ValueError, match="whole u64 digests, got 7 bytes"):
        decode_digests(b"\0" * 7)


def test_the_plain_sealer_digests_without_touching_the_bytes():
    data = chunk(1)
    copy = data.copy()
    assert Sealer().seal(data) == digest(copy)
    assert np.array_equal(data, copy)


def test_the_drill_corrupts_only_the_first_chunk_of_the_nth_push_after_sealing_it():
    sealer = CorruptingSealer(2)
    pushes = [[chunk(10 * p + j) for j in range(2)] for p in range(3)]
    originals = [[c.copy() for c in push] for push in pushes]
    for push, original in zip(pushes, originals):
        sealer.start_push()
        assert [sealer.seal(c) for c in push] == [digest(c) for c in original]  # taken before the flip
    changed = [[not np.array_equal(c, o) for c, o in zip(p, q)] for p, q in zip(pushes, originals)]
    assert changed == [[False, False], [True, False], [False, False]]
    assert isinstance(make_sealer(0), Sealer) and not isinstance(make_sealer(0), CorruptingSealer)
    with pytest.raises(ValueError, match="counted from 1, got 0"):
        CorruptingSealer(0)


def test_a_sender_may_not_send_the_refusal_as_its_done_payload():
    check_payload(b'{"status":"ok"}')
    with pytest.raises(ValueError, match="integrity refusal"):
        check_payload(INTEGRITY_REFUSAL)


def test_the_node_flag_reaches_the_transport_and_a_negative_one_is_refused():
    config = NodeConfig(engine=EngineConfig(model="m"), debug_corrupt_kv_push=3)
    assert config.transfer.debug_corrupt_push == 3 and config.transfer.checksums
    with pytest.raises(ValueError, match="debug_corrupt_kv_push must be >= 0, got -1"):
        NodeConfig(engine=EngineConfig(model="m"), debug_corrupt_kv_push=-1)
