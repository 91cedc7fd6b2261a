"""`pagefleet up`: a whole local fleet on one machine, for trying pagefleet in a minute.

Starts, as child processes: Redis (Debian's redis-server), the engine replicas of every
model in the fleet file (by default two replicas of SmolLM2-135M-Instruct in float32 and
one in bfloat16 under its own name), and the gateway. Waits until every part is healthy and
the gateway sees every model, prints how to call it, and stops everything on Ctrl-C.

Once the fleet is up, `pagefleet up` supervises it: a child that exits (an engine whose
engine died exits non-zero on purpose) is started again after a back-off that doubles
with each quick failure (1 s up to 30 s) and resets once it ran for a minute; restarted
replicas report their restart count, which the dashboard shows.

A model with `min_replicas: 0` starts with no replica: the gateway holds its first requests
and asks for one in Redis (protocol/demand.py), `pagefleet up` starts its replicas, and
stops them again after `idle_seconds` without a request.

It also changes the fleet without losing a request. `pagefleet up --rollout` (or SIGHUP)
replaces every engine replica one by one: a new one starts beside the old, and once it is
ready the old one drains (SIGTERM: it leaves Redis, finishes what it runs, exits 0). A
changed fleet file is applied the same way: models whose settings changed are rolled,
replicas added are started, and replicas taken away drain.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field

from pagefleet.protocol.demand import demand_key, read_demand, scalable_key

REDIS_SERVER = "/usr/bin/redis-server"
FIRST_BACKOFF_S, MAX_BACKOFF_S = 1.0, 30.0
STABLE_AFTER_S = 60.0  # a child that ran this long before it exited starts again at once


class ModelSpec(BaseModel):
    name: str = Field(description="the served model name clients send")
    model: str = Field(description="built-in name, HF directory or .gguf file")
    replicas: int = Field(1, ge=1)
    role: Literal["prefill", "decode", "both"] = Field(
        default="both",
        description="prefill/decode disaggregation: a model listed with prefill and decode entries is served split",
    )
    flags: list[str] = Field(default_factory=list, description="extra `pagefleet serve` flags")
    min_replicas: int = Field(
        default=1,
        ge=0,
        description="0: no replica until the first request (the gateway holds it), none after idle_seconds",
    )
    idle_seconds: float = Field(
        default=300.0, gt=0, description="with min_replicas 0: stop after this long without requests"
    )

    @property
    def scales_to_zero(self) -> bool:
        return self.min_replicas == 0

    def replica_id(self, index: int) -> str:
        return f"{self.name}-{index}" if self.role == "both" else f"{self.name}-{self.role}-{index}"


class FleetSpec(BaseModel):
    host: str = "127.0.0.1"
    redis_port: int = 6390
    gateway_port: int = 8000
    first_engine_port: int = 8001
    gateway_flags: list[str] = Field(default_factory=list)
    log_dir: Path = Path(".fleet/logs")
    kv_tier: bool = Field(default=True, description="the KV file tier: a model's replicas share full blocks")
    kv_cache_dir: Path | None = Field(default=None, description="its directory (default: kv/ beside log_dir)")
    kv_cache_dir_size_gib: float = Field(default=2.0, gt=0, description="the file tier's size limit per model")

    def kv_dir(self, model: ModelSpec) -> Path | None:
        """Where `model`'s replicas share their KV blocks: one directory per served name."""
        if not self.kv_tier or "--kv-cache-dir" in model.flags:
            return None
        return (self.kv_cache_dir or self.log_dir.parent / "kv") / model.name

    models: list[ModelSpec] = Field(
        default_factory=lambda: [
            ModelSpec(
                name="smollm2-135m-instruct",
                model="smollm2-135m-instruct",
                replicas=2,
                flags=["--dtype", "float32", "--kv-cache-memory", str(256 << 20)],
            ),
            ModelSpec(
                name="smollm2-135m-instruct-bf16",
                model="smollm2-135m-instruct",
                replicas=1,
                flags=["--dtype", "bfloat16", "--kv-cache-memory", str(256 << 20)],
            ),
        ]
    )


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = commands.add_parser("up", help="run a local fleet: Redis, engine replicas and the gateway")
    parser.add_argument("--fleet", type=Path, default=None, help="a fleet.yaml (default: ./fleet.yaml if present)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the fleet to be ready")
    parser.add_argument(
        "--rollout",
        action="store_true",
        help="replace every engine replica of the running fleet one by one, losing no request (it sends SIGHUP)",
    )
    parser.set_defaults(run=run)


