"""Running an HTTP app the way every pagefleet server does: uvicorn, quiet, quick to stop."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import uvicorn


def make_server(app: Any, host: str, port: int, log_level: str) -> uvicorn.Server:
    """A uvicorn server for `app`; `server.run()` serves until a signal or `should_exit`."""
    import uvicorn

    logging.getLogger("pagefleet").setLevel(log_level.upper())
    # Our own logs say what matters; uvicorn's access log would print a line per request.
    # Client addresses are used nowhere, so X-Forwarded-For is not parsed on every request.
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        proxy_headers=False,
        timeout_graceful_shutdown=5,
    )
    return uvicorn.Server(config)


def run_app(app: Any, host: str, port: int, log_level: str) -> None:
    make_server(app, host, port, log_level).run()
