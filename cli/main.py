"""`pagefleet <subcommand>`: the single entry point of every pagefleet process."""

from __future__ import annotations

import argparse
import logging
import sys

from pagefleet.cli import generate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagefleet", description="Serve many LLMs on paged KV caches.")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default) or ERROR")
    commands = parser.add_subparsers(dest="command", required=True)
    generate.register(commands)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
