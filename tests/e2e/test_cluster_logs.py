"""What a failed e2e test shows of its cluster: the tail of each process's log (tests/e2e/cluster.py
`log_tails`, which tests/conftest.py adds to a failed test's report). No cluster is started:
the logs are written where a launcher writes them."""

from __future__ import annotations

from tests.e2e.cluster import LOG_TAIL_LINES, Cluster


def test_the_tails_are_the_last_lines_of_the_launchers_log_and_of_every_childs(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "launcher.log").write_text("pdserve cluster ready\n")
    for name in ("router", "prefill-0"):
        (tmp_path / "logs" / f"{name}.log").write_text("".join(f"{name} line {i}\n" for i in range(100)))
    tails = Cluster([], tmp_path).log_tails().splitlines()
    assert tails[:2] == ["--- launcher.log, last 1 lines ---", "pdserve cluster ready"]
    prefill = tails.index(f"--- prefill-0.log, last {LOG_TAIL_LINES} lines ---")
    router = tails.index(f"--- router.log, last {LOG_TAIL_LINES} lines ---")
    assert tails[prefill + 1:router] == [f"prefill-0 line {i}" for i in range(100 - LOG_TAIL_LINES, 100)]
    assert tails[router + 1:] == [f"router line {i}" for i in range(100 - LOG_TAIL_LINES, 100)]


def test_a_cluster_that_wrote_nothing_has_no_tails(tmp_path):
    assert Cluster([], tmp_path).log_tails() == ""
