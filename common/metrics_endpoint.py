"""The `/metrics` HTTP endpoint a router or a node serves for Prometheus to scrape.

Owns one prometheus_client WSGI server on its own daemon thread, serving one
`CollectorRegistry` that the process built (never the library's global one), and its
clean stop. Scrapes run on that thread, so whatever a registry's collectors read must
be safe to read from outside the process's event loop.

Must never: bind an address other than the one it is given, or touch the event loop.
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server


class MetricsEndpoint:
    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.host, self.port = server.server_address[:2]

    @classmethod
    def start(cls, host: str, port: int, registry: CollectorRegistry) -> MetricsEndpoint:
        """Serve `registry` on http://host:port/metrics (port 0: the OS picks; see `.port`)."""
        server, thread = start_http_server(port, addr=host, registry=registry)
        return cls(server, thread)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self, timeout_s: float = 5.0) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout_s)
