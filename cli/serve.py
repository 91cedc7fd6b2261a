"""`pagefleet serve`: one engine replica behind the OpenAI API (see engine/server)."""

from __future__ import annotations

import argparse
import logging


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = commands.add_parser(
        "serve",
        help="serve a model over the OpenAI API (flags: pagefleet serve --help)",
        add_help=False,
    )
    parser.set_defaults(run=run, takes_flags=True)  # its flags are parsed by ServerSettings


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from pagefleet.engine.server.app import create_app
    from pagefleet.engine.server.settings import ServerSettings

    settings = ServerSettings(_cli_parse_args=args.flags)  # type: ignore[call-arg]
    logging.getLogger("pagefleet").setLevel(settings.log_level.upper())
    app = create_app(settings)
    uvicorn.run(
        app, host=settings.host, port=settings.port, log_level="warning", access_log=False, timeout_graceful_shutdown=5
    )
    return 0
