"""Constrained decoding: grammars compiled off the step loop, one matcher per request, and
a token bitmask applied to the logits of the rows that have one.

XGrammar does the work. A `GrammarCompiler` holds one XGrammar ``TokenizerInfo`` built
from the replica's vocabulary (each id's raw bytes; special tokens as empty strings, so a
grammar can never spell them, EOS excepted where the grammar may end) and compiles each
`GuidedDecoding` on its own thread; compiled grammars are cached by
``(kind, spec, any_whitespace)`` in an LRU, so a schema sent again costs a dict lookup.

A request carries a `GuidedState`: the compile's future until it is done (the scheduler
leaves such a request in its waiting queue and serves the others), then a matcher. The
matcher is advanced with every token the request accepts; it is made lazily from the
request's output tokens, so a preempted request (whose matcher is dropped) replays them on
its recompute and lands in the same state. EOS is allowed only where the grammar may end;
once the matcher has taken EOS it is terminated and the request finishes with "stop".

Logits are masked before logit bias, penalties, temperature and the filters, so every
sampling parameter works on the allowed tokens only, and logprobs (taken from the raw
logits) are those of the masked distribution: a constrained row's alternatives are
allowed tokens, renormalised over them.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from tokenyard.wire.sampling_params import GuidedDecoding

if TYPE_CHECKING:  # xgrammar imports transformers (seconds): loaded on the compile thread
    import xgrammar

    from tokenyard.text.tokenizer import Tokenizer

#: JSON-schema keywords XGrammar would silently ignore: refused rather than not enforced.
UNSUPPORTED_SCHEMA_KEYWORDS: frozenset[str] = frozenset({
    "not", "if", "then", "else", "dependentSchemas", "$dynamicRef", "$recursiveRef",
})

# Dates XGrammar's own formats let through but RFC 3339 parsers refuse (Python's, so
# pydantic's: year 0000, 31 April, 30 February, second 60): these patterns allow a valid
# subset instead (29 February is left out, whatever the year).
_DATE = ("([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])-"
         "((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
         "|02-(0[1-9]|1[0-9]|2[0-8]))")
_TIME = ("([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6})?"
         "(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])")
FORMAT_PATTERNS: dict[str, str] = {
    "date": f"^{_DATE}$", "time": f"^{_TIME}$", "date-time": f"^{_DATE}T{_TIME}$",
}

# XGrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: ".
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarError(ValueError):
    """A grammar that cannot be compiled; `param` is the API field to blame (a 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def guided_param(guided: GuidedDecoding) -> str:
    return guided.param or "guided"


def prepare_schema(schema: Any, param: str, path: str = "#") -> Any:
    """`schema` as compiled: GrammarError for the first keyword XGrammar would not enforce
    (UNSUPPORTED_SCHEMA_KEYWORDS, or a string format with a length or pattern), and the
    date and time formats replaced by FORMAT_PATTERNS."""
    if isinstance(schema, list):
        return [prepare_schema(item, param, f"{path}/{i}") for i, item in enumerate(schema)]
    if not isinstance(schema, dict):
        return schema
    if "format" in schema:
        mixed = sorted({"pattern", "minLength", "maxLength"} & set(schema))
        if mixed:  # XGrammar enforces the format alone and would drop these silently
            raise GrammarError(
                param, f"a string 'format' together with {', '.join(map(repr, mixed))} (at "
                       f"{path}) is not supported in constrained decoding; use one or the other")
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in UNSUPPORTED_SCHEMA_KEYWORDS:
            raise GrammarError(
                param, f"the JSON schema keyword {key!r} (at {path}) is not supported in "
                       "constrained decoding")
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            out[key] = {name: prepare_schema(sub, param, f"{path}/{key}/{name}")
                        for name, sub in value.items()}
        elif key in ("enum", "const", "default", "examples", "required"):
            out[key] = value
        else:
            out[key] = prepare_schema(value, param, f"{path}/{key}")
    if isinstance(out.get("format"), str) and out["format"] in FORMAT_PATTERNS:
        out["pattern"] = FORMAT_PATTERNS[out.pop("format")]
    return out


def vocabulary_bytes(tokenizer: Tokenizer, vocab_size: int) -> list[bytes]:
    """Each id's raw bytes, special tokens as b"" (never spelled), padded to `vocab_size`."""
    special = tokenizer.all_special_ids
    size = min(tokenizer.vocab_size, vocab_size)
    return [b"" if i in special else tokenizer.id_to_token_bytes(i) for i in range(size)]


class GrammarCompiler:
    """Compiles grammars against one vocabulary on a worker thread, with an LRU cache.

    `vocab_size` is the width of the model's logits (which may exceed the tokenizer's);
    `stop_token_ids` are the ids that end a grammar (EOS). XGrammar is imported and the
    vocabulary prepared on the worker when the first grammar comes (a few seconds, once
    per process): a replica that never sees a grammar never pays for them.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        *,
        max_workers: int = 1,
        cache_size: int = 512,
    ) -> None:
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._tokenizer = tokenizer
        self._stop_token_ids = sorted(stop_token_ids)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="tokenyard-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str, bool], Future[xgrammar.CompiledGrammar]] = (
            OrderedDict()
        )
        self._compiler: xgrammar.GrammarCompiler | None = None

    def _backend(self) -> xgrammar.GrammarCompiler:
        """XGrammar's compiler over this vocabulary (built once, on the worker)."""
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo(
                vocabulary_bytes(self._tokenizer, self.vocab_size), xgr.VocabType.RAW,
                vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids,
            )
            # XGrammar's own cache is off: ours keys by spec and keeps failures too.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def submit(self, guided: GuidedDecoding) -> Future[xgrammar.CompiledGrammar]:
        """The compiled grammar of `guided`, as a future (done at once when cached).

        A failed compile's future holds a GrammarError naming ``guided.param``.
        """
        key = guided.cache_key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, guided)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def compile(self, guided: GuidedDecoding) -> xgrammar.CompiledGrammar:
        """`submit` and wait (raises GrammarError)."""
        return self.submit(guided).result()

    def state(self, guided: GuidedDecoding, eos_token_ids: Iterable[int]) -> GuidedState:
        """A new request's grammar state (its compile started or found in the cache)."""
        return GuidedState(guided, self.submit(guided), sorted(eos_token_ids))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, guided: GuidedDecoding) -> xgrammar.CompiledGrammar:
        compiler = self._backend()
        param = guided_param(guided)
        kind, spec = guided.kind, guided.spec
        try:
            if kind == "json_schema":
                try:
                    schema = json.loads(spec)
                except json.JSONDecodeError as exc:
                    raise GrammarError(param, f"the JSON schema is not valid JSON: {exc}") from exc
                if not isinstance(schema, dict | bool):
                    raise GrammarError(param, "the JSON schema must be an object")
                return compiler.compile_json_schema(
                    json.dumps(prepare_schema(schema, param)),
                    any_whitespace=guided.any_whitespace, strict_mode=True,
                )
            if kind == "json_object":
                return compiler.compile_json_schema(
                    '{"type": "object", "additionalProperties": true}',
                    any_whitespace=guided.any_whitespace, strict_mode=False,
                )
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "ebnf":
                return compiler.compile_grammar(spec)
            try:
                tag = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise GrammarError(param, f"the structural tag is not valid JSON: {exc}") from exc
            return compiler.compile_structural_tag(json.dumps(_tag_schemas(tag, param)))
        except GrammarError:
            raise
        except Exception as exc:  # XGrammar's RuntimeError, InvalidJSONError, ValidationError
            message = _CPP_PREFIX.sub("", str(exc).strip()).strip() or type(exc).__name__
            raise GrammarError(param, f"invalid {kind} grammar: {message}") from exc


