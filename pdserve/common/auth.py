"""Who may call what: the node join credential, the router's client API keys, and their checks.

Two credentials. The node join credential (`--auth-token-file PATH`, else the
`PDSERVE_AUTH_TOKEN` value the CLI edge hands over) is the cluster's shared secret: it
guards the node services, the router's Registry (registering a node, heartbeats), the KV
transfer handshake, and the public API too. Client API keys (the router's `--api-keys-file`,
pdserve/common/api_keys.py) open the public API only: a call with one to the Registry is refused
PERMISSION_DENIED, naming the credential it takes; a node knows no API key, so it refuses one
UNAUTHENTICATED, as it refuses a wrong token, and so does a KV listener.

Owns: loading the token, `Credentials` (the one rule above), the grpc.aio server interceptor
that applies it to every call but the standard Health service's, and the client side that
attaches `authorization: Bearer <token>` to every call on a channel.

No token configured means no check: every call is allowed and channels carry no header.
Must never: read the environment itself (callers pass it in, at the CLI edge), log or
print a token, or compare tokens with anything but `hmac.compare_digest`.
"""

from __future__ import annotations

import argparse
import hmac
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from pdserve.common.grpc_standard import is_health_call
from pdserve.common.tls import TlsConfig, aio_channel

if TYPE_CHECKING:
    from pdserve.common.api_keys import ApiKeys

TOKEN_ENV = "PDSERVE_AUTH_TOKEN"
METADATA_KEY = "authorization"
SCHEME = "Bearer "
# A token travels as an HTTP/2 header value: visible ASCII, no spaces.
_TOKEN_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F))

ChannelOptions = Sequence[tuple[str, Any]]


class TokenError(ValueError):
    """A token file or value that cannot be used; the message names its source."""


def check_token(token: str, source: str) -> str:
    """`token` if it can travel as a bearer token, else TokenError naming `source`."""
    if not token:
        raise TokenError(f"{source}: the auth token is empty")
    bad = sorted({c for c in token if c not in _TOKEN_CHARS})
    if bad:
        raise TokenError(f"{source}: the auth token may hold only visible ASCII (no spaces), found {bad!r}")
    return token


def read_token_file(path: str | Path) -> str:
    """The token in `path`, surrounding whitespace (a trailing newline) stripped."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenError(f"--auth-token-file {path}: cannot read it ({exc})") from exc
    return check_token(text.strip(), f"--auth-token-file {path}")


def token_from_cli(token_file: str | None, environ: Mapping[str, str]) -> str | None:
    """The token a command line asks for: the file wins, then `$PDSERVE_AUTH_TOKEN`;
    neither (or an empty variable) is None: authentication off."""
    if token_file:
        return read_token_file(token_file)
    value = environ.get(TOKEN_ENV, "").strip()
    return check_token(value, f"${TOKEN_ENV}") if value else None


def token_or_usage_error(parser: argparse.ArgumentParser, token_file: str | None,
                         environ: Mapping[str, str]) -> str | None:
    """`token_from_cli` for a command's `main`: a token file that is missing, empty or
    unreadable (or a bad variable) is a usage error — one line naming it, exit status 2."""
    try:
        return token_from_cli(token_file, environ)
    except TokenError as exc:
        parser.error(str(exc))


def add_auth_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--auth-token-file", metavar="PATH", default=None,
                        help=f"require and send this shared secret (default: ${TOKEN_ENV}; neither: no auth)")


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata one call carries (for stubs used without an authenticated channel)."""
    return () if token is None else ((METADATA_KEY, SCHEME + token),)


# -- server side ---------------------------------------------------------------------
Refusal = tuple[grpc.StatusCode, str]


