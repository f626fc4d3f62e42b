"""The engine-core process of a node: engine + KV transport (if its kind moves KV) + the step loop.

Runs only in the child that pdserve/node/core/spawn.py spawns. `core_main` gets the node kind's
`CorePart` (pdserve/node/core/core_part.py): it imports the kind's KV stage factories, builds the
`EngineCore` with the kind's policy (with `--tensor-parallel-size T`, as rank 0 of T: the
worker ranks start first, pdserve/ranks/tp_group.py), registers rank 0's KV caches with the
`--kv-transport` (`UcxTransport` or `TorchTransport`, pdserve/kv_transfer/) beside the workers' own in one `RankedTransport` (pdserve/ranks/kv_ranks.py; not for a
kind without KV stages), builds the node core (pdserve/node/core/node_core.py) with the kind's stages, logs the cpus and torch
threads it runs on, says `CoreStarted` with the KV fingerprint every kind registers with
(or `CoreFailed`; `refused=True` and no traceback for a model folder the engine refuses, whose
one line the front prints), then loops:

    drain front messages (non-blocking; a short poll timeout only when there is no work)
    step the engine when it has work       → handler.after_step(outputs)
        (a step that raised on one rank: handler.fail for each of its requests; the node serves on)
    handler.poll(now): transfers, done messages, leases
    push a stats snapshot to the front when stats_push_interval_s has passed (after a
        step, or on an idle poll timeout): the front heartbeats the router with it, so a
        core busy in a long step never makes its node look dead
    exit on Shutdown, or when the front process has gone; fail when a worker rank has died

Must never: block on the network (pushes and done messages are polled, a new peer is
connected off the loop), pickle a message, or outlive its front.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import zmq

from pdserve.common.refusal import Refused
from pdserve.engine.engine_core import EngineCore, StepFailed
from pdserve.kv_transfer import KVCacheSpec
from pdserve.common.affinity import format_cpu_list
from pdserve.node.config import NodeConfig
from pdserve.node.core.spawn import CoreAddresses
from pdserve.node.core.core_part import CoreHandler, CorePart, ToFront
from pdserve.node.core.fault_drills import poison_token, slow_every_step
from pdserve.ranks.kv_ranks import LocalRank, RankedTransport, rank_cache_spec
from pdserve.node.messages import (CoreFailed, CoreStarted, Message, MessageError, PrefillSubmit, Shutdown, StatsData,
                                   StatsPush, StatsQuery, StatsReply, StreamSubmit, decode, encode)
from pdserve.node.core.stats import build_stats
from pdserve.node.core.node_core import make_node_core
from pdserve.ranks.tp_group import TPGroup, start_engine

logger = logging.getLogger(__name__)

class StopFlag:
    """Set by SIGTERM; the loop checks it every iteration and exits cleanly."""

    def __init__(self) -> None:
        self.is_set = False

    def set(self, *_: object) -> None:
        self.is_set = True


def core_main(config: NodeConfig, addresses: CoreAddresses, part: CorePart, front_pid: int) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {config.kind}-core %(levelname)s %(message)s")
    # The front owns shutdown: Ctrl-C reaches the whole process group and the front answers
    # it with Shutdown. SIGTERM (a group kill) ends the loop cleanly, transport closed.
    stop = StopFlag()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, stop.set)
    zctx = zmq.Context()
    inbox = zctx.socket(zmq.PULL)
    inbox.connect(addresses.to_core)
    outbox = zctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDHWM, 0)  # never block the loop on a slow front
    outbox.connect(addresses.from_core)

    def to_front(msg: Message) -> None:
        outbox.send(encode(msg))

    owned = _Owned()
    exit_code = 0
    try:
        engine, handler = _build(config, part, to_front, owned)
        _CoreLoop(config, engine, owned.transport, handler, inbox, to_front, front_pid, stop, owned.group).run()
    except Refused as exc:  # a configuration this node cannot serve: the front prints the one line
        to_front(CoreFailed(exc.cli_message(), refused=True))
        exit_code = exc.exit_code
    except Exception as exc:  # startup or loop failure (a worker rank that died among them): tell the front
        logger.exception("engine core failed")
        to_front(CoreFailed(f"{type(exc).__name__}: {exc}"))
        exit_code = 1
    finally:
        start = time.monotonic()
        owned.close()
        inbox.close(linger=0)
        outbox.close(linger=1000)
        zctx.term()
        logger.info("engine core stopped in %.2fs", time.monotonic() - start)
    # Everything this process owns is closed; skip the interpreter's seconds-long teardown
    # of torch and UCX so that a node stops as fast as it is asked to.
    logging.shutdown()
    os._exit(exit_code)


class _Owned:
    """What the core starts besides the engine, closed in reverse order however the core ends."""

    def __init__(self) -> None:
        self.group: TPGroup | None = None
        self.transport: RankedTransport | None = None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        if self.group is not None:
            self.group.close()


def _build(config: NodeConfig, part: CorePart, to_front: ToFront, owned: _Owned) -> tuple[EngineCore, CoreHandler]:
    import torch
    from transformers.utils import logging as hf_logging

    # No progress bars in a server's log; their tqdm lock would also be a named semaphore
    # in this spawned process that `os._exit` leaves for the resource tracker to reap.
    hf_logging.disable_progress_bar()
    make_stages = part.load_stage_factories()  # before the model loads: a bad part fails fast
    engine, owned.group = start_engine(config.engine, part.policy(), config.transfer if part.uses_kv_transport else None,
                                       config.cpus, config.kind)
    slow_every_step(engine, config.debug_step_delay_s)  # fault drills only; no-ops by default
    poison_token(engine, config.debug_poison_token_id, config.debug_poison_action)
    # What the node really runs on (tests and operators read this line; cores as devices).
    ranks = engine.loaded.shard.size
    logger.info("engine core%s on cpus %s with %d torch threads", f" (rank 0 of {ranks})" if ranks > 1 else "",
                format_cpu_list(os.sched_getaffinity(0)), torch.get_num_threads())
    spec = rank_cache_spec(engine.config, engine.loaded)  # every kind registers with it, KV transport or not
    descriptor = None
    if part.uses_kv_transport:
        owned.transport = _start_transport(config, engine, spec, owned.group)
        descriptor = owned.transport.descriptor()
    handler = make_node_core(config, engine, to_front, part.local_prefill)
    handler.stages = [make(config, handler, owned.transport, descriptor) for make in make_stages]
    layout = (descriptor.layout_id, descriptor.to_bytes().decode()) if descriptor is not None else ("", "")
    to_front(CoreStarted(spec.fingerprint(), *layout))
    return engine, handler


def _start_transport(config: NodeConfig, engine: EngineCore, spec: KVCacheSpec,
                     group: TPGroup | None) -> RankedTransport:
    """Rank 0's own transport, beside the workers' (each registered its caches when it started)."""
    from pdserve.kv_transfer import make_transport  # starts UCX (if chosen): only ever in the core process

    if config.transfer.transport == "ucx" and engine.config.device != "cpu":
        raise ValueError(f"kv_transport ucx moves host caches only; with --device {engine.config.device} "
                         f"use --kv-transport torch on every prefill and decode node")
    local = make_transport(config.transfer)
    local.register(engine.runner.k_caches, engine.runner.v_caches, spec)
    workers = group.links() if group is not None else []
    return RankedTransport([LocalRank(local), *workers], closers=[local])


class _CoreLoop:
    def __init__(self, config: NodeConfig, engine: EngineCore, transport: RankedTransport | None,
                 handler: CoreHandler, inbox: zmq.Socket, to_front: ToFront, front_pid: int, stop: StopFlag,
                 group: TPGroup | None = None) -> None:
        self.config = config
        self.engine = engine
        self.transport = transport
        self.handler = handler
        self.inbox = inbox
        self.to_front = to_front
        self.front_pid = front_pid
        self.stop = stop
        self.group = group  # the node's other tensor-parallel ranks, if any
        # The transport's thread wakes an idle loop the moment a done message lands.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        if transport is not None:
            transport.set_done_callback(lambda req_id, payload: self._wake())
        self.poller = zmq.Poller()
        self.poller.register(inbox, zmq.POLLIN)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self._stalled = False
        self._stats_pushed_at = float("-inf")
        self._placed_through = 0  # the highest placement stamp taken in (StatsData.placed_through)

    def run(self) -> None:
        try:
            while not self.stop.is_set and self._drain(self._timeout_ms()):
                self._step()
                now = time.monotonic()
                self.handler.poll(now)
                self._push_stats(now)
                if os.getppid() != self.front_pid:
                    logger.warning("front process is gone; engine core exits")
                    return
                if self.group is not None:
                    self.group.check_alive()  # WorkerDied: the node goes down now, not at the next step
        finally:
            if self.transport is not None:
                self.transport.set_done_callback(None)
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _timeout_ms(self) -> int:
        if self.engine.has_unfinished() and not self._stalled:
            return 0
        if self._stalled or self.handler.wants_fast_poll():
            return self.config.busy_poll_ms
        return self.config.idle_poll_ms

    def _drain(self, timeout_ms: int) -> bool:
        """Handle every queued front message; False once told to shut down."""
        events = dict(self.poller.poll(timeout_ms))
        if self._wake_r in events:
            _drain_pipe(self._wake_r)
        if self.inbox not in events:
            return True
        while True:
            try:
                raw = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            try:
                msg = decode(raw)
            except MessageError as exc:  # a front bug: drop the message, keep serving
                logger.error("%s", exc)
                continue
            if isinstance(msg, Shutdown):
                return False
            if isinstance(msg, StatsQuery):
                self.to_front(StatsReply(msg.query_id, self._snapshot()))
                continue
            if isinstance(msg, (StreamSubmit, PrefillSubmit)):  # taken in: from now on the stats show it
                self._placed_through = max(self._placed_through, msg.placement_stamp)
            self.handler.handle(msg)

    def _step(self) -> None:
        if not self.engine.has_unfinished():
            self._stalled = False
            return
        try:
            outputs = self.engine.step()
        except StepFailed as failed:
            # One request's poison fails the requests of its step, not the node: the router
            # retries them elsewhere at most --max-node-failures-per-request times in all.
            logger.error("a step failed; failing its %d requests %s: %s", len(failed.req_ids), failed.req_ids, failed)
            for req_id in failed.req_ids:
                self.handler.fail(req_id, f"the model failed on a step of this request: {failed}")
            outputs = []
        self.handler.after_step(outputs)
        # Waiting requests that no free block can admit: poll gently until blocks free up.
        self._stalled = self.engine.has_unfinished() and not self.engine.scheduler.running

    def _snapshot(self) -> StatsData:
        stats = build_stats(self.config.kind, self.engine, self.transport, self.handler.num_blocks_outside_scheduler())
        stats.placed_through = self._placed_through
        return stats

    def _push_stats(self, now: float) -> None:
        if now - self._stats_pushed_at < self.config.stats_push_interval_s:
            return
        self._stats_pushed_at = now
        self.to_front(StatsPush(self._snapshot()))

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (a wake-up is pending anyway) or closed


def _drain_pipe(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