def _say(message: str) -> None:
    print(f"[up] {message}", flush=True)


@dataclass
class Child:
    """One supervised process: how to start it, and its restart history."""

    name: str
    command: list[str]
    env: dict[str, str]
    process: subprocess.Popen[bytes]
    started_at: float = field(default_factory=time.monotonic)
    restarts: int = 0
    backoff_s: float = FIRST_BACKOFF_S
    restart_at: float | None = None  # set while it waits to be started again
    retiring: bool = False  # drained on purpose: not started again, forgotten once it exits


@dataclass
class Replica:
    """One engine replica of the fleet. A replica that replaces another in a rollout has the
    next `generation` (its own replica id and port: both run side by side for a while)."""

    model: ModelSpec
    index: int
    generation: int
    url: str
    child: Child

    @property
    def replica_id(self) -> str:
        return replica_id(self.model, self.index, self.generation)


def replica_id(model: ModelSpec, index: int, generation: int) -> str:
    base = model.replica_id(index)
    return base if generation == 0 else f"{base}-g{generation}"


class Fleet:
    """The child processes of one `pagefleet up`; `stop()` ends all of them."""

    def __init__(self, spec: FleetSpec) -> None:
        self.spec = spec
        self.children: list[Child] = []
        self.replicas: list[Replica] = []  # the engines serving (those retiring are not here)
        self._next_port = spec.first_engine_port
        self._stopped_at: dict[str, float] = {}  # model scaled to zero -> Unix time its replicas stopped
        self._started_at: dict[str, float] = {}  # ... and when they were last started on demand
        self._redis: Any = None
        spec.log_dir.mkdir(parents=True, exist_ok=True)

    @property
    def redis_url(self) -> str:
        return f"redis://{self.spec.host}:{self.spec.redis_port}/0"

    @property
    def gateway_url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.gateway_port}"

    def spawn(self, name: str, command: list[str], threads: int = 1) -> Child:
        # Replicas share this machine's cores: their idle OpenMP threads sleep at once.
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}
        child = Child(name, command, env, self._popen(name, command, env, "wb"))
        self.children.append(child)
        return child

    def _popen(self, name: str, command: list[str], env: dict[str, str], mode: str) -> subprocess.Popen[bytes]:
        with open(self.spec.log_dir / f"{name}.log", mode) as log:
            return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)

    def supervise(self) -> None:
        """Start again every child that exited, each after its back-off."""
        now = time.monotonic()
        for child in list(self.children):
            if child.retiring:
                if child.process.poll() is not None:
                    self.children.remove(child)
                    _say(f"{child.name} drained and stopped (code {child.process.returncode})")
                continue
            if child.restart_at is None and child.process.poll() is not None:
                if now - child.started_at >= STABLE_AFTER_S:
                    child.backoff_s = FIRST_BACKOFF_S
                child.restart_at = now + child.backoff_s
                _say(
                    f"{child.name} exited (code {child.process.returncode}); "
                    f"restarting in {child.backoff_s:.0f} s (logs in {self.spec.log_dir}/{child.name}.log)"
                )
                child.backoff_s = min(MAX_BACKOFF_S, child.backoff_s * 2)
            elif child.restart_at is not None and now >= child.restart_at:
                child.restarts += 1
                env = {**child.env, "PAGEFLEET_ENGINE_RESTARTS": str(child.restarts)}
                child.process = self._popen(child.name, child.command, env, "ab")
                child.started_at, child.restart_at = now, None
                _say(f"{child.name} restarted (restart {child.restarts})")

    def start_redis(self) -> None:
        binary = REDIS_SERVER if os.path.exists(REDIS_SERVER) else shutil.which("redis-server")
        if binary is None:
            raise SystemExit("pagefleet up: redis-server is missing; `bash scripts/setup.sh` installs it (apt)")
        self.spawn(
            "redis",
            [binary, "--port", str(self.spec.redis_port), "--bind", self.spec.host, "--save", "", "--appendonly", "no"],
        )

    def _free_engine_port(self) -> int:
        """The next port from `first_engine_port` on that nothing listens on yet."""
        while True:
            port, self._next_port = self._next_port, self._next_port + 1
            with socket.socket() as probe:
                try:
                    probe.bind((self.spec.host, port))
                except OSError:
                    continue
            return port

    def start_engine(self, model: ModelSpec, index: int, generation: int = 0) -> Replica:
        port = self._free_engine_port()
        name = replica_id(model, index, generation)
        command = [sys.executable, "-m", "pagefleet.cli.main", "serve", "--model", model.model]
        command += ["--served-model-name", model.name, "--replica-id", name, "--host", self.spec.host]
        command += ["--port", str(port), "--redis-url", self.redis_url, "--role", model.role]
        command += ["--enable-prompt-tokens-details", *model.flags]  # the gateway counts cached prompt tokens
        kv_dir = self.spec.kv_dir(model)
        if kv_dir is not None:
            command += ["--kv-cache-dir", str(kv_dir), "--kv-cache-dir-size-gib", str(self.spec.kv_cache_dir_size_gib)]
        replica = Replica(model, index, generation, f"http://{self.spec.host}:{port}", self.spawn(name, command))
        self.replicas.append(replica)
        return replica

    def retire(self, replica: Replica) -> None:
        """Drain `replica` (SIGTERM: it leaves Redis at once and finishes what it runs); it is
        not started again, and forgotten once it exits."""
        self.replicas.remove(replica)
        replica.child.retiring = True
        if replica.child.process.poll() is None:
            replica.child.process.terminate()
        _say(f"{replica.replica_id} draining")

    def wait_ready(self, replica: Replica, deadline: float) -> bool:
        """Until the replica answers /ready, supervising the rest meanwhile; False if it
        exits or the deadline passes."""
        import httpx

        while time.monotonic() < deadline:
            self.supervise()
            if replica.child.process.poll() is not None or replica.child.restart_at is not None:
                return False
            try:
                if httpx.get(f"{replica.url}/ready", timeout=1).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        return False

    def replace(self, old: Replica, model: ModelSpec, deadline: float) -> bool:
        """A new replica beside `old` (with `model`'s settings); once it is ready, `old`
        drains. False (and `old` kept) if the new one does not get ready."""
        new = self.start_engine(model, old.index, old.generation + 1)
        if not self.wait_ready(new, deadline):
            _say(f"{new.replica_id} did not get ready; keeping {old.replica_id} (logs in {self.spec.log_dir})")
            self.retire(new)
            return False
        _say(f"{new.replica_id} ready at {new.url}")
        self.retire(old)
        return True

    def roll(self, timeout: float) -> None:
        """Replace every engine replica, one by one."""
        for old in list(self.replicas):
            if not self.replace(old, old.model, time.monotonic() + timeout):
                return
        _say("rollout done")

    def apply(self, spec: FleetSpec, timeout: float) -> None:
        """Bring the running fleet to `spec`'s models: start what is new or added, roll what
        changed, drain what was taken away (the ports, Redis and gateway stay as they are)."""
        wanted = {(m.name, m.role): m for m in spec.models}
        for old in [r for r in self.replicas if (r.model.name, r.model.role) not in wanted]:
            self.retire(old)
        for key, model in wanted.items():
            current = [r for r in self.replicas if (r.model.name, r.model.role) == key]
            for extra in current[model.replicas :]:
                self.retire(extra)
            for old in current[: model.replicas]:
                if _settings(old.model) != _settings(model) and not self.replace(
                    old, model, time.monotonic() + timeout
                ):
                    return
            for index in range(len(current), 0 if model.scales_to_zero and not current else model.replicas):
                added = self.start_engine(model, index)
                if self.wait_ready(added, time.monotonic() + timeout):
                    _say(f"{added.replica_id} ready at {added.url}")
        self.spec = self.spec.model_copy(update={"models": spec.models})
        self.offer_scaling_to_zero()
        _say("fleet file applied")

    def start_gateway(self) -> None:
        command = [sys.executable, "-m", "pagefleet.cli.main", "gateway", "--host", self.spec.host]
        command += ["--port", str(self.spec.gateway_port), "--redis-url", self.redis_url, *self.spec.gateway_flags]
        self.spawn("gateway", command)

    def check_alive(self) -> None:
        """While the fleet starts, a child that exits is a set-up error: stop and say why."""
        for child in self.children:
            if child.process.poll() is not None:
                log = self.spec.log_dir / f"{child.name}.log"
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise SystemExit(f"pagefleet up: {child.name} exited (code {child.process.returncode}); {log}:\n{tail}")

    def wait_healthy(self, url: str, deadline: float) -> None:
        import httpx

        while time.monotonic() < deadline:
            self.check_alive()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise SystemExit(f"pagefleet up: {url} was not healthy in time; logs in {self.spec.log_dir}")

    def wait_models(self, names: set[str], deadline: float) -> None:
        import httpx

        while time.monotonic() < deadline:
            self.check_alive()
            try:
                # /health lists the models too, and needs no API key (--api-keys in gateway_flags).
                ready = set(httpx.get(f"{self.gateway_url}/health", timeout=1).json()["models"])
                if names <= ready:
                    return
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.3)
        raise SystemExit("pagefleet up: the gateway did not see every model in time")

    def offer_scaling_to_zero(self) -> None:
        """Tell the routers which models may have no replica (they hold those requests)."""
        import redis

        if self._redis is None:
            self._redis = redis.Redis.from_url(self.redis_url, socket_timeout=1.0)
        for model in self.spec.models:
            if model.scales_to_zero:
                self._redis.set(scalable_key(model.name), "{}")
                self._stopped_at.setdefault(model.name, time.time())
            else:
                self._redis.delete(scalable_key(model.name))

    def scale_on_demand(self) -> None:
        """Start the replicas of a model scaled to zero that was asked for since they
        stopped; stop those of one idle for its `idle_seconds`."""
        import redis

        if self._redis is None:
            return
        for model in self.spec.models:
            if not model.scales_to_zero:
                continue
            try:
                asked = read_demand(self._redis.get(demand_key(model.name)))
            except redis.RedisError:
                return  # Redis restarting: decide next time
            running = [r for r in self.replicas if r.model.name == model.name and r.model.role == model.role]
            # Idle since the last request, or since the start: a replica that took longer to
            # load than the idle period still gets a whole one to serve.
            active = max(asked or 0.0, self._started_at.get(model.name, 0.0))
            if not running and asked is not None and asked > self._stopped_at.get(model.name, 0.0):
                _say(f"{model.name} asked for: starting {model.replicas} replica(s)")
                self._started_at[model.name] = time.time()
                for index in range(model.replicas):
                    self.start_engine(model, index)
            elif running and time.time() - active > model.idle_seconds:
                _say(f"{model.name} idle for {model.idle_seconds:g} s: stopping its replicas")
                self._stopped_at[model.name] = time.time()
                for replica in running:
                    self.retire(replica)

    def stop(self) -> None:
        if self._redis is not None:
            for model in self.spec.models:
                if model.scales_to_zero:
                    try:
                        self._redis.delete(scalable_key(model.name))
                    except Exception:  # Redis may be gone already; it is stopped below anyway
                        pass
        processes = [child.process for child in self.children]
        for process in reversed(processes):
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + 20
        for process in processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _settings(model: ModelSpec) -> dict[str, Any]:
    """What a replica runs with (a change rolls it); the replica count is not part of it."""
    return model.model_dump(exclude={"replicas"})


