"""Regenerate the committed Python stubs from the .proto files beside this module."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
PROTOS = ("pdserve.proto", "node.proto")


def generate(out_dir: Path = PROTO_DIR) -> list[Path]:
    """Write *_pb2.py / *_pb2_grpc.py for every proto into out_dir; returns the files."""
    include = Path(protoc.__file__).resolve().parent / "_proto"
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}"]
    if protoc.main(args + [str(PROTO_DIR / p) for p in PROTOS]) != 0:
        raise RuntimeError("protoc failed")
    written = []
    for path in sorted(out_dir.glob("*_pb2*.py")):
        # protoc writes `import pdserve_pb2`; inside the package it must be relative.
        text = re.sub(r"^import (\w+_pb2)", r"from . import \1", path.read_text(), flags=re.M)
        path.write_text(text)
        written.append(path)
    return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_DIR):
        print(path)
