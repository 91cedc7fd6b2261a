"""`pagefleet gateway`: the fleet's single OpenAI endpoint (see gateway/)."""

from __future__ import annotations

import argparse
import logging


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = commands.add_parser(
        "gateway", help="route OpenAI requests to engine replicas (flags: pagefleet gateway --help)", add_help=False
    )
    parser.set_defaults(run=run, takes_flags=True)  # its flags are parsed by GatewaySettings


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from pagefleet.gateway.app import create_app
    from pagefleet.gateway.settings import GatewaySettings

    settings = GatewaySettings(_cli_parse_args=args.flags)  # type: ignore[call-arg]
    logging.getLogger("pagefleet").setLevel(settings.log_level.upper())
    app = create_app(settings)
    uvicorn.run(
        app, host=settings.host, port=settings.port, log_level="warning", access_log=False, timeout_graceful_shutdown=5
    )
    return 0