def _tag_schemas(node: Any, param: str) -> Any:
    """A structural tag with each ``{"type": "json_schema"}`` content through prepare_schema."""
    if isinstance(node, list):
        return [_tag_schemas(item, param) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and "json_schema" in node:
        return {**node, "json_schema": prepare_schema(node["json_schema"], param)}
    return {key: _tag_schemas(value, param) for key, value in node.items()}


class GuidedState:
    """One request's grammar: the compile's future, then a matcher over its output.

    The matcher is made at first use from the output tokens so far (replayed), so
    `drop_matcher` (on preemption) loses nothing: the recompute replays the same tokens.
    """

    def __init__(
        self, guided: GuidedDecoding, future: Future[xgrammar.CompiledGrammar],
        eos_token_ids: list[int],
    ) -> None:
        self.guided = guided
        self.future = future
        self.eos_token_ids = eos_token_ids
        self.matcher: xgrammar.GrammarMatcher | None = None
        self.num_accepted = 0
        self.rejected = False  # a token the grammar did not allow was appended

    @property
    def ready(self) -> bool:
        return self.future.done()

    @property
    def error(self) -> GrammarError | None:
        """The compile's error once done (None while compiling or when it succeeded),
        naming this request's field: a cached failure may come from another request that
        sent the same grammar through another route (`text.format.schema` of the
        Responses API, `response_format.json_schema.schema` of chat)."""
        if not self.future.done() or self.future.cancelled():
            return None
        exc = self.future.exception()
        if exc is None:
            return None
        message = str(exc) if isinstance(exc, GrammarError) else f"grammar compile failed: {exc}"
        return GrammarError(guided_param(self.guided), message)

    def matcher_for(self, output_token_ids: Sequence[int]) -> xgrammar.GrammarMatcher:
        """The matcher, made and replayed over `output_token_ids` if there is none."""
        if self.matcher is None:
            import xgrammar as xgr

            self.matcher = xgr.GrammarMatcher(
                self.future.result(), override_stop_tokens=self.eos_token_ids or None,
            )
            self.num_accepted = 0
            for token in output_token_ids:
                self.accept(token)
        return self.matcher

    def advance(self, output_token_ids: Sequence[int]) -> bool:
        """Take the last of `output_token_ids` (just appended); False if the grammar refused."""
        self.matcher_for(output_token_ids[:-1])
        return self.accept(output_token_ids[-1])

    def accept(self, token: int) -> bool:
        assert self.matcher is not None
        self.num_accepted += 1
        if self.rejected or self.matcher.is_terminated():
            self.rejected = True
            return False
        if not self.matcher.accept_token(token):
            self.rejected = True
        return not self.rejected

    @property
    def terminated(self) -> bool:
        """The grammar is complete and has taken EOS: the request is done."""
        return self.matcher is not None and self.matcher.is_terminated()

    def drop_matcher(self) -> None:
        """Forget the matcher (preemption); the next use replays the output tokens."""
        self.matcher = None
        self.num_accepted = 0
        self.rejected = False


def fill_bitmask(
    states: Sequence[GuidedState | None],
    output_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
) -> tuple[torch.Tensor, list[int]] | None:
    """The ``[B, ceil(V/32)]`` int32 bitmask of a step's rows and the rows that have one.

    Row ``i`` is filled from ``states[i]``'s matcher (None: no grammar, left out); returns
    None when no row has a grammar.
    """
    rows = [i for i, state in enumerate(states) if state is not None]
    if not rows:
        return None
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(states), vocab_size)
    for row in rows:
        state = states[row]
        assert state is not None
        state.matcher_for(output_token_ids[row]).fill_next_token_bitmask(bitmask, row)
    return bitmask, rows


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the disallowed tokens of `rows` of `logits` ``[B, V]`` (float32) to -inf, in place."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device, non_blocking=True),
        indices=None if len(rows) == logits.shape[0] else rows,
    )
