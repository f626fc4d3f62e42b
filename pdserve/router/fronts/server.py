"""The router process: the public `Generation` service and the nodes' `Registry`, on one port.

Owns the grpc.aio server, the servicers (thin: validate, hand to the orchestrator or
the registry, turn a `RouterError` into a status via `errors.status_of`; `Generate`'s
stream is observed by `RouterMetrics`), the optional `/metrics` + `/health` endpoint (200
only while the router can serve a request: `RouterServer.health`), the registry maintenance loop, signal handling and
`main(argv)` for `pdserve router`: a port that cannot be had (`--port`, `--metrics-port`) is
one line naming the flag and exit status 2; Ctrl-C stops gracefully with 130, SIGTERM drains
(`RouterServer.drain`: new requests refused UNAVAILABLE / HTTP 503, the ones in flight given
`--drain-timeout-s` to finish) and exits 0. It loads only the tokenizer and config of the model, never weights, and never runs model
code.

Every service on the port sits behind the optional shared-secret token (pdserve/common/auth.py),
the Registry included: nodes and clients dial one address, and no node joins without the
token. gRPC itself refuses a request message over `max_message_bytes` with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path

import grpc
import uvloop
from prometheus_client import CollectorRegistry

from pdserve.common.api_keys import ApiKeys
from pdserve.common.auth import Credentials, add_auth_args, server_interceptors, server_options, token_from_cli
from pdserve.common.config_flags import add_config_args, values_from_args
from pdserve.common.lifecycle import ExitStatus, ServerPhase, StopSignals, supervisor_of
from pdserve.common.grpc_standard import StandardServices
from pdserve.common.metrics_endpoint import Health, HealthCheck, MetricsEndpoint
from pdserve.common.ports import Listen, PortUnavailable, check_free, unavailable
from pdserve.common.refusal import Refused
from pdserve.common.tls import add_port, add_tls_args, http_scheme, tls_from_args
from pdserve.engine.structured_output import library_loaded, load_library
from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2, pdserve_pb2_grpc
from pdserve.router.requests.admission import Admission
from pdserve.router.config import AdmissionLimits, RequestLimits, RouterConfig
from pdserve.router.errors import InvalidRequest, RouterError, bad_request_status, status_of
from pdserve.router.fronts.http_server import HTTPFront, ServedModel
from pdserve.router.fronts.metrics import RouterMetrics, grpc_end_status, http_end_status
from pdserve.router.model import RouterModel, load_router_model
from pdserve.router.cluster.node_facts import RouterFacts
from pdserve.router.dispatch.orchestrator import Orchestrator
from pdserve.router.cluster.placement import DecodePlacement, PrefillPlacement
from pdserve.router.cluster.registry import NodeKind, NodeRegistry, node_channel_factory
from pdserve.router.dispatch.state import RouterState
from pdserve.router.requests.validation import RequestValidator, live_capacity

log = logging.getLogger(__name__)
_COUNT_ATTEMPTS = 3  # reads of the node table from another thread (see _live_counts_from_any_thread)
# The router's own services, by full name: what reflection lists and Health reports on.
GENERATION_SERVICE = pdserve_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
REGISTRY_SERVICE = node_pb2.DESCRIPTOR.services_by_name["Registry"].full_name
ROUTER_SERVICES = (GENERATION_SERVICE, REGISTRY_SERVICE)


async def _abort(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    code, message = status_of(error)
    if not isinstance(error, RouterError):
        log.exception("unexpected error", exc_info=error)
    if isinstance(error, InvalidRequest):  # the field at fault, machine-readable beside the message
        await context.abort_with_status(bad_request_status(error))
    await context.abort(code, message)


class RequestRunner:
    """One public request from admission to its last response: what gRPC and HTTP both run."""

    def __init__(self, validator: RequestValidator, orchestrator: Orchestrator, admission: Admission) -> None:
        self._validator = validator
        self._orchestrator = orchestrator
        self._admission = admission

    async def run(self, request: pdserve_pb2.GenerateRequest,
                  timeout_s: float | None = None) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        """Every sample's responses; raises a RouterError (leaving early cancels the request)."""
        self._admission.check_room()  # when full, refuse before paying for validation
        if request.sampling_params.HasField("structured_output") and not library_loaded():
            await asyncio.to_thread(load_library)  # seconds, once: not on the loop every stream shares
        validated = self._validator.validate(request)
        # Refused at once when full (no queue); released on every exit, cancel included.
        with self._admission.admit(len(validated.prompt_token_ids), validated.params.n) as ticket:
            async for response in self._orchestrator.generate(validated, timeout_s):
                ticket.responded(response.index)
                yield response


