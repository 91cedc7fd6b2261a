"""Structured outputs on the real SmolLM2: JSON that validates against its schema, one of
the choices, text matching a regex; per sample, per beam, and across preemption."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.errors import InvalidParameterError
from pagefleet.engine.sample.structured_outputs import StructuredOutputsParams
from tests.engine.helpers import assert_no_block_leaked

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "colour": {"type": "string", "enum": ["red", "green", "blue"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "height_m": {"type": "number", "minimum": 1.2, "maximum": 2.3},
    },
    "required": ["name", "age", "colour", "hobbies", "address", "height_m"],
    "additionalProperties": False,
}
CHOICES = ["positive", "negative", "neutral"]
PHONE = r"\(\d{3}\) \d{3}-\d{4}"


@pytest.fixture(autouse=True)
def _no_leak(smollm2: LLM):  # type: ignore[no-untyped-def]
    yield
    assert_no_block_leaked(smollm2)


def _ask(i: int) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": f"Invent person number {i}: name, age, favourite colour, hobbies, address, height."}
    ]


def _person(**fields) -> SamplingParams:  # type: ignore[no-untyped-def]
    constraint = StructuredOutputsParams(json=PERSON)
    return SamplingParams(**{"temperature": 0.8, "max_tokens": 256, "structured_outputs": constraint, **fields})


def test_eight_json_answers_all_validate(smollm2: LLM) -> None:
    outputs = smollm2.chat([_ask(i) for i in range(8)], [_person(seed=i) for i in range(8)])
    people = []
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        person = json.loads(completion.text)
        jsonschema.validate(person, PERSON)
        people.append(person)
    assert len({p["name"] for p in people}) > 1, "sampling still varies inside the constraint"


def test_choice_and_regex(smollm2: LLM) -> None:
    review = [{"role": "user", "content": "Classify the sentiment: 'I loved this film, it was wonderful.'"}]
    choice = smollm2.chat(review, SamplingParams(temperature=0, structured_outputs={"choice": CHOICES}))[0].outputs[0]
    assert choice.text in CHOICES and choice.finish_reason == "stop"
    phone = smollm2.generate(
        ["Call our office at "], SamplingParams(temperature=0, max_tokens=30, structured_outputs={"regex": PHONE})
    )[0].outputs[0]
    assert re.fullmatch(PHONE, phone.text), phone.text


def test_each_of_n_samples_and_each_beam_follows_the_constraint(smollm2: LLM) -> None:
    samples = smollm2.chat(_ask(1), _person(n=2, seed=7))[0].outputs
    assert len(samples) == 2
    for sample in samples:
        jsonschema.validate(json.loads(sample.text), PERSON)
    review = [{"role": "user", "content": "Is 'the food was cold and late' positive, negative or neutral?"}]
    prompt = smollm2.apply_chat_template(review)
    constrained = SamplingParams(
        n=3, use_beam_search=True, beam_width=3, max_tokens=8, structured_outputs={"choice": CHOICES}
    )
    beams = smollm2.generate([prompt], constrained)[0].outputs
    assert [b.text in CHOICES for b in beams] == [True] * 3, [b.text for b in beams]


@pytest.fixture(scope="module")
def unpreempted(smollm2: LLM) -> tuple[list[str], list[str]]:
    """Four constrained greedy questions and their answers with room for all at once."""
    prompts = [smollm2.apply_chat_template(_ask(i)) for i in range(4)]
    return prompts, [o.outputs[0].text for o in smollm2.generate(prompts, _person(temperature=0.0))]


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_the_constraint_survives_preemption(unpreempted: tuple[list[str], list[str]], preemption_mode: str) -> None:
    """A cache too small for every request at once: requests are preempted and resumed,
    their matchers keep their place, and greedy answers equal an unpreempted run's."""
    prompts, expected = unpreempted
    params = _person(temperature=0.0)
    tight = LLM(
        "smollm2-135m-instruct",
        dtype="float32",
        quantization="none",  # the `smollm2` fixture's weights, to compare answers
        num_kv_blocks=24,  # 384 slots for four answers of ~130 tokens each
        block_size=16,
        preemption_mode=preemption_mode,
    )
    outputs = tight.generate(prompts, params)
    stats = tight.stats()
    assert stats.num_preemptions_recompute + stats.num_preemptions_swap > 0
    assert [o.outputs[0].text for o in outputs] == expected
    for text in expected:
        jsonschema.validate(json.loads(text), PERSON)
    assert_no_block_leaked(tight)


def test_unconstrained_requests_are_unchanged_beside_constrained_ones(smollm2: LLM) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=24)
    question = [{"role": "user", "content": "Name a famous bridge."}]
    alone = smollm2.chat(question, plain)[0].outputs[0].token_ids
    mixed = smollm2.chat([_ask(3), question], [_person(seed=1), plain])
    assert mixed[1].outputs[0].token_ids == alone


@pytest.mark.parametrize(
    ("constraint", "problem"),
    [
        ({"json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "json"),
        ({"regex": "(unclosed"}, "regex"),
        ({"grammar": "root ::= missing_rule"}, "grammar"),
        ({"json": {"type": "object"}, "regex": "a"}, "exactly one"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_naming_it(smollm2: LLM, constraint: dict, problem: str) -> None:
    with pytest.raises(InvalidParameterError) as refused:
        smollm2.generate(["Hi"], SamplingParams(structured_outputs=constraint))
    assert refused.value.param == "structured_outputs" and problem in str(refused.value)
