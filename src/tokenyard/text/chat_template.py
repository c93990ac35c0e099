"""Rendering chat messages into a prompt with a model's Jinja chat template.

Templates come from model files, so they are untrusted code: they run in Jinja's immutable sandbox.
The environment follows the Hugging Face conventions that published templates are written against
(block trimming, `raise_exception`, a non-escaping `tojson`, `strftime_now`, `{% generation %}`),
so a template renders here exactly as it does with `transformers`' `apply_chat_template`.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

# ChatML, used for models that ship no template of their own.
DEFAULT_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render, or rejected the conversation."""


def _raise_exception(message: str) -> NoReturn:
    # Templates call this to reject a conversation (e.g. roles that do not alternate).
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes "<", ">" and "&", which would corrupt tool schemas in prompts.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    """The current local time formatted with `fmt` (templates use it for "Today is ...")."""
    return datetime.now().strftime(fmt)


class _SafeNamespace(Namespace):
    """`namespace()` that refuses underscore names, so templates cannot reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # Same positional-only trick as Jinja's Namespace, so `namespace(self=...)` still works.
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks assistant text for training masks in
    transformers; for serving it only needs to render its body."""

    tags = {"generation"}  # noqa: RUF012 (Jinja reads this class attribute)

    def parse(self, parser: Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


@lru_cache(maxsize=64)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _SafeNamespace
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"chat template does not compile (line {exc.lineno}): {exc}"
        ) from exc


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """Render `messages` with the Jinja chat `template` into the prompt text.

    `add_generation_prompt` appends the header that opens the assistant's turn. `tools` are JSON
    schemas for templates that support tool calling. `extra` goes to the template as further
    variables (e.g. `enable_thinking`). Raises ChatTemplateError when the template does not
    compile, fails while rendering, or rejects the conversation through `raise_exception`.
    """
    compiled = _compile(template)
    try:
        return compiled.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:
        # Includes SecurityError from the sandbox and UndefinedError from misuse of missing values.
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
        # Plain Python errors from the template's expressions, e.g. "str" + None.
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
