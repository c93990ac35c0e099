"""Moderation of a generating request: the pipeline's stages 8 (input) and 17 (output).

`check_input` resolves nothing itself: the pipeline passes the request's policy (the
stricter of its deployment's and its org's, `policy_for`). In block mode it classifies the
input before anything is generated — a flagged input is a 400 `content_policy_violation`
and nothing is charged; its time is the Server-Timing stage `moderate`. In flag mode the
input is classified in a background task and only recorded.

`tap` wraps the generations. In block mode each completion's streamed text is held back
by the policy's window (characters) until a check of that window passes, so text reaches
the client only once checked; a flagged window closes the generation (the replica aborts
it and frees its blocks) and ends every unfinished completion with finish_reason
"content_filter" — the withheld text is dropped, the tokens generated are billed. In flag
mode the whole texts are classified after the generation closed, in the background.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from tokenyard.gateway.call import Generating, Wrapper
from tokenyard.gateway.moderation import OFF, ModerationPolicy, Moderator, Verdict, blocked
from tokenyard.gateway.served import Served
from tokenyard.telemetry.timeline import Timeline
from tokenyard.wire.outputs import CompletionDelta, RequestOutput

#: The finish reason of a completion stopped by output moderation.
CONTENT_FILTER = "content_filter"


async def policy_for(moderator: Moderator | None, served: Served,
                     org_id: str | None) -> ModerationPolicy:
    """The request's policy (off without a moderator)."""
    if moderator is None:
        return OFF
    return await moderator.policy(served.spec.moderation, served.name, org_id)


def input_texts(
    served: Served, prompts: Sequence[list[int]], messages: Sequence[Any] | None,
    texts: Sequence[str | None] | None,
) -> list[str]:
    """What the client wrote: the messages' texts (one string, a message a line), else
    the prompts' texts, else the prompts' tokens decoded."""
    if messages is not None:
        return ["\n".join(m["content"] for m in messages
                          if isinstance(m.get("content"), str) and m["content"])]
    result = []
    for i, prompt in enumerate(prompts):
        text = texts[i] if texts is not None else None
        if text is None and served.tokenizer is not None:
            text = served.tokenizer.decode(prompt)
        result.append(text or "")
    return result


async def check_input(
    moderator: Moderator | None, policy: ModerationPolicy, served: Served,
    prompts: Sequence[list[int]], *, messages: Sequence[Any] | None,
    texts: Sequence[str | None] | None, request_id: str, timeline: Timeline,
) -> None:
    """Stage 8: refuse a flagged input (block) or audit it in the background (flag)."""
    if moderator is None or not policy.active or policy.input == "off":
        return
    assert policy.classifier is not None
    inputs = input_texts(served, prompts, messages, texts)
    if policy.input == "flag":
        moderator.audit(policy, request_id, "input", inputs)
        return
    began = time.perf_counter_ns()
    verdicts = await policy.classifier.classify(inputs)
    timeline.add("moderate", time.perf_counter_ns() - began)
    if any(v.flagged for v in verdicts):
        moderator.record(policy, request_id, "input", "block", verdicts)
        raise blocked("messages" if messages is not None else "prompt", verdicts)


def tap(moderator: Moderator | None, policy: ModerationPolicy, gens: list[Generating],
        request_id: str, timeline: Timeline) -> list[Generating]:
    """The generations as the policy's output mode wants them (untouched when off)."""
    if moderator is None or policy.output == "off" or not policy.active:
        return gens
    wrap = _Blocking if policy.output == "block" else _Audited
    return [wrap(gen, policy, moderator, request_id, timeline) for gen in gens]


class _Moderated(Wrapper):
    """A generation as the pipeline's caller sees it, its outputs passing through moderation."""

    def __init__(self, gen: Generating, policy: ModerationPolicy, moderator: Moderator,
                 request_id: str, timeline: Any) -> None:
        super().__init__(gen)
        self._policy = policy
        self._moderator = moderator
        self._request_id = request_id
        self._timeline = timeline
        #: Completions ended by the filter.
        self._filtered: set[int] = set()

    @property
    def finish_reasons(self) -> list[str | None]:
        return [CONTENT_FILTER if i in self._filtered else r
                for i, r in enumerate(self._gen.finish_reasons)]

    @property
    def stop_reasons(self) -> list[int | str | None]:
        # The ledger counts a filtered completion as stopped (by the server's filter).
        return [CONTENT_FILTER if i in self._filtered else r
                for i, r in enumerate(self._gen.stop_reasons)]


