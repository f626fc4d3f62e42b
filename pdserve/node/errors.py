"""Typed node errors and their one mapping onto gRPC status codes.

The engine core reports a failed request as an `ErrorCode` plus a message and never
chooses a gRPC status itself; the front turns that into a status with `grpc_status`, here
and nowhere else. An engine's refusal becomes a node error here too (`rejection_error`),
the same on every node kind.

Must never: be bypassed by a front that picks a gRPC status code on its own.
"""

from __future__ import annotations

import enum

import grpc

from pdserve.engine.admission import KVCapacityExceeded, RequestRejected


class ErrorCode(enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"  # the request can never be served here
    RESOURCE_EXHAUSTED = "resource_exhausted"  # not here, not now: queue full, too few blocks
    FAILED_PRECONDITION = "failed_precondition"  # KV caches of the two nodes do not match
    UNAVAILABLE = "unavailable"  # a peer or the transfer failed; another node may succeed
    DEADLINE_EXCEEDED = "deadline_exceeded"  # a lease ran out
    INTERNAL = "internal"  # a bug or a dead engine core


_GRPC_STATUS = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
}


class NodeError(Exception):
    """A request failed on this node; `code` says how the caller should react."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def rejection_error(exc: RequestRejected) -> NodeError:
    """The engine refused a request. KV that can never fit this node's cache is this node's
    limit, not bad input: RESOURCE_EXHAUSTED, so the router tries a node with more blocks."""
    if isinstance(exc, KVCapacityExceeded):
        return NodeError(ErrorCode.RESOURCE_EXHAUSTED, f"prompt + max_tokens need {exc.blocks_needed} KV blocks; "
                                                       f"this node has {exc.num_blocks}")
    return NodeError(ErrorCode.INVALID_ARGUMENT, str(exc))


def grpc_status(code: ErrorCode) -> grpc.StatusCode:
    return _GRPC_STATUS[code]


async def abort_rpc(context: grpc.aio.ServicerContext, error: NodeError) -> None:
    """End the RPC with the status of `error` (raises, as `context.abort` does)."""
    await context.abort(grpc_status(error.code), error.message)
