"""`pagefleet <subcommand>`: the single entry point of every pagefleet process."""

from __future__ import annotations

import argparse
import logging
import os
import sys

# Read by OpenMP when torch loads (lazily, in the subcommands): without it, idle OpenMP
# threads spin and starve whatever else shares these cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pagefleet.cli import gateway, generate, kube_operator, picker, serve, sim_fleet, up  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagefleet", description="Serve many LLMs on paged KV caches.")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default) or ERROR")
    commands = parser.add_subparsers(dest="command", required=True)
    generate.register(commands)
    serve.register(commands)
    gateway.register(commands)
    picker.register(commands)
    up.register(commands)
    sim_fleet.register(commands)
    kube_operator.register(commands)
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "takes_flags", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.flags = extra
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