class _Audited(_Moderated):
    """Flag mode: outputs pass unchanged; once closed, the texts are classified in the
    background and recorded if flagged."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._texts: dict[int, list[str]] = {}
        self._audited = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        async for out in self._gen:
            for delta in out.deltas:
                if delta.text:
                    self._texts.setdefault(delta.index, []).append(delta.text)
            yield out

    async def close(self) -> None:
        await self._gen.close()
        if not self._audited:
            self._audited = True
            self._moderator.audit(self._policy, self._request_id, "output",
                                  ["".join(parts) for parts in self._texts.values()])


class _Held:
    """One completion's deltas not yet released, and the checked text before them."""

    __slots__ = ("context", "deltas", "finish", "text")

    def __init__(self) -> None:
        self.deltas: list[CompletionDelta] = []
        self.text = ""
        self.context = ""
        self.finish = False

    def add(self, delta: CompletionDelta) -> None:
        self.deltas.append(delta)
        self.text += delta.text
        self.finish = self.finish or delta.finish_reason is not None

    def release(self, keep: int) -> CompletionDelta | None:
        """Merge and remove the leading deltas that leave at least `keep` characters
        held (all of them when the completion finished); None when none go."""
        if self.finish:
            count = len(self.deltas)
        else:
            count, left = 0, len(self.text)
            while count < len(self.deltas) and left - len(self.deltas[count].text) >= keep:
                left -= len(self.deltas[count].text)
                count += 1
        if not count:
            return None
        going, self.deltas = self.deltas[:count], self.deltas[count:]
        text = "".join(d.text for d in going)
        self.text = self.text[len(text):]
        self.context = (self.context + text)[-keep:]
        last = going[-1]
        logprobs = ([lp for d in going for lp in d.logprobs or ()]
                    if any(d.logprobs is not None for d in going) else None)
        return CompletionDelta(index=last.index, text=text,
                               token_ids=[t for d in going for t in d.token_ids],
                               logprobs=logprobs, finish_reason=last.finish_reason,
                               stop_reason=last.stop_reason)


class _Blocking(_Moderated):
    """Block mode: each completion's text is held back by the window until checked; a
    flagged check closes the generation and ends it with content_filter."""

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        window = self._policy.window
        held: dict[int, _Held] = {}
        async for out in self._gen:
            for delta in out.deltas:
                held.setdefault(delta.index, _Held()).add(delta)
            due = [i for i, h in held.items()
                   if h.deltas and (h.finish or len(h.text) >= 2 * window)]
            if due and await self._flagged([held[i].context + held[i].text for i in due]):
                await self._gen.close()  # the replica aborts every completion
                # Every completion whose end the client has not seen ends here.
                self._filtered = {i for i in range(self._gen.params.n)
                                  if i not in held or held[i].deltas or not held[i].finish}
                yield self._stopped(out)
                return
            released = [d for i in due if (d := held[i].release(window)) is not None]
            if released or out.finished:
                yield RequestOutput(out.request_id, released, out.finished,
                                    out.num_prompt_tokens, out.num_cached_tokens,
                                    out.num_output_tokens)
            if out.finished:
                return

    async def _flagged(self, texts: list[str]) -> bool:
        assert self._policy.classifier is not None
        began = time.perf_counter_ns()
        verdicts: list[Verdict] = await self._policy.classifier.classify(texts)
        self._timeline.add("moderate_output", time.perf_counter_ns() - began)
        if any(v.flagged for v in verdicts):
            self._moderator.record(self._policy, self._request_id, "output", "block",
                                   verdicts)
            return True
        return False

    def _stopped(self, out: RequestOutput) -> RequestOutput:
        """The last output of a filtered generation: content_filter for each completion
        the filter ended, nothing of their withheld text."""
        deltas = [CompletionDelta(index=i, text="", token_ids=[], logprobs=None,
                                  finish_reason=CONTENT_FILTER, stop_reason=None)
                  for i in sorted(self._filtered)]
        return RequestOutput(out.request_id, deltas, True, out.num_prompt_tokens,
                             out.num_cached_tokens, out.num_output_tokens)
