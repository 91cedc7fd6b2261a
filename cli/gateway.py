"""`pagefleet gateway`: the fleet's single OpenAI endpoint (see gateway/)."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = commands.add_parser(
        "gateway", help="route OpenAI requests to engine replicas (flags: pagefleet gateway --help)", add_help=False
    )
    parser.set_defaults(run=run, takes_flags=True)  # its flags are parsed by GatewaySettings


def run(args: argparse.Namespace) -> int:
    import sys

    from pydantic import ValidationError

    from pagefleet.cli.web import run_app
    from pagefleet.gateway.app import create_app
    from pagefleet.gateway.settings import GatewaySettings

    try:
        settings = GatewaySettings(_cli_parse_args=args.flags)  # type: ignore[call-arg]
    except ValidationError as error:
        for problem in error.errors():
            where = ".".join(str(part) for part in problem["loc"])
            print(f"pagefleet gateway: --{where.replace('_', '-')}: {problem['msg']}", file=sys.stderr)
        return 2
    run_app(create_app(settings), settings.host, settings.port, settings.log_level)
    return 0
