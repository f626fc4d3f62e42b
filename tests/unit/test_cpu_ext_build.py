"""Whether an engine start compiles the C++ kernels (and says so first) or loads an earlier
build, decided on a fake build dir, and the builders' turn: nothing is compiled here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.kernels import cpu_ext
from pdserve.kernels.cpu_ext import build_needed


@pytest.fixture
def kernel_tree(tmp_path):
    """Two sources and a build dir, as torch's cpp_extension leaves it after a build."""
    sources = [tmp_path / "csrc" / "a.cpp", tmp_path / "csrc" / "b.cpp"]
    sources[0].parent.mkdir()
    for source in sources:
        source.write_text("// kernel\n")
    build_dir = tmp_path / "build"
    build_dir.mkdir()
    return sources, build_dir


def finish_build(build_dir: Path, sources: list[Path], named: list[Path] | None = None) -> None:
    (build_dir / "build.ninja").write_text("".join(f"build {p.stem}.o: compile {p}\n" for p in named or sources))
    library = build_dir / "pdserve_cpu_kernels.so"
    library.write_bytes(b"\x7fELF")
    newest = max(source.stat().st_mtime for source in sources)
    os.utime(library, (newest + 10, newest + 10))


def test_a_first_start_builds_and_a_cached_build_is_loaded(kernel_tree):
    sources, build_dir = kernel_tree
    assert build_needed(build_dir, sources)  # nothing built yet
    finish_build(build_dir, sources)
    assert not build_needed(build_dir, sources)


def test_an_edited_source_or_another_checkout_builds_again(kernel_tree):
    sources, build_dir = kernel_tree
    finish_build(build_dir, sources)
    built_at = (build_dir / "pdserve_cpu_kernels.so").stat().st_mtime
    os.utime(sources[1], (built_at + 5, built_at + 5))
    assert build_needed(build_dir, sources)

    finish_build(build_dir, sources, named=[Path("/elsewhere/csrc/a.cpp"), Path("/elsewhere/csrc/b.cpp")])
    assert build_needed(build_dir, sources)
    (build_dir / "build.ninja").unlink()
    assert build_needed(build_dir, sources)


@pytest.mark.parametrize("cached", [False, True], ids=["first start", "cached build"])
def test_the_build_line_comes_once_and_only_before_a_build(cached, tmp_path, monkeypatch, capsys):
    from torch.utils import cpp_extension

    build_dir = tmp_path / "build"
    if cached:
        build_dir.mkdir()
        finish_build(build_dir, list(cpu_ext.SOURCES))
    loads = []

    def load(**kwargs):  # stands in for the compiler: this test builds nothing
        loads.append(kwargs["build_directory"])
        raise RuntimeError("no compiler in this test")

    monkeypatch.setattr(cpp_extension, "load", load)
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
