"""The optional shared-secret token every pdserve process may require of its callers.

Owns: loading the token (`--auth-token-file PATH`, else the `PDSERVE_AUTH_TOKEN`
value the CLI edge hands over), the grpc.aio server interceptor that refuses a call
without `authorization: Bearer <token>` with UNAUTHENTICATED, and the client side that
attaches that header to every call on a channel. The same token guards the public API,
the node services, the router's Registry and the KV transfer handshake.

No token configured means no check: every call is allowed and channels carry no header.
Must never: read the environment itself (callers pass it in, at the CLI edge), log or
print a token, or compare tokens with anything but `hmac.compare_digest`.
"""

from __future__ import annotations

import argparse
import hmac
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from pdserve.common.grpc_standard import is_health_call

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
class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call whose `authorization` metadata is not `Bearer <token>`, but the
    standard Health service's (common/grpc_standard.py)."""

    def __init__(self, token: str) -> None:
        self._expected = (SCHEME + check_token(token, "auth token")).encode()

    def authorized(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        presented = next((value for key, value in metadata or () if key == METADATA_KEY), None)
        if presented is None:
            return False
        if isinstance(presented, str):
            presented = presented.encode("utf-8", "replace")
        return hmac.compare_digest(presented, self._expected)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        # Health answers anyone (a probe sends no token; it learns only SERVING or not).
        if is_health_call(handler_call_details.method) or self.authorized(handler_call_details.invocation_metadata):
            return handler
        return _refusal_like(handler)


def server_interceptors(token: str | None) -> list[grpc.aio.ServerInterceptor]:
    return [] if token is None else [TokenAuthInterceptor(token)]


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Options of every pdserve gRPC server: gRPC itself refuses a larger request with
    RESOURCE_EXHAUSTED before any pdserve code reads it; and no SO_REUSEPORT (gRPC's
    default), so a second server on a port in use fails to bind instead of sharing it."""
    return [("grpc.max_receive_message_length", max_message_bytes), ("grpc.so_reuseport", 0)]


_REFUSAL = f"missing or wrong auth token: send metadata '{METADATA_KEY}: {SCHEME}<token>'"


async def _refuse(context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)


def _refusal_like(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the same streaming shape as `handler` that only refuses."""
    streams_in = handler is not None and handler.request_streaming
    streams_out = handler is not None and handler.response_streaming

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> None:
        await _refuse(context)

    async def streaming(request: Any, context: grpc.aio.ServicerContext):
        await _refuse(context)
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


def insecure_channel(address: str, token: str | None = None,
                     options: ChannelOptions | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to `address` whose calls carry the token (none: a plain channel)."""
    interceptors = None if token is None else [UnaryBearerToken(token), StreamBearerToken(token)]
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
