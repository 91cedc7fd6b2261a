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
    lists in `renamed` (old -> new) are read under their old names too."""
    renamed: dict[str, str] = getattr(settings_class, "renamed", {})
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
