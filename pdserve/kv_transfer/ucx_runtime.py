"""The process's UCX event loop: one background thread that owns every ucxx call.

ucxx keeps one process-wide context whose progress and Python futures are bound to the
event loop that created it, so this process gets exactly one loop thread, shared by all
`UcxTransport` instances in it (created on first use; the first config's UCX options
win). The engine's thread only ever hands coroutines or callbacks to this loop. UCX is kept
to the network interface that holds the configured host, and to the configured TCP port when
there is one (pdserve/kv_transfer/netdev.py).

Also owns the small helpers that put control messages and raw buffers on an endpoint.

Must never: run on the caller's thread, or import ucxx before the first transport
needs it (importing pdserve.kv_transfer must not start UCX).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import Coroutine
from types import ModuleType
from typing import Any

import numpy as np
import torch

from .config import KVTransferConfig
from .netdev import net_devices, tcp_port
from .wire import ControlMsg

logger = logging.getLogger(__name__)


class UcxRuntime:
    """A daemon thread running an asyncio loop with ucxx initialised on it."""

    _instance: UcxRuntime | None = None
    _instance_lock = threading.Lock()

    @classmethod
    def get(cls, config: KVTransferConfig) -> UcxRuntime:
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls(config)
            return cls._instance

    def __init__(self, config: KVTransferConfig) -> None:
        self.port = config.port  # UCX's TCP port, when pinned (0: the OS's pick, not known here)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="pdserve-kv-ucx", daemon=True)
        self._thread.start()
        self.ucxx: ModuleType = self.call(self._init_ucx(config), config.init_timeout_s)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def _init_ucx(self, config: KVTransferConfig) -> ModuleType:
        # ucxx's own default env (UCX_MEMTYPE_CACHE) makes UCX warn on every start.
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        import ucxx

        options = {"TLS": config.ucx_tls} if config.ucx_tls else {}
        options.update(net_devices(config.host, os.environ))
        options.update(tcp_port(config.port))
        try:
            # Python futures: awaiting a request parks the coroutine instead of
            # spinning on asyncio.sleep(0), which would steal the GIL from the engine.
            ucxx.init(options=options, progress_mode=config.progress_mode,
                      enable_python_future=True)
        except RuntimeError:
            logger.warning("ucxx was initialised elsewhere in this process; reusing it")
        ucxx.continuous_ucx_progress(event_loop=self.loop)
        return ucxx

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        """Run `coro` on the loop and wait for it (setup/teardown only, never per step)."""
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"UCX operation did not finish in {timeout:.1f}s") from None

    def call_soon(self, fn: Any, *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)


def as_bytes_array(raw: torch.Tensor) -> np.ndarray:
    """A flat uint8 CPU tensor as the numpy array ucxx sends from / receives into."""
    return raw.numpy()


async def send_ctrl(ep: Any, msg: ControlMsg) -> None:
    await ep.send(np.frombuffer(msg.encode(), dtype=np.uint8))


async def recv_ctrl(ep: Any, buf: np.ndarray) -> ControlMsg:
    """Receive one control message into `buf` (sized max_control_bytes) and decode it."""
    await ep.recv(buf)
    return ControlMsg.decode(buf.data)


class TaggedEndpoint:
    """One side of a connection made from worker addresses: an endpoint to the peer's worker
    that sends on `send_tag` and receives on `recv_tag` (UCX keeps each tag's messages in
    order). Receives are matched on the worker but tied to the endpoint, so a peer's failure
    seen by the endpoint cancels them."""

    def __init__(self, ep: Any, send_tag: int, recv_tag: int) -> None:
        self.ep, self.send_tag, self.recv_tag = ep, send_tag, recv_tag

    async def send(self, buf: np.ndarray) -> None:
        await self.ep.send(buf, tag=self.send_tag, force_tag=True)

    async def recv(self, buf: np.ndarray) -> None:
        await self.ep.recv(buf, tag=self.recv_tag, force_tag=True)

    def abort(self, period: int, max_attempts: int) -> None:
        self.ep.abort(period=period, max_attempts=max_attempts)


def abort_endpoint(ep: Any, timeout_s: float) -> None:
    """Close an endpoint without waiting on the peer; bounded by `timeout_s`."""
    if ep is None:
        return
    try:
        ep.abort(period=int(timeout_s * 1e9), max_attempts=1)
    except Exception:  # already closed or broken: nothing left to release
        logger.debug("endpoint abort failed", exc_info=True)
