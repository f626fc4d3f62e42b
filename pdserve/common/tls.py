"""TLS for the gRPC servers and channels and the HTTP front: the one place that chooses it.

Three files, each a flag: `--tls-cert-file` and `--tls-key-file` (this process's identity: the
certificate it serves with, and presents as a client when it calls a peer) and `--tls-ca-file`
(the trust anchor: a peer's certificate must chain to it). A router or a node takes all three
or none (`tls_from_args(..., server=True)`): its gRPC server then requires a client certificate the CA
signed of every caller (mutual TLS), so a node without one cannot register, call another
node or be called. A client (the CLI, the benches, the health check) takes the CA alone to
check the server, plus its own certificate for a port that requires one. The HTTP front
serves TLS but asks for no client certificate: its callers prove themselves with API keys.

Owns `TlsConfig` (the files, read and checked at construction so a bad one is a usage error
naming its flag; gRPC takes the bytes read then, the ssl contexts load the same paths) and the helpers that bind a server port or open a channel with or
without it. No TLS (None) means the plain `add_insecure_port`/`insecure_channel` of before.
Must never: read the environment, write a file (pdserve/cluster_tls.py makes certificates), or
let a gRPC peer in whose certificate the CA did not sign.
"""

from __future__ import annotations

import argparse
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

FLAGS = {"cert_file": "--tls-cert-file", "key_file": "--tls-key-file", "ca_file": "--tls-ca-file"}


class TlsError(ValueError):
    """A TLS file or flag combination that cannot be used; the message names the flag."""


@dataclass(frozen=True)
class TlsConfig:
    """cert_file + key_file: this process's identity (both or neither); ca_file: whom it trusts."""

    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None
    # The files' bytes, read once here (a frozen config handed to child processes carries them).
    ca_pem: bytes = field(init=False, repr=False)
    cert_pem: bytes | None = field(init=False, repr=False)
    key_pem: bytes | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise TlsError("--tls-cert-file and --tls-key-file go together: give both or neither")
        object.__setattr__(self, "ca_pem", _read(self.ca_file, "ca_file"))
        object.__setattr__(self, "cert_pem", _read(self.cert_file, "cert_file") if self.cert_file else None)
        object.__setattr__(self, "key_pem", _read(self.key_file, "key_file") if self.key_file else None)

    @property
    def has_identity(self) -> bool:
        return self.cert_pem is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        """A gRPC server's: this identity, and a client certificate the CA signed required of every caller."""
        if not self.has_identity:
            raise TlsError("a TLS server needs --tls-cert-file and --tls-key-file")
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """A gRPC channel's: the server must chain to the CA; this identity is presented when there is one."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca_pem, private_key=self.key_pem,
                                            certificate_chain=self.cert_pem)

    def server_ssl_context(self) -> ssl.SSLContext:
        """The HTTP front's: this identity; no client certificate asked for (API keys authenticate)."""
        if not self.has_identity:
            raise TlsError("a TLS server needs --tls-cert-file and --tls-key-file")
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert_file, self.key_file)
        return context

    def client_ssl_context(self) -> ssl.SSLContext:
        """An HTTPS client's: the server must chain to the CA and match the host it dials."""
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=self.ca_pem.decode("ascii"))
        if self.has_identity:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context

    def flags(self) -> tuple[str, ...]:
        """The command-line flags that give a child process this config."""
        pairs = (("--tls-ca-file", self.ca_file), ("--tls-cert-file", self.cert_file),
                 ("--tls-key-file", self.key_file))
        return tuple(item for flag, path in pairs if path is not None for item in (flag, path))


def _read(path: str, name: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TlsError(f"{FLAGS[name]} {path}: cannot read it ({exc.strerror})") from exc
    if b"-----BEGIN " not in data:
        raise TlsError(f"{FLAGS[name]} {path}: not a PEM file")
    return data


# -- flags ---------------------------------------------------------------------------
def add_tls_args(parser: argparse.ArgumentParser, server: bool) -> None:
    """The three flags; `server`: a router's or a node's (all three or none), else a client's."""
    group = parser.add_argument_group("TLS")
    if server:
        group.add_argument("--tls-cert-file", metavar="PATH", help="serve TLS with this certificate (PEM), and "
                           "present it to peers; needs --tls-key-file and --tls-ca-file")
        group.add_argument("--tls-key-file", metavar="PATH", help="the private key of --tls-cert-file (PEM)")
        group.add_argument("--tls-ca-file", metavar="PATH", help="trust only peers whose certificate this CA "
                           "signed (mutual TLS between the router and the nodes)")
        return
    group.add_argument("--tls-ca-file", metavar="PATH", help="connect with TLS, trusting this CA (PEM)")
    group.add_argument("--tls-cert-file", metavar="PATH", help="present this client certificate (a gRPC port "
                       "under mutual TLS requires one the CA signed)")
    group.add_argument("--tls-key-file", metavar="PATH", help="the private key of --tls-cert-file")


def tls_from_args(args: argparse.Namespace, server: bool) -> TlsConfig | None:
    """The flags' config (None: no TLS). Raises TlsError naming the flag that is missing or bad."""
    paths = {name: getattr(args, name, None) for name in ("tls_ca_file", "tls_cert_file", "tls_key_file")}
    given = [name for name, path in paths.items() if path]
    if not given:
        return None
    if server and len(given) < 3:
        missing = ", ".join("--" + name.replace("_", "-") for name in paths if name not in given)
        raise TlsError(f"TLS needs --tls-cert-file, --tls-key-file and --tls-ca-file together; missing {missing}")
    if paths["tls_ca_file"] is None:
        raise TlsError("--tls-ca-file is needed to check the server's certificate")
    return TlsConfig(paths["tls_ca_file"], paths["tls_cert_file"], paths["tls_key_file"])


def tls_or_usage_error(parser: argparse.ArgumentParser, args: argparse.Namespace, server: bool) -> TlsConfig | None:
    try:
        return tls_from_args(args, server)
    except TlsError as exc:
        parser.error(str(exc))


# -- servers and channels ----------------------------------------------------------
def add_port(server: grpc.aio.Server, address: str, tls: TlsConfig | None) -> int:
    """Bind `address` plain, or with TLS requiring a client certificate; the bound port (0: failed)."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials())


def aio_channel(address: str, tls: TlsConfig | None, options: Sequence[tuple[str, Any]] | None = None,
                interceptors: Sequence[Any] | None = None) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options, interceptors=interceptors)


def sync_channel(address: str, tls: TlsConfig | None, options: Sequence[tuple[str, Any]] | None = None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.channel_credentials(), options=options)


def http_scheme(tls: TlsConfig | None) -> str:
    return "http" if tls is None else "https"