class GenerationServicer(pdserve_pb2_grpc.GenerationServicer):
    def __init__(self, state: RouterState, validator: RequestValidator, requests: RequestRunner,
                 metrics: RouterMetrics) -> None:
        self._state = state
        self._validator = validator
        self._requests = requests
        self._metrics = metrics

    async def Generate(self, request, context):
        async for response in self._metrics.observe(self._generate(request, context), grpc_end_status(context)):
            yield response

    async def _generate(self, request, context):
        try:
            async for response in self._requests.run(request, context.time_remaining()):
                yield response
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure leaves as a status
            await _abort(context, exc)

    async def Tokenize(self, request, context):
        try:
            ids = self._validator.tokenize(request.text)
        except InvalidRequest as exc:
            await _abort(context, exc)
        return pdserve_pb2.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(self, request, context):
        model: RouterModel = self._state.model
        return pdserve_pb2.ModelInfo(
            model=model.name,
            vocab_size=model.vocab_size,
            max_model_len=model.max_model_len,
            dtype=model.dtype,
            block_size=self._state.config.block_size,
            eos_token_ids=model.eos_token_ids,
        )

    async def Health(self, request, context):
        prefill, decode, colocated = live_counts(self._state.registry)
        return pdserve_pb2.HealthResponse(serving=can_serve(prefill, decode, colocated), prefill_nodes=prefill,
                                          decode_nodes=decode, colocated_nodes=colocated)


def live_counts(registry: NodeRegistry) -> tuple[int, int, int]:
    """Live (prefill, decode, colocated) nodes."""
    return tuple(len(registry.live(kind)) for kind in (NodeKind.PREFILL, NodeKind.DECODE, NodeKind.COLOCATED))


def _live_counts_from_any_thread(registry: NodeRegistry) -> tuple[int, int, int]:
    """`live_counts`, safe from the metrics endpoint's thread (its /health): the event loop may add
    or drop a node mid-read, and a node table that changed size is simply read again."""
    for _ in range(_COUNT_ATTEMPTS - 1):
        try:
            return live_counts(registry)
        except RuntimeError:
            continue
    return live_counts(registry)  # still changing: the endpoint answers 503 naming the error


def can_serve(prefill: int, decode: int, colocated: int) -> bool:
    """Either architecture serves: a colocated node alone, or a prefill and a decode node."""
    return colocated > 0 or (prefill > 0 and decode > 0)


class RegistryServicer(node_pb2_grpc.RegistryServicer):
    def __init__(self, state: RouterState, on_nodes_changed: Callable[[], Awaitable[None]]) -> None:
        """`on_nodes_changed`: runs after a node is admitted, drains or leaves (the standard Health status
        follows at once)."""
        self._state = state
        self._facts = RouterFacts.of(state.model, state.config.block_size)
        self._on_nodes_changed = on_nodes_changed

    async def Register(self, request, context):
        try:
            kind = _node_kind(request.kind)
            if not request.address:
                raise InvalidRequest("address", "address must be HOST:PORT of the node's gRPC server")
            if not request.HasField("fingerprint"):
                raise InvalidRequest("fingerprint", "fingerprint is required: the model, dtype, block size and "
                                                    "KV layout the node runs")
            for option in ("local_prefill", "serve_prefill"):
                if getattr(request, option) and kind is not NodeKind.DECODE:
                    raise InvalidRequest(option, f"{option} is a decode node's option, not a {kind.value} node's")
            self._state.registry.admit(kind, request.address, request.node_id, request.fingerprint, self._facts,
                                       request.local_prefill, request.serve_prefill)
        except RouterError as exc:
            await _abort(context, exc)
        await self._on_nodes_changed()
        return node_pb2.RegisterResponse(heartbeat_interval_ms=self._state.config.heartbeat_interval_ms)

    async def Heartbeat(self, request, context):
        registry = self._state.registry
        known = registry.heartbeat(request.node_id, request.stats, request.draining)
        if request.draining:
            await self._on_nodes_changed()  # a pool may just have lost its last live node
        return node_pb2.HeartbeatResponse(known=known)

    async def Deregister(self, request, context):
        known = self._state.registry.deregister(request.node_id, drained=request.drained)
        await self._on_nodes_changed()
        return node_pb2.DeregisterResponse(known=known)


