"""`tokenyard bench grammar`: what constrained decoding costs on this machine.

- grammar compile time for a typical tool schema (first and cached), and for JSON mode;
- the per-step mask cost at batch B: filling B matchers' bitmasks plus applying them to a
  ``[B, V]`` logits block, in microseconds;
- decode throughput of the engine at batch B with every request constrained against the
  same batch unconstrained (same prompts, same lengths: max_tokens with EOS ignored for the
  free rows, a grammar long enough not to end early for the constrained ones).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from tokenyard.wire.sampling_params import GuidedDecoding, SamplingParams

if TYPE_CHECKING:  # the CLI builds its parser from this module: torch is loaded in run()
    from tokenyard.engine.llm import LLM

#: A typical tool's parameters (a weather lookup with an enum, a bound and a nested list).
TOOL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "City and country"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "fields": {"type": "array", "items": {"type": "string",
                                              "enum": ["temp", "wind", "rain"]},
                   "maxItems": 3},
        "when": {"type": "string", "format": "date"},
    },
    "required": ["location", "unit"],
    "additionalProperties": False,
}

#: A grammar that never ends before max_tokens: a long run of digits and letters.
LONG_REGEX = "[a-z0-9 ]{1000}"


@dataclass
class GrammarBench:
    batch: int
    compile_first_ms: float
    compile_cached_us: float
    compile_json_object_ms: float
    mask_fill_us: float  # B matchers' bitmasks, per step
    mask_apply_us: float  # the [B, V] logits masked, per step
    free_tok_s: float
    constrained_tok_s: float

    @property
    def ratio(self) -> float:
        return self.constrained_tok_s / self.free_tok_s


def _decode_rate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(r.completions[0].token_ids) for r in results) / elapsed


def run(batch: int = 16, max_tokens: int = 64, model: str | None = None) -> GrammarBench:
    """Measure compile, mask and throughput figures at batch `batch` (see the module)."""
    import torch

    from tokenyard.bench.micro import time_us
    from tokenyard.engine.llm import LLM
    from tokenyard.engine.sample.grammar import GrammarCompiler, apply_bitmask, fill_bitmask

    llm = LLM(model)
    tokenizer = llm.tokenizer
    vocab = llm.frontend.model_config.vocab_size
    compiler = GrammarCompiler(tokenizer, vocab, tokenizer.eos_token_ids)
    compiler.compile(GuidedDecoding("regex", "warm"))  # XGrammar import and vocabulary
    tool = GuidedDecoding("json_schema", json.dumps(TOOL_SCHEMA))
    start = time.perf_counter()
    compiler.compile(tool)
    first_ms = (time.perf_counter() - start) * 1e3
    cached_us = time_us(lambda: compiler.compile(tool), 200)
    start = time.perf_counter()
    compiler.compile(GuidedDecoding("json_object"))
    object_ms = (time.perf_counter() - start) * 1e3

    # Mask cost: B matchers each a few tokens into the tool call.
    prefix = tokenizer.encode('{"location": "Par')
    states = [compiler.state(tool, tokenizer.eos_token_ids) for _ in range(batch)]
    outputs = [prefix] * batch
    for state in states:
        state.matcher_for(prefix)
    logits = torch.randn(batch, vocab)
    fill_us = time_us(lambda: fill_bitmask(states, outputs, vocab), 50)
    mask = fill_bitmask(states, outputs, vocab)
    assert mask is not None
    apply_us = time_us(lambda: apply_bitmask(logits, *mask), 50)

    prompts = [llm.frontend.prompt_token_ids(
        [{"role": "user", "content": f"Write item {i} of a list of codes."}])
        for i in range(batch)]
    free = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=1)
    constrained = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=1,
                                 guided=GuidedDecoding("regex", LONG_REGEX))
    _decode_rate(llm, prompts[:2], constrained)  # compile the regex first
    free_rate = _decode_rate(llm, prompts, free)
    constrained_rate = _decode_rate(llm, prompts, constrained)
    return GrammarBench(batch, first_ms, cached_us, object_ms, fill_us, apply_us,
                        free_rate, constrained_rate)


def report(bench: GrammarBench) -> str:
    return "\n".join([
        f"grammar compile, tool schema: {bench.compile_first_ms:.1f} ms first, "
        f"{bench.compile_cached_us:.1f} us cached; json_object: "
        f"{bench.compile_json_object_ms:.1f} ms",
        f"mask per step at batch {bench.batch}: fill {bench.mask_fill_us:.0f} us + apply "
        f"{bench.mask_apply_us:.0f} us = {bench.mask_fill_us + bench.mask_apply_us:.0f} us",
        f"decode at batch {bench.batch}: {bench.free_tok_s:.1f} tok/s free, "
        f"{bench.constrained_tok_s:.1f} tok/s constrained ({bench.ratio:.1%})",
    ])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: "
                                                      "the embedded SmolLM2)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def main(args: argparse.Namespace) -> int:
    bench = run(args.batch, args.max_tokens, args.model)
    print(json.dumps({**asdict(bench), "ratio": bench.ratio}) if args.json else report(bench))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))

