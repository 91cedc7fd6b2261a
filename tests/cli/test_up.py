"""`pagefleet up` brings up a fleet from a fleet file and takes all of it down on Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
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


def test_up_serves_every_model_and_stops_cleanly(tiny_llama: Path, tmp_path: Path) -> None:
    gateway_port = free_port()
    fleet = tmp_path / "fleet.yaml"
    engine = '["--dtype", "float32", "--num-kv-blocks", "128", "--block-size", "8"]'
    fleet.write_text(
        f"redis_port: {free_port()}\ngateway_port: {gateway_port}\nfirst_engine_port: {free_port()}\n"
        f"log_dir: {tmp_path / 'logs'}\nmodels:\n"
        f"  - {{name: tiny, model: {tiny_llama}, replicas: 1, flags: {engine}}}\n"
        f"  - {{name: tiny-bf16, model: {tiny_llama}, replicas: 1, flags: {engine.replace('float32', 'bfloat16')}}}\n"
    )
    up = subprocess.Popen(
        [sys.executable, "-m", "pagefleet.cli.main", "up", "--fleet", str(fleet), "--timeout", "240"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert up.stdout is not None
        lines = []
        for line in up.stdout:
            lines.append(line)
            if "fleet ready" in line or up.poll() is not None:
                break
        assert any("fleet ready" in line for line in lines), "".join(lines)
        gateway = f"http://127.0.0.1:{gateway_port}"
        models = {m["id"] for m in httpx.get(f"{gateway}/v1/models").json()["data"]}
        assert models == {"tiny", "tiny-bf16"}
        for model in models:
            answer = httpx.post(f"{gateway}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 3})
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
        children = _children(up.pid)
        assert len(children) == 4, "redis, the gateway and two engines"
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in children), "an orphan process outlived pagefleet up"
    finally:
        if up.poll() is None:
            up.kill()