def _node_kind(name: str) -> NodeKind:
    try:
        return NodeKind(name)
    except ValueError:
        kinds = ", ".join(repr(kind.value) for kind in NodeKind)
        raise InvalidRequest("kind", f"kind must be one of {kinds}, got {name!r}") from None


class RouterServer:
    """The router's server and its background maintenance, started and stopped together."""

    def __init__(self, config: RouterConfig, model: RouterModel | None = None) -> None:
        self.config = config
        model = model or load_router_model(config.model)
        registry = NodeRegistry(config.heartbeat_timeout_s, config.channel_close_grace_s,
                                channel_factory=node_channel_factory(config.auth_token, config.tls))
        for address in config.prefill_addresses:
            registry.add_static(NodeKind.PREFILL, address)
        for address in config.decode_addresses:
            registry.add_static(NodeKind.DECODE, address)
        self.state = RouterState(
            config,
            model,
            registry,
            DecodePlacement(config.exhausted_cooldown_s),
            PrefillPlacement(config.block_size, config.affinity_slack_tokens, config.max_affinity_entries),
        )
        self.admission = Admission(config.admission)
        # Read at start (a bad file stops it), then again whenever it changes.
        self.api_keys = ApiKeys(config.api_keys_file) if config.api_keys_file else None
        self.metrics = RouterMetrics(CollectorRegistry(), registry, self.state.resumes, routes=self.state.routes)
        self._server: grpc.aio.Server | None = None
        self._standard: StandardServices | None = None
        self.http: HTTPFront | None = None  # the OpenAI-compatible API, with --http-port
        self.http_port: int | None = None
        self._maintenance: asyncio.Task | None = None
        self._metrics_endpoint: MetricsEndpoint | None = None
        self.port: int | None = None
        # Read by /health on the endpoint's thread: one reference, replaced whole.
        self.phase = ServerPhase.STARTING

    def _credentials(self) -> Credentials | None:
        if self.config.auth_token is None:
            return None
        return Credentials(self.config.auth_token, self.api_keys, frozenset({REGISTRY_SERVICE}))

    async def start(self) -> int:
        """Bind and serve; returns the bound port (the OS's pick when the config says 0).

        Raises PortUnavailable naming `--port` or `--metrics-port` when one cannot be bound."""
        if self.config.metrics_port is not None:
            self._metrics_endpoint = _start_endpoint(self.config, self.metrics.registry, self.health)
        server = grpc.aio.server(interceptors=server_interceptors(self.config.auth_token, self.api_keys,
                                                                  frozenset({REGISTRY_SERVICE})),
                                 options=server_options(self.config.max_message_bytes))
        validator = RequestValidator(self.state.model, self.config.max_n, limits=self.config.limits,
                                     capacity=live_capacity(self.state.registry, self.config.block_size))
        requests = RequestRunner(validator, Orchestrator(self.state), self.admission)
        pdserve_pb2_grpc.add_GenerationServicer_to_server(
            GenerationServicer(self.state, validator, requests, self.metrics), server
        )
        if self.config.http_port is not None:
            model = self.state.model
            served = ServedModel(self.config.served_model_name or model.name, model.tokenizer, model.max_model_len,
                                 model.vocab_size, _read_template(self.config.chat_template))
            def observed(request: pdserve_pb2.GenerateRequest) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
                return self.metrics.observe(requests.run(request), http_end_status)
            self.http = HTTPFront(observed, served, self.health, self._credentials(), self.metrics.registry,
                                  ssl_context=None if self.config.tls is None else self.config.tls.server_ssl_context())
        # grpc.health.v1: SERVING only while the router can serve a request, not merely while it runs;
        # the Registry while it runs (nodes can join): a liveness probe's question.
        self._standard = standard = StandardServices(server, ROUTER_SERVICES, self._can_serve,
                                                     {REGISTRY_SERVICE: self._running})
        node_pb2_grpc.add_RegistryServicer_to_server(RegistryServicer(self.state, standard.refresh), server)
        self.port = _bind(server, self.config)
        await self._standard.refresh()  # NOT_SERVING from the first call (grpc's default says SERVING)
        await server.start()
        self._server = server
        self._maintenance = asyncio.create_task(self._maintain())
        if self.http is not None:
            try:
                self.http_port = await self.http.start(self.config.host, self.config.http_port)
            except OSError as exc:
                raise unavailable(Listen("--http-port", self.config.host, self.config.http_port), exc) from exc
        self.phase = ServerPhase.SERVING
        await self._standard.start()
        return self.port

    def _running(self) -> bool:
        return self.phase is ServerPhase.SERVING

    def _can_serve(self) -> bool:
        return self.health().serving

    def health(self) -> Health:
        """Whether the router serves, the one verdict that `/health` (API and metrics ports),
        grpc.health.v1 and `/v1/models` give: only between a finished `start` and `stop`, and
        only with a route for a request (a colocated node, or a prefill and a decode node, live)."""
        if not self._running():
            return Health(False, f"router {self.phase.value}")
        prefill, decode, colocated = _live_counts_from_any_thread(self.state.registry)
        nodes = f"{prefill} prefill, {decode} decode and {colocated} colocated nodes live"
        if not can_serve(prefill, decode, colocated):
            return Health(False, f"no route for a request yet ({nodes}): the router serves once a colocated "
                                 "node, or a prefill and a decode node, have registered")
        return Health(True, f"router on {self.config.host}:{self.port}, {nodes}")

    async def drain(self, timeout_s: float) -> bool:
        """Take no new request and wait up to `timeout_s` for the admitted ones to end (the nodes
        and the registry serve on meanwhile); True if they all did."""
        self.phase = ServerPhase.DRAINING
        self.admission.close("draining (stopping)")
        if self._standard is not None:
            await self._standard.refresh()  # NOT_SERVING: a balancer stops sending here
        log.info("router draining: %d sequences in flight, up to %.1fs", self.admission.inflight, timeout_s)
        try:
            await asyncio.wait_for(self.admission.idle.wait(), timeout_s)
        except TimeoutError:
            log.warning("router drain timed out after %.1fs with %d sequences in flight; stopping them",
                        timeout_s, self.admission.inflight)
            return False
        return True

    async def stop(self, grace_s: float | None = None) -> None:
        self.phase = ServerPhase.STOPPING
        if self._standard is not None:
            await self._standard.stop()
        if self.http is not None:
            await self.http.stop()
        if self._maintenance is not None:
            self._maintenance.cancel()
            await asyncio.gather(self._maintenance, return_exceptions=True)
        if self._server is not None:
            await self._server.stop(self.config.shutdown_grace_s if grace_s is None else grace_s)
        await self.state.registry.close()
        if self._metrics_endpoint is not None:
            self._metrics_endpoint.stop()

    @property
    def metrics_url(self) -> str | None:
        return self._metrics_endpoint.url if self._metrics_endpoint is not None else None

    async def _maintain(self) -> None:
        registry = self.state.registry
        while True:
            registry.expire()
            await self._standard.refresh()  # a node just dropped may leave the router unable to serve
            await registry.poll_static(self.config.stats_poll_timeout_s)
            await asyncio.sleep(self.config.maintenance_interval_s)


