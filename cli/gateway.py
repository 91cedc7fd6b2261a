"""`pagefleet gateway`: the fleet's single OpenAI endpoint (see gateway/)."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = commands.add_parser(
        "gateway", help="route OpenAI requests to engine replicas (flags: pagefleet gateway --help)", add_help=False
    )
    parser.set_defaults(run=run, takes_flags=True)  # its flags are parsed by GatewaySettings


def run(args: argparse.Namespace) -> int:
    from pagefleet.cli.flags import parse_flags
    from pagefleet.cli.web import run_app
    from pagefleet.gateway.app import create_app
    from pagefleet.gateway.settings import GatewaySettings

    settings = parse_flags(GatewaySettings, args.flags, "pagefleet gateway")
    if settings is None:
        return 2
    run_app(create_app(settings), settings.host, settings.port, settings.log_level)
    return 0
