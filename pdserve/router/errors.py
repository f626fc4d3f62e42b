"""The router's typed errors and their gRPC status codes: the one place the mapping lives.

Every refusal or failure of a request is a `RouterError` subclass; the server turns it
into a status with `status_of` (bad input also carries a `google.rpc.BadRequest` detail naming
the field: `bad_request_status`), and a node's failed call becomes a `RouterError` with
`from_node_error`. Nothing else in the router picks a status code. This module never
talks to the network and never logs.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status


class RouterError(Exception):
    """A request the router refuses or cannot finish; `code` is what the client sees."""

    code = grpc.StatusCode.INTERNAL


class InvalidRequest(RouterError):
    """Bad input; the message names the field at fault."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class NoNodeAvailable(RouterError):
    """No live node of a kind the request needs."""

    code = grpc.StatusCode.UNAVAILABLE


class NotReady(RouterError):
    """The router cannot serve a request yet (no colocated node, nor a prefill and a decode node,
    registered) or any more (stopping); the message says which."""

    code = grpc.StatusCode.UNAVAILABLE


class RouterDraining(RouterError):
    """The router got SIGTERM: it finishes the requests it has and takes no new one (another
    router, or this one started again, will)."""

    code = grpc.StatusCode.UNAVAILABLE


class Overloaded(RouterError):
    """Every candidate node refused for lack of capacity."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NodeFailed(RouterError):
    """A node call failed or broke its protocol while the request was in flight."""

    code = grpc.StatusCode.UNAVAILABLE


class NodeRefused(RouterError):
    """A registering node whose model, block size, dtype or KV layout differ from the cluster's;
    the message names each field and both values. Registering again would be refused again."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class NeedsNodes(RouterError):
    """A valid request this cluster cannot run as it stands (a beam search with neither a live
    colocated node nor a live prefill + decode pair): FAILED_PRECONDITION, not INVALID_ARGUMENT
    (the same request runs once those nodes join) nor UNAVAILABLE (retrying the same cluster does
    not help). `field` names the option that needs them."""

    code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class ModelNotFound(RouterError):
    """A request naming a model this router does not serve (the HTTP API's `model`)."""

    code = grpc.StatusCode.NOT_FOUND


class RequestKillsNodes(RouterError):
    """A request whose node attempts failed `--max-node-failures-per-request` times: it may be
    what fails them (a query of death), so it goes to no further node."""

    code = grpc.StatusCode.INTERNAL


class DeadlineExceeded(RouterError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status a client sees for an error (anything unexpected is INTERNAL)."""
    if isinstance(error, RouterError):
        return error.code, str(error)
    return grpc.StatusCode.INTERNAL, f"internal router error: {type(error).__name__}: {error}"


def bad_request_status(error: InvalidRequest) -> grpc.Status:
    """INVALID_ARGUMENT with a `google.rpc.BadRequest` detail naming the field at fault, the way
    Google APIs answer bad input (read it with `grpc_status.rpc_status.from_call`)."""
    violation = error_details_pb2.BadRequest.FieldViolation(field=error.field, description=str(error))
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.BadRequest(field_violations=[violation]))
    return rpc_status.to_status(status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=str(error),
                                                  details=[detail]))


def from_node_error(role: str, address: str, error: grpc.aio.AioRpcError) -> RouterError:
    """A node's failed call, as the router error the client should get."""
    code = error.code()
    detail = f"{role} node {address}: {code.name}: {error.details()}"
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest("request", detail)  # the node refused what the router let through
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Overloaded(detail)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(detail)
    return NodeFailed(detail)