def _read_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise Refused(f"--chat-template {path}: {exc.strerror}") from None


def _listens(config: RouterConfig) -> list[Listen]:
    """The router's ports, named by their flags."""
    listens = [Listen("--port", config.host, config.port)]
    if config.http_port is not None:
        listens.append(Listen("--http-port", config.host, config.http_port))
    if config.metrics_port is not None:
        listens.append(Listen("--metrics-port", config.host, config.metrics_port))
    return listens


def _start_endpoint(config: RouterConfig, registry: CollectorRegistry, health: HealthCheck) -> MetricsEndpoint:
    try:
        return MetricsEndpoint.start(config.host, config.metrics_port, registry, health)
    except OSError as err:
        raise unavailable(Listen("--metrics-port", config.host, config.metrics_port), err) from err


def _bind(server: grpc.aio.Server, config: RouterConfig) -> int:
    try:
        port = add_port(server, config.address, config.tls)
    except RuntimeError:  # gRPC says only that it failed
        port = 0
    if port == 0:
        raise unavailable(Listen("--port", config.host, config.port))
    return port


def _parser() -> argparse.ArgumentParser:
    """The router's flags, derived from `RouterConfig` and its `RequestLimits` (one default each)."""
    parser = argparse.ArgumentParser(prog="pdserve router", description="the public API and node registry")
    add_config_args(parser, RouterConfig)
    add_config_args(parser.add_argument_group("request limits"), RequestLimits)
    add_config_args(parser.add_argument_group("admission"), AdmissionLimits)
    parser.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT", help="a static prefill node")
    parser.add_argument("--decode", action="append", default=[], metavar="HOST:PORT", help="a static decode node")
    add_auth_args(parser)
    add_tls_args(parser, server=True)
    parser.add_argument("--log-level", default="INFO")
    return parser


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> RouterConfig:
    """`environ` is where `$PDSERVE_AUTH_TOKEN` is looked up (main passes os.environ). Raises
    ValueError (TokenError) for a token or API keys file that cannot be used."""
    if args.api_keys_file:
        ApiKeys(args.api_keys_file)  # unreadable or keyless: a usage error before anything starts
    return RouterConfig(
        prefill_addresses=tuple(args.prefill),
        decode_addresses=tuple(args.decode),
        limits=RequestLimits(**values_from_args(args, RequestLimits)),
        admission=AdmissionLimits(**values_from_args(args, AdmissionLimits)),
        auth_token=token_from_cli(args.auth_token_file, environ or {}),
        tls=tls_from_args(args, server=True),
        **values_from_args(args, RouterConfig),
    )


