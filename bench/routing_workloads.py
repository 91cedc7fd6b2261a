"""The three workload shapes of bench/routing.py, and the client that replays them.

Shapes, scaled from llm-d's published ones to three SmolLM2 replicas on this machine:
- `shared`: N system prompts of L tokens, short questions, short answers (llm-d's
  "b2b-saas"); the prompts' distinct tokens exceed one replica's KV budget, so a router
  that spreads each prompt everywhere evicts what it will need next.
- `sessions`: multi-turn chats whose history grows turn by turn (each turn carries the
  previous answers), with `x-session-id` and `user` set, as agents and chat UIs send them.
- `decode`: short prompts, long answers: a control where routing should not matter.

Every request is a streaming chat completion with usage; the client records TTFT, the gaps
between tokens, and the prompt tokens the replica served from its cache.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

_WORDS = (
    "account service customer billing invoice policy refund order shipment contract renewal support ticket "
    "priority escalation region warehouse inventory supplier payment method discount tier premium standard "
    "agreement clause liability warranty return window delivery tracking status update notification email "
    "phone chat hours holiday schedule manager team engineer analyst report dashboard metric quarter annual "
    "revenue forecast budget approval request access password security compliance audit record retention "
    "data privacy consent region currency tax exemption certificate partner reseller integration platform "
    "feature release version upgrade migration outage incident response credit balance statement cycle"
).split()


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(count))


@dataclass(slots=True)
class Turn:
    """One request: when it may start (seconds from the run's start, or after the previous
    turn of its session), its messages (a session's history is filled in as it goes)."""

    at: float
    messages: list[dict[str, str]]
    max_tokens: int
    session: str | None = None
    follow_up: list[Turn] = field(default_factory=list)  # later turns of the same session


@dataclass(slots=True)
class Outcome:
    ok: bool
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)  # seconds between successive tokens
    prompt_tokens: int = 0
    cached_tokens: int = 0
    replica: str = ""  # which replica answered (pagefleet's gateway says so: x-pagefleet-replica)
    sent: float = 0.0  # perf_counter() when it was sent
    error: str = ""  # why it failed: "HTTP <status>: <message>", the exception's name, or "no tokens"


def shared_prompts(
    rate: float,
    requests: int,
    seed: int,
    prompts: int = 8,
    prompt_words: int = 700,
    question_words: int = 12,
    answer_tokens: int = 16,
    zipf: bool = False,
) -> list[Turn]:
    """`prompts` system prompts of `prompt_words` words (700: about 0.93k SmolLM2 tokens
    each), picked at random per request (uniformly, or with `zipf` tenant i with weight
    1/(i+1)), each followed by a question of `question_words` words."""
    rng = random.Random(seed)
    systems = [f"Tenant {i} handbook: " + words(rng, prompt_words) for i in range(prompts)]
    weights = [1.0 / (i + 1) for i in range(prompts)]
    turns, at = [], 0.0
    for _ in range(requests):
        at += rng.expovariate(rate)
        system = rng.choices(systems, weights)[0] if zipf else rng.choice(systems)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": words(rng, question_words)}]
        turns.append(Turn(at, messages, answer_tokens))
    return turns


