"""`pagefleet generate`: answer one chat prompt (or a raw prompt) from the command line."""

from __future__ import annotations

import argparse
import logging
import sys
import time

_DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = commands.add_parser("generate", help="generate a reply with the engine, offline")
    parser.add_argument("prompt", nargs="?", default=_DEFAULT_PROMPT, help="the user message")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="built-in name, HF directory or .gguf")
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    parser.add_argument("--system", default=None, help="an optional system message")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--dtype", default="auto")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pagefleet.engine import LLM, SamplingParams

    logging.getLogger("pagefleet").setLevel(min(logging.getLogger().level, logging.INFO))
    started = time.monotonic()
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    try:
        llm = LLM(model=args.model, dtype=args.dtype)
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed, n=args.n
        )
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"ready in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    if args.raw:
        outputs = llm.generate(args.prompt, params)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        outputs = llm.chat(messages, params)
    for completion in outputs[0].outputs:
        print(completion.text.strip())
    usage = outputs[0].usage
    print(f"[{usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens]", file=sys.stderr)
    return 0
