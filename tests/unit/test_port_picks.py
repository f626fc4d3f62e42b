"""The machine's ledger of picked ports (pdserve/common/port_picks.py): no two picks the same while held."""

from __future__ import annotations

import random
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from pdserve.cluster_plan import resolve_port
from pdserve.common.port_picks import PortLedger

ALWAYS_FREE = lambda port: True  # noqa: E731


def test_a_held_port_is_passed_over_by_every_ledger_on_the_file(tmp_path):
    path = tmp_path / "picks.json"
    assert PortLedger(path).claim([21000, 21001], ALWAYS_FREE) == 21000
    assert PortLedger(path).claim([21000, 21001], ALWAYS_FREE) == 21001
    assert PortLedger(path).claim([21000, 21001], ALWAYS_FREE) is None


def test_a_busy_port_is_neither_picked_nor_held(tmp_path):
    ledger = PortLedger(tmp_path / "picks.json")
    assert ledger.claim([21000, 21001], lambda port: port != 21000) == 21001
    assert ledger.claim([21000], ALWAYS_FREE) == 21000


def test_a_hold_ends_and_is_pruned(tmp_path):
    path, now = tmp_path / "picks.json", [1000.0]
    ledger = PortLedger(path, hold_s=60, clock=lambda: now[0])
    assert ledger.claim([21000], ALWAYS_FREE) == 21000
    now[0] += 59
    assert ledger.claim([21000, 21001], ALWAYS_FREE) == 21001
    now[0] += 2  # 21000's hold has ended, 21001's has not
    assert ledger.claim([21000], ALWAYS_FREE) == 21000
    assert '"21000"' in path.read_text() and '"21001"' in path.read_text()
    now[0] += 120
    assert ledger.claim([21002], ALWAYS_FREE) == 21002
    assert '"21000"' not in path.read_text()


def test_a_torn_ledger_is_replaced_and_a_missing_one_only_probes(tmp_path):
    path = tmp_path / "picks.json"
    path.write_text('{"21000": ')
    assert PortLedger(path).claim([21000], ALWAYS_FREE) == 21000
    assert PortLedger(path).claim([21000], ALWAYS_FREE) is None
    unwritable = PortLedger(tmp_path / "no-such-dir" / "picks.json")
    assert unwritable.claim([21000, 21001], lambda port: port == 21001) == 21001


def _claim_many(path: str) -> list[int]:
    ledger = PortLedger(Path(path))
    return [ledger.claim(range(21000, 21200), ALWAYS_FREE) for _ in range(50)]


def test_processes_claiming_at_once_never_share_a_port(tmp_path):
    with ProcessPoolExecutor(max_workers=2) as pool:
        claims = [port for ports in pool.map(_claim_many, [str(tmp_path / "picks.json")] * 2) for port in ports]
    assert len(claims) == 100 and len(set(claims)) == 100


def test_the_launcher_never_picks_one_port_twice_while_held(tmp_path):
    """Same random draws, one ledger: the second pick passes over the first (it is not bound yet)."""
    ledger = PortLedger(tmp_path / "picks.json")
    first = resolve_port("127.0.0.1", 0, random.Random(7), ledger)
    assert resolve_port("127.0.0.1", 0, random.Random(7), ledger) not in (first, 0)
