"""`pdserve cluster --tls`: a private CA and one certificate for a local cluster's processes.

Owns the files: `ca.pem` (the CA's certificate, what a client trusts: `curl --cacert`),
`cert.pem` and `key.pem` (the cluster's certificate and its key, 0600), made fresh for each
cluster; and `token` (0600), the node join credential, when the user gave none. The router and every node serve with that certificate and present it to each other,
so mutual TLS holds among them; it names every address they dial (`127.0.0.1`, `localhost`
and the cluster's --host, as IP or DNS names) and is good for both server and client use.
The CA's private key is never written: nothing but this cluster can be signed by it.

Must never: overwrite files it did not make (it writes into a directory of its own), or make a
key readable by anyone but its owner.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
import sys
import tempfile
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import TextIO

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdserve.cluster_config import ClusterConfig
from pdserve.common.tls import TlsConfig

CA_FILE, CERT_FILE, KEY_FILE, TOKEN_FILE = "ca.pem", "cert.pem", "key.pem", "token"
VALID_DAYS = 30  # a local cluster's certificates; `--tls-cert-file` for anything that lives longer
LOCAL_NAMES = ("127.0.0.1", "localhost")


def make_cluster_tls(directory: str | os.PathLike, hosts: Iterable[str] = (), name: str = "pdserve cluster",
                     days: int = VALID_DAYS) -> TlsConfig:
    """A new CA and a certificate it signs for `hosts` (and the local names), written into
    `directory` (made 0700 if missing); the config that uses them."""
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _ca_certificate(ca_key, f"{name} CA", days)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _leaf_certificate(key.public_key(), ca_key, ca_cert, name, (*LOCAL_NAMES, *hosts), days)
    _write(directory / CA_FILE, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
    _write(directory / CERT_FILE, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    _write(directory / KEY_FILE, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()), 0o600)
    return TlsConfig(str(directory / CA_FILE), str(directory / CERT_FILE), str(directory / KEY_FILE))


def client_flags(config: ClusterConfig) -> tuple[str, ...]:
    """What a gRPC client of this cluster passes: its TLS files and the token file, when it has them."""
    if config.tls is None:
        return ()
    return (*config.tls.flags(), *(("--auth-token-file", config.auth_token_file) if config.auth_token_file else ()))


def _ca_certificate(key: ec.EllipticCurvePrivateKey, common_name: str, days: int) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    return (_builder(subject, subject, key.public_key(), days)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))


def _leaf_certificate(public_key: ec.EllipticCurvePublicKey, ca_key: ec.EllipticCurvePrivateKey,
                      ca_cert: x509.Certificate, common_name: str, names: Iterable[str],
                      days: int) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    return (_builder(subject, ca_cert.subject, public_key, days)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(_alt_names(names)), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey,
             days: int) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    # Back-dated a little: a peer whose clock is a few minutes behind still accepts it.
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days)))


def _alt_names(names: Iterable[str]) -> list[x509.GeneralName]:
    """An IP address as an IP name (what gRPC and Python's ssl check for a numeric target), else DNS."""
    alt: list[x509.GeneralName] = []
    for name in dict.fromkeys(name.strip("[]") for name in names):
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt.append(x509.DNSName(name))
    return alt


def _write(path: Path, data: bytes, mode: int) -> None:
    # Created with its mode: a key is never readable by others, not even for a moment.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(path, mode)  # an existing file keeps its old mode through O_CREAT


def with_cluster_tls(config: ClusterConfig, cleanup: ExitStack, token: str | None,
                     out: TextIO = sys.stdout) -> ClusterConfig:
    """`config` with the certificates --tls asks for made (in --tls-dir, else in a temporary
    directory `cleanup` removes when the launcher exits), and a node join credential beside them
    when `token` (the launcher's) is None: no KV transport runs TLS here, so the credential is what
    authenticates the KV data plane. Unchanged without TLS; the user's own TLS files without a
    credential are a ValueError naming the flag."""
    if not config.make_tls:
        if config.tls is not None and token is None:
            raise ValueError("--tls-cert-file needs the node join credential (--auth-token-file or "
                             "$PDSERVE_AUTH_TOKEN): it authenticates the KV data plane, which runs no TLS")
        return config
    directory = Path(config.tls_dir or cleanup.enter_context(tempfile.TemporaryDirectory(prefix="pdserve-tls-")))
    tls = make_cluster_tls(directory, [config.host])
    print(f"TLS: a private CA for this cluster at {tls.ca_file} (clients trust it: curl --cacert {tls.ca_file}); "
          f"the cluster's certificate {tls.cert_file}, its key {tls.key_file}", file=out, flush=True)
    if token is not None:
        return replace(config, tls=tls, make_tls=False, tls_dir=None)
    token_file = directory / TOKEN_FILE
    _write(token_file, (secrets.token_urlsafe(32) + "\n").encode(), 0o600)
    print(f"node join credential: made for this cluster at {token_file} (it authenticates the KV data plane, which "
          "runs no TLS; the public API takes it too)", file=out, flush=True)
    return replace(config, tls=tls, make_tls=False, tls_dir=None, auth_token_file=str(token_file))
