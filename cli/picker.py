"""`pagefleet picker`: an Endpoint Picker for Envoy-based gateways (see gateway/picker.py)."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = commands.add_parser(
        "picker",
        help="pick replicas for an Envoy gateway over ext_proc (flags: pagefleet picker --help)",
        add_help=False,
    )
    parser.set_defaults(run=run, takes_flags=True)  # its flags are parsed by PickerSettings


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from pagefleet.cli.flags import parse_flags
    from pagefleet.gateway.picker_server import serve
    from pagefleet.gateway.settings import PickerSettings

    settings = parse_flags(PickerSettings, args.flags, "pagefleet picker")
    if settings is None:
        return 2
    logging.getLogger("pagefleet").setLevel(settings.log_level.upper())
    asyncio.run(serve(settings))
    return 0
