"""The outside systems the throughput bench compares against: llama.cpp and CTranslate2.

Owns getting them (once, into the pdserve cache), converting a local transformers
checkpoint to their formats (cached per model and type), running their own benchmark
tools, and parsing what those print. Everything comes from the package registry: llama.cpp's
source ships in the llama-cpp-python sdist on PyPI and is built with cmake; CTranslate2 is a
wheel. It never runs the engine; pdserve/bench/anchors.py runs all systems and compares them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from pdserve.common.paths import default_cache_dir

LLAMA_CPP_SDIST = "llama-cpp-python"
LLAMA_TARGETS = ("llama-bench", "llama-batched-bench")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
)  # fmt: skip
# The converter refuses tokenizers whose pre-tokenizer hash it does not know (our demo models'
# own BPE tokenizers among them). The benchmarks feed token ids, never text, so any pre-tokenizer
# name will do; this shim names gpt-2's and runs the sdist's converter unchanged otherwise.
CONVERT_SHIM = """
import runpy, sys
root = sys.argv.pop(1)
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv[0] = root + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def anchors_dir() -> Path:
    return default_cache_dir() / "anchors"


@dataclass(frozen=True)
class LlamaCpp:
    source: Path  # the llama.cpp tree inside the unpacked sdist
    bin_dir: Path

    def tool(self, name: str) -> Path:
        return self.bin_dir / name


def ensure_llama_cpp(root: Path | None = None) -> LlamaCpp:
    """Download the sdist, build the two bench tools with cmake (once), return where they are."""
    root = root or anchors_dir()
    source = _unpacked_sdist(root) / "vendor" / "llama.cpp"
    build = source / "build"
    tools = LlamaCpp(source, build / "bin")
    if all(tools.tool(t).is_file() for t in LLAMA_TARGETS):
        return tools
    print(f"building llama.cpp ({', '.join(LLAMA_TARGETS)}) in {build}; takes minutes, once", flush=True)
    _run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS])
    _run(["cmake", "--build", str(build), "-j", "--target", *LLAMA_TARGETS])
    return tools


def _unpacked_sdist(root: Path) -> Path:
    found = sorted(root.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if found:
        return found[-1].parent.parent
    root.mkdir(parents=True, exist_ok=True)
    _pip("download", LLAMA_CPP_SDIST, "--no-binary", ":all:", "--no-deps", "-d", str(root))
    archive = sorted(root.glob("llama_cpp_python-*.tar.gz"))[-1]
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")
    return sorted(root.glob("llama_cpp_python-*/vendor/llama.cpp"))[-1].parent.parent


def ensure_gguf(llama: LlamaCpp, model_dir: Path, outtype: str, root: Path | None = None) -> Path:
    """The model converted by the sdist's convert_hf_to_gguf.py (bf16, f32 or q8_0), cached."""
    out = (root or anchors_dir()) / "gguf" / f"{model_dir.resolve().name}-{outtype}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    _pip("install", "-q", "sentencepiece")  # the converter imports it whatever the tokenizer
    partial = out.with_suffix(".partial")
    _run([sys.executable, "-c", CONVERT_SHIM, str(llama.source), str(model_dir), "--outtype", outtype,
          "--outfile", str(partial)])  # fmt: skip
    partial.rename(out)
    return out


def ensure_ctranslate2(model_dir: Path, root: Path | None = None) -> Path:
    """Install ctranslate2 if missing and convert the model (float32 weights), cached."""
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        _pip("install", "-q", "ctranslate2")
    out = (root or anchors_dir()) / "ct2" / model_dir.resolve().name
    if (out / "model.bin").is_file():
        return out
    from ctranslate2.converters import TransformersConverter

    TransformersConverter(str(model_dir)).convert(str(out), force=True)
    return out


@dataclass(frozen=True)
class LlamaBenchResult:
    prompt_tokens_per_s: float  # pp<n_prompt>
    decode_tokens_per_s: float  # tg<n_gen>


def parse_llama_bench(text: str) -> LlamaBenchResult:
    """`llama-bench -o json` output: one entry per test, pp (n_gen 0) and tg (n_prompt 0)."""
    entries = json.loads(text)
    prompt = [e["avg_ts"] for e in entries if e["n_prompt"] > 0 and e["n_gen"] == 0]
    decode = [e["avg_ts"] for e in entries if e["n_gen"] > 0 and e["n_prompt"] == 0]
    if not prompt or not decode:
        raise ValueError(f"llama-bench output lacks a pp or tg test: {[(e['n_prompt'], e['n_gen']) for e in entries]}")
    return LlamaBenchResult(prompt[0], decode[0])


@dataclass(frozen=True)
class BatchedBenchResult:
    parallel: int
    output_tokens_per_s: float  # generated tokens / (prompt + generation time)
    decode_tokens_per_s: float  # generation phase only


def parse_batched_bench(text: str) -> BatchedBenchResult:
    """`llama-batched-bench --output-format jsonl`: the last JSON line is the measured row."""
    rows = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    if not rows:
        raise ValueError("llama-batched-bench printed no jsonl row")
    row = rows[-1]
    return BatchedBenchResult(row["pl"], row["pl"] * row["tg"] / row["t"], row["speed_tg"])


def run_llama_bench(llama: LlamaCpp, gguf: Path, threads: int, prompt: int, gen: int, reps: int) -> LlamaBenchResult:
    out = _run([str(llama.tool("llama-bench")), "-m", str(gguf), "-t", str(threads), "-p", str(prompt),
                "-n", str(gen), "-r", str(reps), "-o", "json"], capture=True)  # fmt: skip
    return parse_llama_bench(out)


def run_batched_bench(
    llama: LlamaCpp, gguf: Path, threads: int, prompt: int, gen: int, parallel: int
) -> BatchedBenchResult:
    ctx = parallel * (prompt + gen) + 64
    out = _run([str(llama.tool("llama-batched-bench")), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
                "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(prompt), "-ntg", str(gen),
                "-npl", str(parallel), "--output-format", "jsonl"], capture=True)  # fmt: skip
    return parse_batched_bench(out)


def _pip(*args: str) -> None:
    _run([sys.executable, "-m", "pip", *args])


def _run(cmd: list[str], capture: bool = False) -> str:
    if shutil.which(cmd[0]) is None and not Path(cmd[0]).is_file():
        raise RuntimeError(f"{cmd[0]} not found (llama.cpp needs cmake and a C++ compiler)")
    done = subprocess.run(cmd, check=False, text=True, capture_output=True)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).splitlines()[-15:])
        raise RuntimeError(f"{' '.join(cmd[:3])} ... exited {done.returncode}:\n{tail}")
    return done.stdout
