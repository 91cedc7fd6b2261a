"""Flags parsed by a settings class (pydantic-settings), with errors a person can act on."""

from __future__ import annotations

import os
import sys
from typing import TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings

S = TypeVar("S", bound=BaseSettings)


def parse_flags(settings_class: type[S], flags: list[str], prog: str) -> S | None:
    """The settings from `flags` (and the environment); None after printing each problem
    as `prog: --flag: message` (exit code 2 is the caller's). Names the settings class
    lists in `renamed` (old -> new) are read under their old names too, and the list flags
    it names in `multi_value_flags` take several values after one flag, as argparse's
    nargs="+" (vLLM's `--lora-modules a=/x b=/y`)."""
    renamed: dict[str, str] = getattr(settings_class, "renamed", {})
    flags = _one_value_each(flags, getattr(settings_class, "multi_value_flags", ()))
    flags = [_new_flag(flag, renamed) for flag in flags]
    prefix = str(settings_class.model_config.get("env_prefix", ""))
    for old, new in renamed.items():
        old_variable, new_variable = (prefix + old).upper(), (prefix + new).upper()
        if old_variable in os.environ and new_variable not in os.environ:
            os.environ[new_variable] = os.environ[old_variable]
    try:
        return settings_class(_cli_parse_args=flags)  # type: ignore[call-arg]
    except ValidationError as error:
        for problem in error.errors():
            message = problem["msg"].removeprefix("Value error, ")
            where = ".".join(str(part) for part in problem["loc"]).replace("_", "-")
            print(f"{prog}: --{where}: {message}" if where else f"{prog}: {message}", file=sys.stderr)
        return None


def _new_flag(flag: str, renamed: dict[str, str]) -> str:
    name, equals, value = flag.partition("=")
    new = renamed.get(name.removeprefix("--").replace("-", "_")) if name.startswith("--") else None
    return f"--{new.replace('_', '-')}{equals}{value}" if new else flag


def _one_value_each(flags: list[str], multi_value: tuple[str, ...]) -> list[str]:
    """`--name a b` as `--name a --name b` for the flags of `multi_value`."""
    names = {f"--{name.replace('_', '-')}" for name in multi_value}
    rewritten: list[str] = []
    current = None
    for flag in flags:
        if flag in names:
            current = flag
        elif flag.startswith("-"):
            current = None
        elif current is not None and rewritten[-1] != current:
            rewritten.append(current)  # a second value after the same flag
        rewritten.append(flag)
    return rewritten
