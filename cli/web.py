"""Running an HTTP app the way every pagefleet server does: uvicorn, quiet, quick to stop."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import uvicorn


def make_server(
    app: Any, host: str, port: int, log_level: str, drain: Callable[[], bool] | None = None
) -> uvicorn.Server:
    """A uvicorn server for `app`; `server.run()` serves until a signal or `should_exit`.
    With `drain`, the first SIGTERM calls it instead (the app stops the server itself once
    drained, and the process exits 0); a second SIGTERM, or SIGINT, stops at once."""
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
    if drain is None:
        return uvicorn.Server(config)
    start_drain = drain

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if sig == signal.SIGTERM and not self.should_exit and start_drain():
                return  # not captured: uvicorn would raise it again at exit (status -15)
            super().handle_exit(sig, frame)

    return DrainingServer(config)


def run_app(app: Any, host: str, port: int, log_level: str) -> None:
    make_server(app, host, port, log_level).run()
