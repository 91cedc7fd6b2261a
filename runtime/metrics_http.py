"""Prometheus metrics on a port of their own (the operator's, the picker's), always in the
text format that the engine's and the gateway's `/metrics` routes serve.

prometheus_client's own `start_http_server` answers a scraper that asks for OpenMetrics
(Prometheus does by default) with every `:` in a name escaped to `_`, so
`pagefleet_operator:desired_replicas` would be stored as `pagefleet_operator_desired_replicas`
and the Grafana dashboard's queries, like every other reader's, would find nothing.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

TEXT_FORMAT = "text/plain; version=0.0.4"


class MetricsServer(ThreadingWSGIServer):
    def close(self) -> None:
        """Stop serving and free the port."""
        self.shutdown()
        self.server_close()


class _IPv6MetricsServer(MetricsServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the overridden method's name
        """One line per scrape is noise; the scrapers keep their own record."""


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "0.0.0.0") -> MetricsServer:
    """Serve `registry` on `host:port` (any path) from a daemon thread until `close()`."""
    metrics_app = make_wsgi_app(registry)

    def text_format_only(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        environ["HTTP_ACCEPT"] = TEXT_FORMAT
        return metrics_app(environ, start_response)  # type: ignore[no-any-return]

    server_class = _IPv6MetricsServer if ":" in host else MetricsServer
    server = make_server(host, port, text_format_only, server_class, _QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
