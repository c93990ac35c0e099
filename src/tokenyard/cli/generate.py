"""`tokenyard generate`: one prompt through the engine in this process, streamed to stdout."""

from __future__ import annotations

import argparse
import sys

from tokenyard.engine_args import engine_kwargs


async def generate(args: argparse.Namespace) -> int:
    from tokenyard.engine.async_llm import AsyncLLM
    from tokenyard.wire.sampling_params import SamplingParams, SamplingParamsError

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop or [],
        )
    except SamplingParamsError as exc:
        print(f"error: {exc.param}: {exc}", file=sys.stderr)
        return 2
    engine = AsyncLLM(show_progress=True, **engine_kwargs(args))
    prompt: object = args.prompt
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        prompt = [*messages, {"role": "user", "content": args.prompt}]
    finish = None
    try:
        async for out in engine.generate(prompt, params):  # type: ignore[arg-type]
            for delta in out.deltas:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
                finish = delta.finish_reason or finish
    finally:
        engine.shutdown()
    sys.stdout.write("\n")
    print(f"[finish_reason: {finish}]", file=sys.stderr)
    return 0
