"""docs/engine.md's compatibility table is true: every row's status matches the code, and
every argument the code takes has a row."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pagefleet.engine import LLM
from pagefleet.engine.config import EngineConfig
from pagefleet.engine.sample.sampling_params import SamplingParams
from pagefleet.protocol.openai import ChatCompletionRequest, CompletionRequest

DOC = Path(__file__).resolve().parent.parent / "docs" / "engine.md"
TAKEN = {"supported", "accepted"}


def _rows() -> list[tuple[str, str, str]]:
    """(name, where, status) of each row of the compatibility table."""
    section = DOC.read_text().split("## vLLM and OpenAI compatibility", 1)[1]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`") and cells[2] != "status":
            rows.append((cells[0].strip("`"), cells[1].strip("`"), cells[2]))
    return rows


def _takes() -> dict[str, set[str]]:
    """Each place's arguments, as the code declares them."""
    return {
        "LLM(...)": {f.name for f in dataclasses.fields(EngineConfig)},
        "SamplingParams": {f.name for f in dataclasses.fields(SamplingParams) if f.init} - {"bad_words_token_ids"},
        "completions": set(CompletionRequest.model_fields),
        "chat": set(ChatCompletionRequest.model_fields),
        "LLM.method": {name for name in vars(LLM) if not name.startswith("_") and callable(getattr(LLM, name))},
    }


ROWS = _rows()


def test_the_table_is_there_and_well_formed() -> None:
    assert len(ROWS) > 100
    assert {status for _, _, status in ROWS} <= TAKEN | {"not yet", "ignored"}
    assert len({(name, where) for name, where, _ in ROWS}) == len(ROWS), "one row per argument"


@pytest.mark.parametrize(("name", "where", "status"), ROWS, ids=[f"{w}:{n}" for n, w, _ in ROWS])
def test_each_row_matches_the_code(name: str, where: str, status: str) -> None:
    taken = name in _takes()[where]
    assert taken == (status in TAKEN), f"{where} {name}: the table says {status}"


def test_every_argument_the_code_takes_has_a_row() -> None:
    listed = {(name, where) for name, where, _ in ROWS}
    for where, names in _takes().items():
        if where == "LLM.method":
            continue  # the table lists the methods vLLM users call; LLM may have more
        missing = sorted(name for name in names if (name, where) not in listed)
        assert not missing, f"{where}: no row for {missing}"


def test_refused_arguments_raise_and_accepted_ones_do_not() -> None:
    for name, where, status in ROWS:
        if where == "SamplingParams" and status == "not yet":
            with pytest.raises(TypeError):
                SamplingParams(**{name: None})
    SamplingParams(spaces_between_special_tokens=False)
