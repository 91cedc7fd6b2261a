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
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

TEXT_FORMAT = "text/plain; version=0.0.4"


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in flight does not hold the process at exit


class _IPv6ThreadingServer(_ThreadingServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the overridden method's name
        """One line per scrape is noise; the scrapers keep their own record."""


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "0.0.0.0") -> WSGIServer:
    """Serve `registry` on `host:port` (any path) from a daemon thread; `shutdown()` and
    `server_close()` the server returned to stop."""
    metrics_app = make_wsgi_app(registry)

    def text_format_only(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        environ["HTTP_ACCEPT"] = TEXT_FORMAT
        return metrics_app(environ, start_response)  # type: ignore[no-any-return]

    server_class = _IPv6ThreadingServer if ":" in host else _ThreadingServer
    server = make_server(host, port, text_format_only, server_class, _QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
