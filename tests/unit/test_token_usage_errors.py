"""A bad `--auth-token-file` (or `$PDSERVE_AUTH_TOKEN`) is a usage error, never a traceback.

`pdserve prefill|decode|colocated`, the benchmarks that start their own cluster, `pdserve
generate` and the healthcheck answer
a token file that is missing, empty or unreadable with one line naming it on stderr and
exit status 2, before anything starts — as the router does.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.common.auth import TOKEN_ENV
from pdserve import healthcheck
from pdserve.bench import disagg_latency, overload
from pdserve.node.config import parse_node_args
from pdserve.router.fronts import client


@pytest.fixture
def bad_token_files(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    return {
        "missing": (str(tmp_path / "missing"), "cannot read it"),
        "empty": (str(empty), "the auth token is empty"),
        "unreadable": (str(tmp_path), "cannot read it"),  # a directory: read_text raises
    }


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("kind", ["prefill", "decode", "colocated"])
@pytest.mark.parametrize("case", ["missing", "empty", "unreadable"])
def test_a_node_refuses_a_bad_token_file_as_a_usage_error(kind, case, bad_token_files, capsys):
    path, reason = bad_token_files[case]
    with pytest.raises(SystemExit) as exit_info:
        parse_node_args(["--model", "m", "--auth-token-file", path], kind, {})
    assert exit_info.value.code == 2
    line = error_line(capsys)
    assert line.startswith(f"pdserve {kind}: error: --auth-token-file {path}: ")
    assert reason in line


def test_a_node_refuses_a_bad_token_variable_and_a_bad_bound(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_node_args(["--model", "m"], "decode", {TOKEN_ENV: "two words"})
    assert exit_info.value.code == 2
    assert error_line(capsys) == ("pdserve decode: error: $PDSERVE_AUTH_TOKEN: the auth token may hold only "
                                  "visible ASCII (no spaces), found [' ']")
    with pytest.raises(SystemExit) as exit_info:
        parse_node_args(["--model", "m", "--max-waiting-requests", "0"], "colocated", {})
    assert exit_info.value.code == 2
    assert error_line(capsys) == ("pdserve colocated: error: max_waiting_requests and max_queued_tokens "
                                  "must be >= 1, got 0, 65536")


@pytest.mark.parametrize("bench", [disagg_latency, overload], ids=["disagg_latency", "overload"])
def test_a_benchmark_refuses_a_bad_token_file_before_starting_a_cluster(bench, bad_token_files, capsys):
    path, reason = bad_token_files["empty"]
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--model-dir", "/nonexistent", "--auth-token-file", path])
    assert exit_info.value.code == 2
    assert error_line(capsys).endswith(f"error: --auth-token-file {path}: {reason}")


@pytest.mark.parametrize("main, argv", [(client.main, ["--token-ids", "1,2"]), (healthcheck.main, ["127.0.0.1:1"])],
                         ids=["generate", "healthcheck"])
def test_a_client_refuses_a_bad_token_file_before_calling(main, argv, bad_token_files, capsys):
    path, reason = bad_token_files["unreadable"]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--auth-token-file", path])
    assert exit_info.value.code == 2
    line = error_line(capsys)
    assert f"error: --auth-token-file {path}: {reason}" in line


def test_the_node_command_exits_2_with_one_line(bad_token_files):
    path, _ = bad_token_files["missing"]
    done = subprocess.run([sys.executable, "-m", "pdserve", "prefill", "--model", "m", "--auth-token-file", path],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"pdserve prefill: error: --auth-token-file {path}: "
                                                           "cannot read it")
