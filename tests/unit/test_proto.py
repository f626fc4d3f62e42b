"""The committed stubs are exactly what the .proto files generate."""

from __future__ import annotations

from pdserve.proto import generate


def test_committed_stubs_match_the_protos(tmp_path):
    fresh = {p.name: p.read_text() for p in generate.generate(tmp_path)}
    assert sorted(fresh) == ["node_pb2.py", "node_pb2_grpc.py", "pdserve_pb2.py", "pdserve_pb2_grpc.py"]
    for name, text in fresh.items():
        committed = (generate.PROTO_DIR / name).read_text()
        assert committed == text, f"proto/{name} is stale: run python -m pdserve.proto.generate"
