"""`LLM`'s engine in a process of its own: chosen where the caller imported torch first
(its OpenMP threads would run the engine slower), answering as the engine in the caller's
process does, its errors raised as they are, and Ctrl-C losing nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.errors import EngineDeadError, InvalidParameterError, ModelNotFoundError

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

# A user's script: torch first, then pagefleet, two OpenMP threads that sleep between
# regions. It interrupts itself (Ctrl-C) in a long call, then generates again.
USERS_SCRIPT = """
import json, os, signal, sys, threading
import torch
from pagefleet.engine import LLM, SamplingParams

llm = LLM(sys.argv[1], dtype="float32", num_kv_blocks=256, block_size=8)
greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
first = [o.outputs[0].token_ids for o in llm.generate(json.loads(sys.argv[2]), greedy)]
threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
try:
    llm.generate([[5] * 8] * 64, SamplingParams(max_tokens=400, ignore_eos=True), use_tqdm=False)
    interrupted = False
except KeyboardInterrupt:
    interrupted = True
stats = llm.stats()
again = [o.outputs[0].token_ids for o in llm.generate(json.loads(sys.argv[2]), greedy)]
print(json.dumps({"separate": llm.separate_process, "first": first, "again": again, "interrupted": interrupted,
                  "free": stats.num_free_blocks, "total": stats.num_total_blocks}))
"""


@pytest.fixture(scope="module")
def in_process(tiny_llama: Path) -> list[list[int]]:
    with LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, block_size=8, separate_process=False) as llm:
        return [output.outputs[0].token_ids for output in llm.generate(PROMPTS, GREEDY)]


def test_a_script_that_imports_torch_first_gets_the_engine_in_its_own_process(
    tiny_llama: Path, in_process: list[list[int]]
) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    env.pop("GOMP_SPINCOUNT", None)
    # Ctrl-C as a terminal delivers it: a shell that started the suite in the background left
    # SIGINT ignored, which Python would keep (no KeyboardInterrupt at all).
    run = subprocess.run(
        [sys.executable, "-c", USERS_SCRIPT, str(tiny_llama), json.dumps(PROMPTS)],
        env=env, capture_output=True, text=True, timeout=300,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    answer = json.loads(run.stdout.splitlines()[-1])
    assert answer["separate"] is True
    assert answer["first"] == in_process and answer["again"] == in_process
    assert answer["interrupted"] is True
    assert answer["free"] == answer["total"], "the interrupted call left blocks held"


def test_the_engine_process_answers_and_fails_as_the_engine_here(tiny_llama: Path, in_process: list[list[int]]) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=64, block_size=8, separate_process=True)
    assert llm.separate_process and llm.tokenizer is not None
    assert [output.outputs[0].token_ids for output in llm.generate(PROMPTS, GREEDY)] == in_process
    with pytest.raises(InvalidParameterError) as refused:
        llm.generate(PROMPTS, SamplingParams(max_tokens=0))
    assert refused.value.param == "max_tokens"
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    with pytest.raises(RuntimeError, match="process of its own"):
        llm.engine  # noqa: B018
    child = llm._core._process  # type: ignore[union-attr]  # the child, to see it leave
    llm.shutdown()
    assert child.poll() == 0
    with pytest.raises(EngineDeadError):
        llm.generate(PROMPTS, GREEDY)


def test_a_model_the_engine_process_cannot_load_is_refused_as_here(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="neither a built-in name"):
        LLM(str(tmp_path / "nowhere"), separate_process=True)
