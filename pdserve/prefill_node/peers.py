"""Connections from a prefill node to decode nodes' KV caches, one per peer, made once.

A decode node is named by its layout's id (its rank 0's `address:port` and the run of the node:
a decode node started again on its old addresses is a new peer, connected afresh). The first request for a
peer starts the connection (handshake + fingerprint check) on a worker thread, so the
core's step loop never waits on it; requests poll `state()` until it resolves. A failed
connection is reported to every request waiting on it and then forgotten, so the next
request tries again; `forget` drops a peer whose transfers failed for the same reason.

Must never: connect on the step loop's thread (unless given no executor: unit tests).
"""

from __future__ import annotations

from concurrent.futures import Executor, Future

from pdserve.kv_transfer import FingerprintMismatch
from pdserve.node.errors import ErrorCode, NodeError
from pdserve.ranks.kv_ranks import NodeKVDescriptor, RankedTransport


class PeerConnections:
    def __init__(self, transport: RankedTransport, executor: Executor | None = None) -> None:
        self._transport = transport
        self._executor = executor
        self._peers: dict[str, Future[str]] = {}

    def request(self, descriptor: NodeKVDescriptor) -> str:
        """Start connecting unless connected or connecting; the peer's key (its layout id)."""
        key = descriptor.layout_id
        if key not in self._peers:
            self._peers[key] = self._connect(descriptor)
        return key

    def state(self, key: str) -> tuple[str | None, NodeError | None]:
        """(transport peer id, None) once connected; (None, error) if it failed; (None, None) pending."""
        future = self._peers.get(key)
        if future is None:
            return None, NodeError(ErrorCode.UNAVAILABLE, f"no connection to the decode node's KV cache at {key}")
        if not future.done():
            return None, None
        exc = future.exception()
        if exc is None:
            return future.result(), None
        if isinstance(exc, FingerprintMismatch):
            return None, NodeError(ErrorCode.FAILED_PRECONDITION, str(exc))
        return None, NodeError(ErrorCode.UNAVAILABLE, f"cannot connect to the KV cache at {key}: {exc}")

    def forget(self, key: str) -> None:
        self._peers.pop(key, None)

    def prune_failed(self) -> None:
        """Drop failed connections once every waiting request has seen the failure."""
        for key in [k for k, f in self._peers.items() if f.done() and f.exception() is not None]:
            del self._peers[key]

    def _connect(self, descriptor: NodeKVDescriptor) -> Future[str]:
        if self._executor is not None:
            return self._executor.submit(self._transport.connect, descriptor)
        future: Future[str] = Future()
        try:
            future.set_result(self._transport.connect(descriptor))
        except Exception as exc:  # reported through state(), like a worker's failure
            future.set_exception(exc)
        return future
