"""`pagefleet up --rollout` replaces every replica in turn, and a changed fleet file drains
the replica it takes away, while a steady load runs through the gateway: no request fails.
(A module of its own: it is the suite's longest test, and runs beside test_up.py's.)"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.cli.test_up import _children, _Lines, _running_up


class _SteadyLoad:
    """Streamed and plain completions through the gateway, back to back from a few threads,
    until stopped; every answer that is not a complete success is kept as a failure."""

    def __init__(self, gateway: str, model: str, threads: int = 2) -> None:
        self.url, self.model = f"{gateway}/v1/completions", model
        self.completed = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def __enter__(self) -> _SteadyLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _run(self, worker: int) -> None:
        body = {"model": self.model, "prompt": "Tell me a story:", "max_tokens": 48, "ignore_eos": True}
        stream = worker % 2 == 0
        while not self._stop.is_set():
            try:
                problem = self._streamed(body) if stream else self._plain(body)
            except httpx.HTTPError as error:
                problem = f"{type(error).__name__}: {error}"
            if problem:
                self.failures.append(problem)
            else:
                self.completed += 1

    def _plain(self, body: dict[str, object]) -> str | None:
        answer = httpx.post(self.url, json=body, timeout=60)
        if answer.status_code != 200 or answer.json()["usage"]["completion_tokens"] != 48:
            return f"{answer.status_code}: {answer.text[:300]}"
        return None

    def _streamed(self, body: dict[str, object]) -> str | None:
        with httpx.stream("POST", self.url, json=body | {"stream": True}, timeout=60) as response:
            if response.status_code != 200:
                return f"stream {response.status_code}: {response.read()[:300]!r}"
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        finishes = [line for line in lines if '"finish_reason":"length"' in line.replace(" ", "")]
        if lines[-1:] != ["data: [DONE]"] or len(finishes) != 1 or any('"error"' in line for line in lines):
            return f"a cut or failed stream: {lines[-3:]}"
        return None


def test_a_rollout_and_a_scale_down_under_load_lose_no_request(slow_llama: Path, tmp_path: Path) -> None:
    engine = '["--dtype", "float32", "--num-kv-blocks", "256", "--block-size", "8"]'
    fleet = tmp_path / "fleet.yaml"
    with _running_up(tmp_path, [f"{{name: slow, model: {slow_llama}, replicas: 2, flags: {engine}}}"]) as (up, gateway):
        lines = _Lines(up)
        lines.wait_for("fleet ready", timeout=240)
        with _SteadyLoad(gateway, "slow") as load:
            time.sleep(1.0)
            # Every replica replaced in turn (SIGHUP, as `pagefleet up --rollout` sends it).
            rollout = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pagefleet.cli.main",
                    "up",
                    "--fleet",
                    str(tmp_path / "fleet.yaml"),
                    "--rollout",
                ],
                capture_output=True,
                text=True,
            )
            assert rollout.returncode == 0, rollout.stderr
            lines.wait_for("rollout done", timeout=120)
            # 2 -> 1 replica: a changed fleet file drains the one taken away.
            fleet.write_text(fleet.read_text().replace("replicas: 2", "replicas: 1"))
            lines.wait_for("fleet file applied", timeout=60)
            while sum("drained and stopped (code 0)" in line for line in lines.seen) < 3:
                lines.wait_for("drained and stopped (code 0)", timeout=60)  # the two old ones, the one taken away
            time.sleep(1.0)
        assert load.failures == [], load.failures[:5]
        assert load.completed >= 10
        assert len(_children(up.pid)) == 3, "redis, the gateway and one engine"
        listed = httpx.get(f"{gateway}/v1/models").json()["data"]
        assert [m["replicas"] for m in listed if m["id"] == "slow"] == [1]
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
