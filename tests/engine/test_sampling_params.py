"""Invalid parameters raise ValueError naming the field."""

from __future__ import annotations

import pytest

from pagefleet.engine import InvalidParameterError, SamplingParams

INVALID = [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_p": 2.0}, "min_p"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"logprobs": -2}, "logprobs"),  # -1 is the whole vocabulary; the ceiling is the engine's max_logprobs
    ({"stop": [""]}, "stop"),
]


@pytest.mark.parametrize(("kwargs", "field"), INVALID)
def test_invalid_parameter_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError) as raised:
        SamplingParams(**kwargs)
    assert isinstance(raised.value, InvalidParameterError)
    assert raised.value.param == field
    assert str(raised.value).startswith(field)


def test_stop_string_is_normalised_to_a_list() -> None:
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(temperature=0).is_greedy
