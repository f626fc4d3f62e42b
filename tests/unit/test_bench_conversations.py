"""The multi-turn dataset (pdserve/bench/conversations.py): each turn's prompt extends the last, and
`pdserve bench serve --workload jsonl` reads the file."""

from __future__ import annotations

import pytest

from pdserve.bench import conversations
from pdserve.bench.serve.workloads import read_jsonl


def test_each_turn_extends_its_conversation_and_the_bench_reads_the_file(tmp_path, capsys):
    out = tmp_path / "conv.jsonl"
    assert conversations.main(["--conversations", "3", "--turns", "2", "--output-len", "5", "--out", str(out)]) == 0
    assert "6 requests (3 conversations x 2 turns)" in capsys.readouterr().out
    workload = read_jsonl(out)
    specs = [workload.request(i) for i in range(6)]
    for c in range(3):
        first, second = specs[c].text, specs[3 + c].text
        assert first.startswith(f"System: conversation {c}.") and second.startswith(first) and len(second) > len(first)
    assert {s.output_len for s in specs} == {5}
    again = tmp_path / "again.jsonl"
    conversations.main(["--conversations", "3", "--turns", "2", "--output-len", "5", "--out", str(again)])
    assert again.read_text() == out.read_text()  # seeded: the same flags write the same file


def test_a_bad_count_names_the_flag(tmp_path, capsys):
    with pytest.raises(SystemExit):
        conversations.main(["--turns", "0", "--out", str(tmp_path / "x.jsonl")])
    assert "--turns must be >= 1, got 0" in capsys.readouterr().err
