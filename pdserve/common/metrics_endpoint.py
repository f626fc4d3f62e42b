"""The HTTP endpoint a router or a node serves beside gRPC: `/metrics` for Prometheus, `/health`.

Owns one WSGI server on its own thread, serving one `CollectorRegistry` that the process
built (never the library's global one) on `/metrics` (and any other path, as
prometheus_client does), and the process's verdict on `/health`: 200 `serving: <what>` or
503 `not serving: <why>`, one line of text from the `HealthCheck` the process hands in. And
its clean stop, which first answers every request already accepted (a probe asking at the
moment the process stops gets the last verdict, not a reset connection).

Scrapes and health checks run on this server's threads, so whatever the registry's
collectors and the health check read must be safe to read from outside the process's event
loop.

Must never: bind an address other than the one it is given, touch the event loop, or decide
what healthy means (the process's `HealthCheck` does).
"""

from __future__ import annotations

import socket
import threading
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

HEALTH_PATH = "/health"
# A client that connects and sends nothing may hold a handler thread, and so the stop that
# waits for it, at most this long.
REQUEST_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Health:
    """A process's answer to `/health`: whether it serves, and one line saying what or why not."""

    serving: bool
    reason: str


HealthCheck = Callable[[], Health]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = False  # so that `server_close` waits for requests in flight
    block_on_close = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT_S

    def log_message(self, fmt: str, *args: object) -> None:
        """A scrape every few seconds is not news for the process's log."""


class MetricsEndpoint:
    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.host, self.port = server.server_address[:2]

    @classmethod
    def start(cls, host: str, port: int, registry: CollectorRegistry, health: HealthCheck) -> MetricsEndpoint:
        """Serve `registry` on http://host:port/metrics and `health` on /health (port 0: the OS
        picks; see `.port`). Raises OSError when the port cannot be bound."""
        server = make_server(host.strip("[]"), port, _app(make_wsgi_app(registry), health),
                             _Server6 if ":" in host else _Server, handler_class=_QuietHandler)
        thread = threading.Thread(target=server.serve_forever, name="metrics-endpoint", daemon=True)
        thread.start()
        return cls(server, thread)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    @property
    def health_url(self) -> str:
        return f"http://{self.host}:{self.port}{HEALTH_PATH}"

    def stop(self, timeout_s: float = 5.0) -> None:
        self._server.shutdown()
        self._server.server_close()  # joins the handlers of requests already accepted
        self._thread.join(timeout_s)


def _app(metrics_app: Callable, health: HealthCheck) -> Callable:
    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != HEALTH_PATH:
            return metrics_app(environ, start_response)
        verdict = _verdict(health)
        body = f"{'serving' if verdict.serving else 'not serving'}: {verdict.reason}\n".encode()
        start_response("200 OK" if verdict.serving else "503 Service Unavailable",
                       [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))])
        return [body]

    return app


def _verdict(health: HealthCheck) -> Health:
    try:
        return health()
    except Exception as exc:  # noqa: BLE001 - a health check that breaks says "not serving", never 500
        return Health(False, f"the health check failed: {type(exc).__name__}: {exc}")


def scrape(url: str, timeout_s: float = 10.0) -> str:
    """The exposition text a /metrics endpoint serves (the load mode's, a validation's and the
    tests' one way of reading one)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read().decode()
