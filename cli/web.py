"""Running an HTTP app the way every pagefleet server does: uvicorn, quiet, quick to stop."""

from __future__ import annotations

import logging
from typing import Any


def run_app(app: Any, host: str, port: int, log_level: str) -> None:
    import uvicorn

    logging.getLogger("pagefleet").setLevel(log_level.upper())
    # Our own logs say what matters; uvicorn's access log would print a line per request.
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
