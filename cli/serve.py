"""`pagefleet serve`: one engine replica behind the OpenAI API (see engine/server)."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = commands.add_parser(
        "serve",
        help="serve a model over the OpenAI API (flags: pagefleet serve --help)",
        add_help=False,
    )
    parser.set_defaults(run=run, takes_flags=True)  # its flags are parsed by ServerSettings


def run(args: argparse.Namespace) -> int:
    from pagefleet.cli.web import run_app
    from pagefleet.engine.server.app import create_app
    from pagefleet.engine.server.settings import ServerSettings

    settings = ServerSettings(_cli_parse_args=args.flags)  # type: ignore[call-arg]
    run_app(create_app(settings), settings.host, settings.port, settings.log_level)
    return 0