@dataclass(frozen=True)
class Credentials:
    """The rule of one server: the node join credential opens every service; an API key (the
    router's, when it has any) opens every service but `node_services`."""

    node_token: str
    api_keys: ApiKeys | None = None
    node_services: frozenset[str] = frozenset()  # full gRPC service names, e.g. the Registry's

    def __post_init__(self) -> None:
        check_token(self.node_token, "auth token")

    def refusal(self, service: str, authorization: str | bytes | None) -> Refusal | None:
        """None if a call to `service` with this `authorization` header value may go on."""
        if authorization is None:
            return grpc.StatusCode.UNAUTHENTICATED, _REFUSAL
        presented = authorization.encode("utf-8", "replace") if isinstance(authorization, str) else authorization
        if hmac.compare_digest(presented, (SCHEME + self.node_token).encode()):
            return None
        key = presented[len(SCHEME):] if presented.startswith(SCHEME.encode()) else None
        if self.api_keys is None or key is None or not self.api_keys.valid(key):
            return grpc.StatusCode.UNAUTHENTICATED, _REFUSAL
        if service in self.node_services:
            return grpc.StatusCode.PERMISSION_DENIED, (f"an API key opens only the public API, not {service}: that "
                                                       "takes the node join credential (--auth-token-file)")
        return None


def bearer_of(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | bytes | None:
    return next((value for key, value in metadata or () if key == METADATA_KEY), None)


def service_of(method: str) -> str:
    """"/pdserve.node.v1.Registry/Register" -> "pdserve.node.v1.Registry"."""
    return method.strip("/").split("/", 1)[0]


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Applies `Credentials` to every call but the standard Health service's (pdserve/common/grpc_standard.py)."""

    def __init__(self, credentials: Credentials) -> None:
        self._credentials = credentials

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        # Health answers anyone (a probe sends no token; it learns only SERVING or not).
        if is_health_call(method):
            return handler
        refusal = self._credentials.refusal(service_of(method),
                                            bearer_of(handler_call_details.invocation_metadata))
        return handler if refusal is None else _refusal_like(handler, refusal)


def server_interceptors(token: str | None, api_keys: ApiKeys | None = None,
                        node_services: frozenset[str] = frozenset()) -> list[grpc.aio.ServerInterceptor]:
    """A node's (the token alone) or the router's (API keys too, refused the `node_services`)."""
    return [] if token is None else [AuthInterceptor(Credentials(token, api_keys, node_services))]


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Options of every pdserve gRPC server: gRPC itself refuses a larger request with
    RESOURCE_EXHAUSTED before any pdserve code reads it; and no SO_REUSEPORT (gRPC's
    default), so a second server on a port in use fails to bind instead of sharing it."""
    return [("grpc.max_receive_message_length", max_message_bytes), ("grpc.so_reuseport", 0)]


_REFUSAL = f"missing or wrong auth token: send metadata '{METADATA_KEY}: {SCHEME}<token>'"


def _refusal_like(handler: grpc.RpcMethodHandler | None, refusal: Refusal) -> grpc.RpcMethodHandler:
    """A handler of the same streaming shape as `handler` that only refuses."""
    streams_in = handler is not None and handler.request_streaming
    streams_out = handler is not None and handler.response_streaming

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(*refusal)

    async def streaming(request: Any, context: grpc.aio.ServicerContext):
        await context.abort(*refusal)
        yield  # never reached: an async generator, as a streaming handler must be

    if streams_in and streams_out:
        return grpc.stream_stream_rpc_method_handler(streaming)
    if streams_in:
        return grpc.stream_unary_rpc_method_handler(unary)
    if streams_out:
        return grpc.unary_stream_rpc_method_handler(streaming)
    return grpc.unary_unary_rpc_method_handler(unary)


# -- client side ---------------------------------------------------------------------
class _BearerToken:
    def __init__(self, token: str) -> None:
        self._metadata = call_metadata(check_token(token, "auth token"))

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._metadata)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


# Two classes: a grpc.aio channel files each interceptor under the first call type it matches.
class UnaryBearerToken(_BearerToken, grpc.aio.UnaryUnaryClientInterceptor):
    """Adds `authorization: Bearer <token>` to every unary call."""

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._with_token(client_call_details), request)


class StreamBearerToken(_BearerToken, grpc.aio.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every server-streaming call."""

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._with_token(client_call_details), request)


def open_channel(address: str, token: str | None = None, options: ChannelOptions | None = None,
                 tls: TlsConfig | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to `address` whose calls carry the token (none: no header), over TLS
    when `tls` is given (pdserve/common/tls.py), else plain."""
    interceptors = None if token is None else [UnaryBearerToken(token), StreamBearerToken(token)]
    return aio_channel(address, tls, options=options, interceptors=interceptors)
