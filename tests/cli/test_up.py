"""`pagefleet up` brings up a fleet from a fleet file, restarts a replica that dies, and
takes all of it down on Ctrl-C."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.processes import free_port


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _command_line(pid: int) -> str:
    return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()


class _Lines:
    """The lines a process prints, read in a thread so that waiting for one can time out."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.seen: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        stdout = process.stdout
        assert stdout is not None

        def pump() -> None:
            for line in stdout:
                self._queue.put(line)
            self._queue.put("")  # the process ended: nothing more will come

        threading.Thread(target=pump, daemon=True).start()

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            if not line:
                break
            self.seen.append(line)
            if text in line:
                return line
        raise AssertionError(f"no line with {text!r} in {timeout} s (or the process ended):\n{''.join(self.seen)}")


def _replica_record(gateway: str, replica_id: str) -> dict | None:
    for model in httpx.get(f"{gateway}/dashboard/data").json()["models"]:
        for replica in model["replicas"]:
            if replica["replica_id"] == replica_id:
                return replica
    return None


@contextmanager
def _running_up(tmp_path: Path, models: list[str]) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`pagefleet up` with a fleet.yaml of `models` (YAML flow mappings) on free ports; the
    process and the gateway's URL. If a test leaves it running (it failed), it is stopped as
    a user stops it (Ctrl-C: it stops its children), and killed only if that hangs."""
    gateway_port = free_port()
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        f"redis_port: {free_port()}\ngateway_port: {gateway_port}\nfirst_engine_port: {free_port()}\n"
        f"log_dir: {tmp_path / 'logs'}\nmodels:\n" + "".join(f"  - {model}\n" for model in models)
    )
    up = subprocess.Popen(
        [sys.executable, "-m", "pagefleet.cli.main", "up", "--fleet", str(fleet), "--timeout", "240"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield up, f"http://127.0.0.1:{gateway_port}"
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(timeout=60)
            except subprocess.TimeoutExpired:
                up.kill()


def test_up_serves_every_model_and_stops_cleanly(tiny_llama: Path, tmp_path: Path) -> None:
    engine = '["--dtype", "float32", "--num-kv-blocks", "128", "--block-size", "8"]'
    with _running_up(
        tmp_path,
        [
            f"{{name: tiny, model: {tiny_llama}, replicas: 1, flags: {engine}}}",
            f"{{name: tiny-bf16, model: {tiny_llama}, replicas: 1, flags: {engine.replace('float32', 'bfloat16')}}}",
        ],
    ) as (up, gateway):
        lines = _Lines(up)
        lines.wait_for("fleet ready", timeout=240)
        models = {m["id"] for m in httpx.get(f"{gateway}/v1/models").json()["data"]}
        assert models == {"tiny", "tiny-bf16"}
        for model in models:
            answer = httpx.post(f"{gateway}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 3})
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
        children = _children(up.pid)
        assert len(children) == 4, "redis, the gateway and two engines"
        # The model's replicas share a KV file tier: what one computed, a restart reads back.
        long_prompt = {"model": "tiny", "prompt": list(range(10, 50)), "max_tokens": 3}
        assert httpx.post(f"{gateway}/v1/completions", json=long_prompt).status_code == 200
        deadline = time.monotonic() + 10
        while len(list((tmp_path / "kv" / "tiny").glob("*/*.kv"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(list((tmp_path / "kv" / "tiny").glob("*/*.kv"))) >= 4  # the prompt's 4 full blocks of 8

        # A replica that dies is started again, and says how often it was restarted.
        (doomed,) = [pid for pid in children if "--replica-id tiny-0 " in _command_line(pid) + " "]
        os.kill(doomed, signal.SIGKILL)
        assert "restarting in 1 s" in lines.wait_for("tiny-0 exited", timeout=10)
        lines.wait_for("tiny-0 restarted (restart 1)", timeout=10)
        deadline = time.monotonic() + 120
        while ((record := _replica_record(gateway, "tiny-0")) is None or record["restarts"] != 1) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.3)
        assert record is not None and record["restarts"] == 1, record
        answer = httpx.post(f"{gateway}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3})
        assert answer.status_code == 200
        again = httpx.post(f"{gateway}/v1/completions", json=long_prompt).json()  # the restart has an empty cache
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32, again["usage"]
        children = _children(up.pid)
        assert len(children) == 4 and doomed not in children

        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in children), "an orphan process outlived pagefleet up"


def test_up_serves_a_model_declared_with_prefill_and_decode_roles_disaggregated(
    tiny_llama: Path, tmp_path: Path
) -> None:
    engine = '["--dtype", "float32", "--num-kv-blocks", "128"]'
    with _running_up(
        tmp_path,
        [
            f"{{name: tiny-pd, model: {tiny_llama}, role: prefill, flags: {engine}}}",
            f"{{name: tiny-pd, model: {tiny_llama}, role: decode, flags: {engine}}}",
        ],
    ) as (up, gateway):
        lines = _Lines(up)
        lines.wait_for("fleet ready", timeout=240)
        body = {"model": "tiny-pd", "prompt": "the prompt's KV moves between replicas", "max_tokens": 4}
        deadline = time.monotonic() + 10  # until the gateway has seen both roles
        while (answer := httpx.post(f"{gateway}/v1/completions", json=body)).headers.get(
            "x-pagefleet-prefill-replica"
        ) is None and time.monotonic() < deadline:
            time.sleep(0.3)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        assert answer.headers["x-pagefleet-prefill-replica"] == "tiny-pd-prefill-0"
        assert answer.headers["x-pagefleet-replica"] == "tiny-pd-decode-0"
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0


def test_a_model_with_min_replicas_0_starts_on_its_first_requests_and_stops_when_idle(
    tiny_llama: Path, tmp_path: Path
) -> None:
    engine = '["--dtype", "float32", "--num-kv-blocks", "128", "--block-size", "8"]'
    with _running_up(
        tmp_path, [f"{{name: lazy, model: {tiny_llama}, min_replicas: 0, idle_seconds: 3, flags: {engine}}}"]
    ) as (up, gateway):
        lines = _Lines(up)
        lines.wait_for("fleet ready", timeout=240)
        assert len(_children(up.pid)) == 2, "redis and the gateway: no engine yet"
        body = {"model": "lazy", "prompt": "hi", "max_tokens": 3}

        def ask(_: int) -> httpx.Response:
            return httpx.post(f"{gateway}/v1/completions", json=body, timeout=120)

        # 20 requests that come while nothing runs are held, then served: none fails.
        with ThreadPoolExecutor(20) as pool:
            answers = list(pool.map(ask, range(20)))
        assert [a.status_code for a in answers] == [200] * 20
        assert all(a.json()["usage"]["completion_tokens"] == 3 for a in answers)
        lines.wait_for("lazy asked for: starting 1 replica(s)", timeout=5)
        lines.wait_for("lazy idle for 3 s: stopping its replicas", timeout=30)
        lines.wait_for("lazy-0 drained and stopped (code 0)", timeout=30)
        assert len(_children(up.pid)) == 2
        # And back: the next request starts it again.
        assert ask(0).status_code == 200
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
