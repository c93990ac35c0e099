"""The OpenAI dialect's routes: POST /v1/chat/completions and POST /v1/completions
(GET /v1/models, shared with Anthropic's dialect, is `api/models`). Each parses and
converts its body into the pipeline's `Call`, whose `build` does the dialect's prompt
work for the deployment the pipeline chose, and renders the started run with its
dialect's `Format`."""

from __future__ import annotations

from aiohttp import web

from tokenyard.api.context import read_request
from tokenyard.api.openai.completion_fields import best_of
from tokenyard.api.openai.convert import (
    chat_request_to_engine,
    completion_request_to_engine,
)
from tokenyard.api.openai.schemas import ChatCompletionRequest, CompletionRequest
from tokenyard.api.openai.stream import ChatFormat, CompletionFormat
from tokenyard.api.openai.tools import tool_messages, tool_use
from tokenyard.api.respond import Plan, answer
from tokenyard.gateway.call import Prepared
from tokenyard.gateway.pipeline import Run, Served, placed, preparer
from tokenyard.telemetry.timeline import Timeline
from tokenyard.text.tools import template_tools


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    return await answer(request, chat_plan(await read_request(request, ChatCompletionRequest)))


def chat_plan(req: ChatCompletionRequest) -> Plan:
    """A chat completion request's `Plan`."""
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "messages"

    def build(served: Served, timeline: Timeline) -> Prepared:
        messages, params = chat_request_to_engine(req, served.vocab_size, served.sampling)
        tools, passed_on, native = placed(tool_use(req), served)
        messages = tool_messages(req, messages, tools, native)
        prepare, _ = preparer(served)
        prompt = prepare.conversation(messages, timeline, prefill=False,
                                      tools=template_tools(tools, native))
        params = prepare.fit(len(prompt), prepare.constrained(params, tools), param)
        return Prepared([prompt], [params], messages=messages, passed_on=passed_on,
                        tools=tools or passed_on)

    def fmt(run: Run) -> ChatFormat:
        ready = run.ready
        return ChatFormat(run.served.name, ready.params[0].n, req.include_usage,
                          run.token_bytes, ready.tools, run.served.reasoning_for(ready.prompts[0]))

    return Plan(req.model, build, fmt, bool(req.stream), dict(
        text_size=sum(len(m.text) for m in req.messages),
        first_user_text=next((m.text for m in req.messages if m.role == "user"), None),
        fallbacks=req.fallbacks(req.model)))


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions (several prompts: choice i*n+j is completion j of prompt i)."""
    return await answer(request, completion_plan(await read_request(request, CompletionRequest)))


def completion_plan(req: CompletionRequest) -> Plan:
    """A legacy completion request's `Plan`."""
    raw = req.prompt
    texts = [raw] if isinstance(raw, str) else [p for p in raw if isinstance(p, str)]

    def build(served: Served, timeline: Timeline) -> Prepared:
        prompts, params = completion_request_to_engine(req, served.vocab_size,
                                                       served.sampling)
        prepare, tok = preparer(served)
        ids = [prepare.encode_prompt(p) for p in prompts]
        timeline.mark("tokenized")
        fitted = [prepare.fit(len(p), params, "max_tokens") for p in ids]
        echo = [p if isinstance(p, str) else tok.decode(p) for p in prompts] if req.echo else None
        return Prepared(ids, fitted, texts=[p if isinstance(p, str) else None for p in prompts],
                        note=echo)

    def fmt(run: Run) -> CompletionFormat:
        best = best_of(req, req.n or 1)
        return CompletionFormat(run.served.name, best.n if best else run.ready.params[0].n,
                                req.include_usage, run.token_bytes, run.ready.note, best,
                                scored=req.logprobs is not None)

    return Plan(req.model, build, fmt, bool(req.stream), dict(
        capability="completions", text_size=max(map(len, texts), default=0), param="prompt",
        fallbacks=req.fallbacks(req.model)))


def add_openai_routes(app: web.Application) -> None:
    """The OpenAI dialect's routes on `app`."""
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