def sessions(rate: float, requests: int, seed: int, turns_per_session: int = 4) -> list[Turn]:
    """Sessions starting as a Poisson process of `rate`; each has its own 300-word system
    prompt and `turns_per_session` turns, one second of thinking apart on average."""
    rng = random.Random(seed)
    starts, at = [], 0.0
    for index in range(max(1, requests // turns_per_session)):
        at += rng.expovariate(rate)
        system = {"role": "system", "content": f"Session {index}: " + words(rng, 300)}
        first = Turn(at, [system, {"role": "user", "content": words(rng, 15)}], 24, session=f"s{index}")
        for _ in range(turns_per_session - 1):
            first.follow_up.append(Turn(rng.expovariate(1.0), [{"role": "user", "content": words(rng, 15)}], 24))
        starts.append(first)
    return starts


def decode_bound(rate: float, requests: int, seed: int) -> list[Turn]:
    """Short distinct prompts, 96 answer tokens: decoding dominates."""
    rng = random.Random(seed)
    turns, at = [], 0.0
    for _ in range(requests):
        at += rng.expovariate(rate)
        turns.append(Turn(at, [{"role": "user", "content": words(rng, 20)}], 96))
    return turns


def b2b_saas(rate: float, requests: int, seed: int) -> list[Turn]:
    """llm-d's b2b-saas at full size: 150 tenants' system prompts of 6,000 words (about as
    many tokens), Zipf-distributed, a 100-word question each; 64 answer tokens."""
    return shared_prompts(rate, requests, seed, 150, 6000, 100, 64, zipf=True)


def chat_sessions(rate: float, requests: int, seed: int, turns_per_session: int = 5) -> list[Turn]:
    """Multi-turn chat at full size: sessions with a 2,000-word system prompt of their own,
    `turns_per_session` questions of 150 words, 128-token answers, 5 s of thinking between
    turns on average; the history grows to about 3,400 tokens."""
    rng = random.Random(seed)
    starts, at = [], 0.0
    for index in range(max(1, requests // turns_per_session)):
        at += rng.expovariate(rate / turns_per_session)  # `rate` counts requests, not sessions
        system = {"role": "system", "content": f"Session {index}: " + words(rng, 2000)}
        first = Turn(at, [system, {"role": "user", "content": words(rng, 150)}], 128, session=f"s{index}")
        for _ in range(turns_per_session - 1):
            first.follow_up.append(Turn(rng.expovariate(0.2), [{"role": "user", "content": words(rng, 150)}], 128))
        starts.append(first)
    return starts


def decode_control(rate: float, requests: int, seed: int) -> list[Turn]:
    """The decode-bound control at full size: 200-word distinct prompts, 512 answer tokens."""
    rng = random.Random(seed)
    turns, at = [], 0.0
    for _ in range(requests):
        at += rng.expovariate(rate)
        turns.append(Turn(at, [{"role": "user", "content": words(rng, 200)}], 512))
    return turns


def stretched(turns: list[Turn], scale: float) -> list[Turn]:
    """`turns` with every wait (arrivals, thinking) `scale` times as long: a simulated
    fleet's schedule at its time scale."""
    return [Turn(t.at * scale, t.messages, t.max_tokens, t.session, stretched(t.follow_up, scale)) for t in turns]


WORKLOADS = {"shared": shared_prompts, "sessions": sessions, "decode": decode_bound}
# At full size, for fleets of simulated GPU replicas (bench/routing.py --simulate).
FULL_SIZE_WORKLOADS = {"b2b-saas": b2b_saas, "chat": chat_sessions, "decode-control": decode_control}


async def _ask(
    client: httpx.AsyncClient, url: str, model: str, turn: Turn, messages: list[dict[str, str]]
) -> tuple[Outcome, str]:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": turn.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {}
    if turn.session:
        body["user"] = turn.session
        headers["x-session-id"] = turn.session
    sent, last, text = time.perf_counter(), 0.0, []
    outcome = Outcome(ok=False, sent=sent)
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as response:
            outcome.replica = response.headers.get("x-pagefleet-replica", "")
            if response.status_code != 200:
                outcome.error = (
                    f"HTTP {response.status_code}: {(await response.aread())[:200].decode(errors='replace')}"
                )
                return outcome, ""
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage")
                if usage:
                    outcome.prompt_tokens = usage.get("prompt_tokens", 0)
                    outcome.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                for choice in chunk.get("choices") or []:
                    delta = (choice.get("delta") or {}).get("content")
                    if delta:
                        now = time.perf_counter()
                        if last:
                            outcome.gaps.append(now - last)
                        else:
                            outcome.ttft = now - sent
                        last = now
                        text.append(delta)
        outcome.ok = bool(last)
        outcome.error = "" if last else "no tokens"
    except httpx.HTTPError as error:
        outcome.ok, outcome.error = False, type(error).__name__
    return outcome, "".join(text)


async def replay(url: str, model: str, turns: list[Turn], timeout_s: float = 600.0) -> tuple[list[Outcome], float]:
    """Send every turn at its time (a session's later turns after the previous answer plus
    their thinking time); the outcomes and the seconds from start to the last answer. A
    request waiting `timeout_s` for a byte fails (a time-stretched fleet passes its scale's
    multiple)."""
    outcomes: list[Outcome] = []

    async def session(client: httpx.AsyncClient, first: Turn, start: float) -> None:
        await asyncio.sleep(max(0.0, start + first.at - time.perf_counter()))
        history = list(first.messages)
        for turn in [first, *first.follow_up]:
            if turn is not first:
                await asyncio.sleep(turn.at)
                history += turn.messages
            outcome, answer = await _ask(
                client, url, model, first if turn is first else _with_session(turn, first), history
            )
            outcomes.append(outcome)
            history.append({"role": "assistant", "content": answer})

    limits = httpx.Limits(max_connections=500, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(session(client, turn, start) for turn in turns))
        return outcomes, time.perf_counter() - start


def _with_session(turn: Turn, first: Turn) -> Turn:
    return Turn(turn.at, turn.messages, turn.max_tokens, first.session)
