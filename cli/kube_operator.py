"""`pagefleet operator`: reconcile InferenceDeployments in a cluster (see operator/)."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = commands.add_parser(
        "operator",
        help="run the Kubernetes operator (flags: pagefleet operator --help)",
        add_help=False,
    )
    parser.set_defaults(run=run, takes_flags=True)  # its flags are parsed by OperatorSettings


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from pagefleet.operator.main import run_operator
    from pagefleet.operator.settings import OperatorSettings

    settings = OperatorSettings(_cli_parse_args=args.flags)  # type: ignore[call-arg]
    logging.getLogger().setLevel(settings.log_level.upper())
    asyncio.run(run_operator(settings))
    return 0
