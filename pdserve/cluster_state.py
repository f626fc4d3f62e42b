"""The state file of a running `pdserve cluster`: what a program needs to reach each child.

Owns the file's shape and its atomic write (a reader never sees half a file): the
router's address, and per child its kind, pid (also its process group), gRPC address,
/metrics URL and how often it was restarted; with TLS, the files a client uses; and where the
node join credential is (its path, never the secret). The launcher writes it when the cluster
first serves and after every restart (`--state-file`); benchmarks and tests read it.

Must never: be the source of truth for the cluster (the router's registry is); it is a
snapshot for programs that started the launcher.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdserve.common.tls import TlsConfig


@dataclass(frozen=True)
class ChildState:
    kind: str  # "router", "prefill", "decode" or "colocated"
    pid: int
    address: str  # gRPC HOST:PORT
    metrics_url: str | None = None
    restarts: int = 0


@dataclass(frozen=True)
class ClusterState:
    router: str
    children: dict[str, ChildState] = field(default_factory=dict)
    http: str | None = None  # the router's OpenAI-compatible API base URL (".../v1"), when served
    # With TLS (pdserve/common/tls.py): the CA a client trusts, and the certificate and key a gRPC client
    # of this cluster presents (its ports require one under mutual TLS).
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    # The node join credential's file, when the launcher has one (the user's, or the one --tls made).
    auth_token_file: str | None = None

    def tls(self) -> TlsConfig | None:
        if self.tls_ca_file is None:
            return None
        return TlsConfig(self.tls_ca_file, self.tls_cert_file, self.tls_key_file)

    def names(self, kind: str) -> list[str]:
        """The children of one kind, in start order ("decode-0", "decode-1", ...)."""
        return [name for name, child in self.children.items() if child.kind == kind]

    def addresses(self, kind: str) -> list[str]:
        return [self.children[name].address for name in self.names(kind)]


def write_state(path: str | os.PathLike, state: ClusterState) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(state), indent=2))
    os.replace(tmp, path)


def read_state(path: str | os.PathLike) -> ClusterState | None:
    """The last state written, or None before the cluster first served."""
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    return ClusterState(raw["router"], {name: ChildState(**child) for name, child in raw["children"].items()},
                        raw.get("http"), raw.get("tls_ca_file"), raw.get("tls_cert_file"), raw.get("tls_key_file"),
                        raw.get("auth_token_file"))
