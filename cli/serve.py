"""`pagefleet serve`: one engine replica behind the OpenAI API (see engine/server)."""

from __future__ import annotations

import argparse
import sys


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = commands.add_parser(
        "serve",
        help="serve a model over the OpenAI API (flags: pagefleet serve --help)",
        add_help=False,
    )
    parser.set_defaults(run=run, takes_flags=True)  # its flags are parsed by ServerSettings


def run(args: argparse.Namespace) -> int:
    from pagefleet.cli.flags import parse_flags
    from pagefleet.cli.web import make_server
    from pagefleet.engine.server.app import create_app
    from pagefleet.engine.server.settings import ServerSettings

    flags = model_first(args.flags)
    settings = parse_flags(ServerSettings, flags, "pagefleet serve") if flags is not None else None
    if settings is None:
        return 2
    server = None

    def stop_server() -> None:
        assert server is not None, "the server exists before the engine can die"
        server.should_exit = True

    app = create_app(settings, stop_server=stop_server)
    # SIGTERM drains: routers stop sending, requests in flight finish, then exit 0.
    server = make_server(app, settings.host, settings.port, settings.log_level, app.state.lifecycle.drain_soon)
    server.run()
    return int(app.state.server.exit_code)  # non-zero after the engine died: restart me


def model_first(flags: list[str]) -> list[str] | None:
    """`pagefleet serve MODEL [flags]`, as `vllm serve MODEL`: the model may come first,
    without `--model`; None (after saying why) if it comes both ways."""
    if not flags or flags[0].startswith("-"):
        return flags
    if any(flag == "--model" or flag.startswith("--model=") for flag in flags[1:]):
        print("pagefleet serve: give the model once: first, or as --model", file=sys.stderr)
        return None
    return ["--model", flags[0], *flags[1:]]
