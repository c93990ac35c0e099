"""What a caller asks of one generation: sampling, stopping and logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

#: The kinds of grammar a request may be constrained by (see GuidedDecoding).
GUIDED_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "ebnf", "structural_tag")


class SamplingParamsError(ValueError):
    """A parameter is out of range; `param` names it as the API does."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GuidedDecoding:
    """A grammar the output must follow, enforced token by token by the replica (XGrammar).

    `kind` and `spec`:

    - ``"json_schema"``: `spec` is a JSON Schema document as JSON text. The output is one
      JSON value valid against it, on one line with one space after each ``:`` and ``,``
      (as ``json.dumps`` writes it) unless `any_whitespace` is true. Properties come in the
      schema's order; keys outside ``properties`` only where ``additionalProperties``
      allows them explicitly. Enforced (tested): type, properties, required, items,
      minItems, maxItems, enum, anyOf, minimum/maximum, maxLength, pattern, $ref, and the
      formats date, time, date-time (only dates Python parses), email, uuid. Refused with
      a 400: not, if/then/else, dependentSchemas, and a format together with
      minLength/maxLength/pattern (XGrammar would drop those silently).
    - ``"json_object"``: any JSON object (`spec` is ignored; send ``""`` or ``"{}"``).
    - ``"regex"``: `spec` is a regular expression the whole output must match.
    - ``"ebnf"``: `spec` is a grammar in XGrammar's GBNF-style EBNF (``root ::= ...``).
    - ``"structural_tag"``: `spec` is an XGrammar 0.2 structural tag as JSON text::

          {"type": "structural_tag",
           "format": {"type": "triggered_tags",
                      "triggers": ["<tool_call>"],
                      "tags": [{"type": "tag", "begin": "<tool_call>{\"name\": \"f\", ",
                                "content": {"type": "json_schema", "json_schema": {...}},
                                "end": "}</tool_call>"}],
                      "at_least_one": false,
                      "stop_after_first": false}}

      Free text is allowed until a trigger (a prefix of some tag's ``begin``) appears; then
      the tag's ``begin``, its content and its ``end`` are forced. ``at_least_one`` forbids
      ending without a tag (and then the output starts with a tag at once);
      ``stop_after_first`` ends the output after the first tag. ``"type": "tag"`` may be
      left out of a tag. Other formats of XGrammar 0.2 (``const_string``, ``sequence``,
      ``or``, ``regex``, ``grammar``, ``any_text``, ``tags_with_separator``, ...) are accepted
      as ``format`` too.

    The output ends (finish_reason "stop") once the grammar is complete and the model
    emits EOS; EOS is masked out everywhere else. `param` is the API field an invalid
    grammar is reported against (400 with that ``param``), e.g.
    ``"response_format.json_schema.schema"`` or ``"tools"``; None reports ``"guided"``.
    """

    kind: str
    spec: str = ""
    any_whitespace: bool = False
    param: str | None = None

    def __post_init__(self) -> None:
        param = self.param or "guided"
        if self.kind not in GUIDED_KINDS:
            raise SamplingParamsError(
                param, f"unknown grammar kind {self.kind!r}; one of {', '.join(GUIDED_KINDS)}"
            )
        if not isinstance(self.spec, str) or (not self.spec and self.kind != "json_object"):
            raise SamplingParamsError(param, f"a {self.kind} grammar needs a non-empty spec")

    @property
    def cache_key(self) -> tuple[str, str, bool]:
        """What a compiled grammar depends on (with the replica's tokenizer)."""
        return (self.kind, self.spec if self.kind != "json_object" else "", self.any_whitespace)


@dataclass
class SamplingParams:
    """Parameters named as in the OpenAI API and vLLM.

    temperature 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable those
    filters. `seed` makes the sample reproducible whatever else is in the batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: chosen token plus top k
    #: None: the prompt is not scored; k >= 0: each prompt token after the first gets its
    #: logprob given the tokens before it, plus the top k (vLLM's `prompt_logprobs`). The
    #: replica then computes the whole prompt (no prefix-cache hit: a cached block has no
    #: logits). With it, `max_tokens` may be 0: the prompt is scored, nothing generated.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    guided: GuidedDecoding | None = None  # constrained decoding; None: free text

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Raise SamplingParamsError naming the first parameter out of range."""
        checks: list[tuple[bool, str, str]] = [
            (self.n >= 1, "n", "n must be at least 1"),
            (0.0 <= self.temperature <= 2.0, "temperature", "temperature must be in [0, 2]"),
            (0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]"),
            (self.top_k >= -1, "top_k", "top_k must be -1, 0 (disabled) or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p", "min_p must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
             "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
             "frequency_penalty must be in [-2, 2]"),
            (0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
             "repetition_penalty must be in (0, 2]"),
            (self.max_tokens is None or self.max_tokens >= 1
             or (self.max_tokens == 0 and self.prompt_logprobs is not None), "max_tokens",
             "max_tokens must be at least 1"),
            (self.min_tokens >= 0, "min_tokens", "min_tokens must be non-negative"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             "min_tokens must not exceed max_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "top_logprobs",
             "top_logprobs must be in [0, 20]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             "prompt_logprobs", "prompt_logprobs must be in [0, 20]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop",
             "stop strings must be non-empty strings"),
            (len(self.stop) <= 16, "stop", "at most 16 stop strings"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise SamplingParamsError(param, message)
        for token, bias in (self.logit_bias or {}).items():
            if not -100.0 <= bias <= 100.0:
                raise SamplingParamsError(
                    "logit_bias", f"logit_bias for {token} must be in [-100, 100]"
                )

    @property
    def has_penalties(self) -> bool:
        """Whether sampling reads the tokens so far (presence, frequency, repetition)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