async def serve(config: RouterConfig) -> int:
    """Run until SIGTERM or SIGINT, then stop gracefully; the exit status says which."""
    server = RouterServer(config)
    try:
        port = await server.start()
    except BaseException:
        await server.stop(0)  # whatever did bind (the metrics endpoint) is let go
        raise
    signals = StopSignals()
    signals.install(asyncio.get_running_loop(), supervisor_of(os.environ))
    print(f"pdserve router listening on {config.host}:{port}", flush=True)
    if server.http_port is not None:
        print(f"pdserve router OpenAI-compatible HTTP API on {http_scheme(config.tls)}://{config.host}:{server.http_port}/v1", flush=True)
    if server.metrics_url is not None:
        print(f"pdserve router metrics on {server.metrics_url}", flush=True)
    try:
        await signals.event.wait()
        if signals.drain:
            await server.drain(config.drain_timeout_s)
    finally:
        log.info("router stopping")
        await server.stop()
    return signals.exit_status


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = config_from_args(args, os.environ)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        for listen in _listens(config):  # before the tokenizer loads: a busy port fails at once
            check_free(listen)
        return uvloop.run(serve(config))
    except PortUnavailable as err:
        print(f"{parser.prog}: {err}", file=sys.stderr)
        return ExitStatus.USAGE
    except Refused as exc:  # a model folder no node could serve: one line, nothing bound
        print(f"pdserve router: {exc.cli_message()}", file=sys.stderr, flush=True)
        return exc.exit_code
    except KeyboardInterrupt:  # Ctrl-C before the signal handlers are in place
        return ExitStatus.INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
