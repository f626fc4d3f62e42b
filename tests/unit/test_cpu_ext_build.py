"""Whether an engine start compiles the C++ kernels (and says so first) or loads an earlier
build, decided on a fake build dir, and the builders' turn: nothing is compiled here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.kernels import cpu_ext
from pdserve.kernels.cpu_ext import build_needed


def finish_build(build_dir: Path) -> None:
    """A build dir as a finished build leaves it: the library, loaded once, then the mark."""
    build_dir.mkdir(parents=True, exist_ok=True)
    (build_dir / "pdserve_cpu_kernels.so").write_bytes(b"\x7fELF")
    (build_dir / cpu_ext.BUILT_MARK).touch()


def test_a_first_start_builds_and_a_finished_build_is_loaded(tmp_path):
    build_dir = tmp_path / "build"
    assert build_needed(build_dir)  # nothing built yet
    build_dir.mkdir()
    (build_dir / "pdserve_cpu_kernels.so").write_bytes(b"\x7fELF")
    assert build_needed(build_dir)  # a library but no mark: the build died before it loaded
    finish_build(build_dir)
    assert not build_needed(build_dir)


def test_the_build_folder_is_the_sources_content_not_their_place(tmp_path):
    """Two checkouts of the same sources share one build; an edited source gets its own."""
    checkouts = [tmp_path / "clone" / "csrc", tmp_path / "install" / "csrc"]
    for csrc in checkouts:
        csrc.mkdir(parents=True)
        (csrc / "a.cpp").write_text("// kernel a\n")
        (csrc / "a.h").write_text("// header\n")
    first, second = (cpu_ext.sources_digest(csrc) for csrc in checkouts)
    assert first == second
    (checkouts[1] / "a.h").write_text("// header, edited\n")
    assert cpu_ext.sources_digest(checkouts[1]) != first
    (checkouts[1] / "a.h").rename(checkouts[1] / "b.h")  # the same bytes under another name
    assert cpu_ext.sources_digest(checkouts[1]) not in (first, cpu_ext.sources_digest(checkouts[0]))


@pytest.mark.parametrize("cached", [False, True], ids=["first start", "cached build"])
def test_the_build_line_comes_once_and_only_before_a_build(cached, tmp_path, monkeypatch, capsys):
    from torch.utils import cpp_extension

    build_dir = tmp_path / "build"
    if cached:
        finish_build(build_dir)
    loads = []

    def build(**kwargs):  # stands in for the compiler: this test builds nothing
        loads.append(kwargs["build_directory"])
        raise RuntimeError("no compiler in this test")

    def load_library(path):  # stands in for the dispatcher: the fake library is no library
        loads.append(str(Path(path).parent))
        raise RuntimeError("not a library")

    monkeypatch.setattr(cpp_extension, "load", build)
    monkeypatch.setattr(cpu_ext.torch.ops, "load_library", load_library)
    monkeypatch.setattr(cpu_ext, "_build_dir", lambda: build_dir)
    monkeypatch.setattr(cpu_ext, "_state", {})
    monkeypatch.delenv(cpu_ext.DISABLE_ENV, raising=False)
    assert cpu_ext.ops() is None and cpu_ext.ops() is None
    assert loads == [str(build_dir)]  # asked once per process, whatever the answer
    said = [line for line in capsys.readouterr().err.splitlines() if "building C++ kernels" in line]
    assert said == ([] if cached else [f"pdserve: building C++ kernels (once, about a minute) in {build_dir}"])


def test_a_build_killed_halfway_leaves_no_lock_the_next_start_waits_on(tmp_path):
    """torch's lock file outlives a build killed mid-compile; the turn a dead process held is
    the kernel's to release, and whoever takes it next clears torch's lock."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from pdserve.kernels.cpu_ext import _builder_turn\n"
        f"with _builder_turn(Path({str(tmp_path)!r})):\n"
        f"    Path({str(tmp_path / 'lock')!r}).touch(); print('building', flush=True); time.sleep(600)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "building\n"
    finally:
        holder.kill()  # a Ctrl-C'd or OOM-killed build: torch's lock stays behind
        holder.wait(timeout=30)
    assert (tmp_path / "lock").exists()
    with cpu_ext._builder_turn(tmp_path):
        assert not (tmp_path / "lock").exists()