def fleet_file(path: Path | None) -> Path | None:
    if path is None and Path("fleet.yaml").exists():
        return Path("fleet.yaml")
    return path


def load_spec(path: Path | None) -> FleetSpec:
    if path is None:
        return FleetSpec()
    return FleetSpec.model_validate(yaml.safe_load(path.read_text()) or {})


def _pid_file(spec: FleetSpec) -> Path:
    return spec.log_dir / "up.pid"


def _mtime(path: Path | None) -> float | None:
    try:
        return path.stat().st_mtime if path is not None else None
    except OSError:
        return None


def request_rollout(spec: FleetSpec) -> int:
    """`pagefleet up --rollout`: signal the running `pagefleet up` of this fleet file."""
    try:
        pid = int(_pid_file(spec).read_text())
        os.kill(pid, signal.SIGHUP)
    except (OSError, ValueError):
        print(f"pagefleet up --rollout: no fleet is running here ({_pid_file(spec)})", file=sys.stderr)
        return 1
    print(f"[up] rollout requested from pagefleet up (pid {pid}); it reports progress in its own output", flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    path = fleet_file(args.fleet)
    spec = load_spec(path)
    if args.rollout:
        return request_rollout(spec)
    fleet = Fleet(spec)
    started = time.monotonic()
    deadline = started + args.timeout
    rollouts: list[Any] = []

    def on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)  # also when started with SIGINT ignored (a background job)
    signal.signal(signal.SIGHUP, lambda *_: rollouts.append(None))
    try:
        fleet.start_redis()
        _say(f"redis on {fleet.redis_url} (logs in {spec.log_dir}/)")
        fleet.start_gateway()
        for model in spec.models:
            for index in range(0 if model.scales_to_zero else model.replicas):
                replica = fleet.start_engine(model, index)
                if len(fleet.replicas) == 1:  # the first converts and caches shared weights for the rest
                    _say(f"loading {model.name} (the first start converts its weights once, ~30 s)")
                    fleet.wait_healthy(replica.url, deadline)
        for replica in fleet.replicas:
            fleet.wait_healthy(replica.url, deadline)
            _say(f"{replica.replica_id} ready at {replica.url}")
        fleet.wait_healthy(fleet.gateway_url, deadline)
        fleet.offer_scaling_to_zero()
        fleet.wait_models({m.name for m in spec.models}, deadline)  # those scaled to zero too
        first = spec.models[0].name
        _say(f"fleet ready in {time.monotonic() - started:.0f} s: gateway at {fleet.gateway_url}")
        _say(f"dashboard: {fleet.gateway_url}/dashboard")
        _say("try:")
        print(
            f"  curl -s {fleet.gateway_url}/v1/chat/completions -H 'content-type: application/json' \\\n"
            f'    -d \'{{"model": "{first}", "messages": [{{"role": "user", "content": '
            f'"What is the capital of France?"}}]}}\'',
            flush=True,
        )
        _say("Ctrl-C stops the fleet; `pagefleet up --rollout` (or SIGHUP) replaces every replica one by one")
        _pid_file(spec).write_text(str(os.getpid()))
        seen = _mtime(path)
        while True:
            fleet.supervise()
            fleet.scale_on_demand()
            if rollouts:
                rollouts.clear()
                _say("rollout: replacing every engine replica, one by one")
                fleet.roll(args.timeout)
            if (changed := _mtime(path)) != seen:
                seen = changed
                _say(f"{path} changed: applying it")
                try:
                    fleet.apply(load_spec(path), args.timeout)
                except (ValueError, OSError, yaml.YAMLError) as error:  # half-written or invalid: run on as is
                    _say(f"{path} not applied: {error}")
            time.sleep(0.5)
    except KeyboardInterrupt:
        _say("stopping")
        return 0
    finally:
        _pid_file(spec).unlink(missing_ok=True)
        fleet.stop()
