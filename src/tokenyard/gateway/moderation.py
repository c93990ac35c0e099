"""Moderation (DESIGN stages 8 and 17): classifiers, policies, and the audit trail.

One interface, `Classifier.classify(texts) -> [Verdict]`, and three classifiers:

- `ProfanityClassifier` ("local"): the linear model `alt-profanity-check` ships (TF-IDF
  features, five calibrated linear SVMs averaged), loaded offline from its package data
  and evaluated here with numpy on its learned weights (the same probabilities as its
  `predict_prob`, without scikit-learn's per-call overhead: tens of µs, not ms);
- `BlocklistClassifier` ("blocklist"): regular expressions per category;
- `UpstreamClassifier` ("upstream"): an OpenAI-compatible `/v1/moderations` server.

A policy is one of off / flag / block per direction (input, output), set per deployment
(the fleet file's `moderation` table) and per org (`tokenyard admin orgs set-moderation`);
the stricter of the two applies. Flag mode never delays a request: its checks run in
background tasks and only record. Every flagged or blocked text becomes a
`moderation_events` row, written in batches by `EventRecorder` off the request path.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from tokenyard.balancer.moderation_client import ModerationClient, ModerationUnavailable
from tokenyard.errors import APIError, overloaded
from tokenyard.fleet_values import a_blocklist_pattern
from tokenyard.gateway.admin import AdminError, NotFound
from tokenyard.gateway.row_writer import RowWriter
from tokenyard.moderation_spec import MODERATION_MODES, ModerationSpec
from tokenyard.store.moderation import (
    ModerationEvent,
    insert_events,
    list_events,
    org_policies,
    set_org_policy,
)
from tokenyard.store.repo import Store

__all__ = [
    "BlocklistClassifier",
    "Classifier",
    "EventRecorder",
    "ModerationEvent",
    "ModerationPolicy",
    "Moderator",
    "ProfanityClassifier",
    "UpstreamClassifier",
    "Verdict",
    "blocked",
    "stricter",
]

logger = logging.getLogger("tokenyard.gateway.moderation")

#: The error code of a refused input (OpenAI's own for a prompt its policy refuses).
CONTENT_POLICY_VIOLATION = "content_policy_violation"
#: The classifier orgs get where their deployment names none.
DEFAULT_SPEC = ModerationSpec()


@dataclass(frozen=True)
class Verdict:
    """One text's result: whether it is flagged, each category's flag and score."""

    flagged: bool
    categories: dict[str, bool] = field(default_factory=dict)
    scores: dict[str, float] = field(default_factory=dict)

    @property
    def flagged_categories(self) -> list[str]:
        return [name for name, hit in self.categories.items() if hit]


class Classifier(Protocol):
    """Classifies texts; one verdict per text, in order."""

    name: str

    async def classify(self, texts: Sequence[str]) -> list[Verdict]: ...


def stricter(a: str, b: str) -> str:
    """The stricter of two policies (off < flag < block)."""
    return max(a, b, key=MODERATION_MODES.index)


# ---------------------------------------------------------------------------- classifiers


class ProfanityClassifier:
    """alt-profanity-check's model (English profanity and insults): category "profanity",
    and OpenAI's "harassment" (abusive language at someone), which is what it measures.
    It measures none of OpenAI's other categories (the /v1/moderations body lists them).

    Its package holds a fitted `TfidfVectorizer` and a `CalibratedClassifierCV` of linear
    SVMs with sigmoid calibration; loading them needs scikit-learn (no torch). A text's
    probability is the mean over the calibrated SVMs of 1 / (1 + exp(a·(w·x + b) + c)),
    x the text's l2-normalised TF-IDF vector."""

    name = "local"
    CATEGORY = "profanity"
    #: OpenAI's category whose text it measures: the same probability.
    OPENAI_CATEGORY = "harassment"

    def __init__(self, threshold: float = 0.5) -> None:
        from importlib.resources import files

        import joblib  # scikit-learn's loader: only a server that uses this model pays it
        import numpy as np

        data = files("profanity_check") / "data"
        vectorizer = joblib.load(data / "vectorizer.joblib")
        model = joblib.load(data / "model.joblib")
        self.threshold = threshold
        self._analyze = vectorizer.build_analyzer()
        self._vocabulary: dict[str, int] = vectorizer.vocabulary_
        self._idf = np.asarray(vectorizer.idf_, dtype=np.float64)
        members = model.calibrated_classifiers_
        positive = list(model.classes_).index(1)
        # One row of weights per SVM; its sigmoid's (a, c) beside it.
        self._weights = np.stack([np.ravel(m.estimator.coef_) for m in members]).T.copy()
        self._bias = np.array([float(np.ravel(m.estimator.intercept_)[0]) for m in members])
        sigmoids = [m.calibrators[0] for m in members]
        self._a = np.array([s.a_ for s in sigmoids])
        self._c = np.array([s.b_ for s in sigmoids])
        self._sign = 1.0 if positive == 1 else -1.0
        self._np = np

    def probability(self, text: str) -> float:
        """The model's probability that `text` is profane."""
        np = self._np
        counts: dict[int, int] = {}
        for token in self._analyze(text):
            index = self._vocabulary.get(token)
            if index is not None:
                counts[index] = counts.get(index, 0) + 1
        if counts:
            idx = np.fromiter(counts, dtype=np.int64, count=len(counts))
            values = np.fromiter(counts.values(), dtype=np.float64, count=len(counts))
            values *= self._idf[idx]
            values /= math.sqrt(float(values @ values))
            scores = values @ self._weights[idx] + self._bias
        else:
            scores = self._bias
        probs = 1.0 / (1.0 + np.exp(self._a * scores + self._c))
        mean = float(probs.mean())
        return mean if self._sign > 0 else 1.0 - mean

    def verdict(self, text: str) -> Verdict:
        p = self.probability(text)
        hit = p >= self.threshold
        return Verdict(hit, {self.CATEGORY: hit, self.OPENAI_CATEGORY: hit},
                       {self.CATEGORY: p, self.OPENAI_CATEGORY: p})

    async def classify(self, texts: Sequence[str]) -> list[Verdict]:
        return [self.verdict(text) for text in texts]


class BlocklistClassifier:
    """Regular expressions per category (case-insensitive); a match scores 1. Each is
    compiled on its own (not joined into one alternation, where an inline global flag
    such as ``(?i)`` is an error), exactly as the fleet file's validation compiles it."""

    name = "blocklist"

    def __init__(self, patterns: Mapping[str, Sequence[str]]) -> None:
        self._patterns = {
            category: [a_blocklist_pattern(p, f"patterns.{category}") for p in regexes]
            for category, regexes in patterns.items() if regexes}

    def verdict(self, text: str) -> Verdict:
        hits = {category: any(rx.search(text) for rx in regexes)
                for category, regexes in self._patterns.items()}
        return Verdict(any(hits.values()), hits, {c: float(h) for c, h in hits.items()})

    async def classify(self, texts: Sequence[str]) -> list[Verdict]:
        return [self.verdict(text) for text in texts]


class UpstreamClassifier:
    """An OpenAI-compatible `/v1/moderations` server; its failure is a 503 (block mode)
    or a logged, unrecorded check (flag mode)."""

    name = "upstream"

    def __init__(self, client: ModerationClient) -> None:
        self.client = client

    async def classify(self, texts: Sequence[str]) -> list[Verdict]:
        try:
            results = await self.client.moderate(texts)
        except ModerationUnavailable as exc:
            logger.warning("the moderation upstream failed: %s", exc)
            raise overloaded(1.0, "The moderation service is unavailable; retry after a "
                                  "short wait.") from None
        return [Verdict(r.flagged, r.categories, r.scores) for r in results]


def build_classifier(spec: ModerationSpec) -> Classifier:
    """The classifier a deployment's `moderation` table names."""
    if spec.classifier == "blocklist":
        return BlocklistClassifier(dict(spec.patterns))
    if spec.classifier == "upstream":
        import os

        assert spec.url is not None
        token = os.environ.get(spec.token_env) if spec.token_env else None
        return UpstreamClassifier(ModerationClient(spec.url, model=spec.model, token=token))
    return ProfanityClassifier(spec.threshold)


def blocked(direction: str, verdicts: Sequence[Verdict]) -> APIError:
    """The 400 of a refused input, naming the flagged categories."""
    names = sorted({c for v in verdicts for c in v.flagged_categories})
    return APIError(
        400, f"The {direction} was flagged by this server's content policy"
             f"{' (' + ', '.join(names) + ')' if names else ''} and was not processed.",
        param="messages" if direction == "messages" else None,
        code=CONTENT_POLICY_VIOLATION)


# ---------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class ModerationPolicy:
    """What applies to one request: each direction's mode, the classifier, the window."""

    input: str
    output: str
    classifier: Classifier | None
    window: int = DEFAULT_SPEC.window
    deployment: str = ""
    org_id: str | None = None

    @property
    def active(self) -> bool:
        return self.classifier is not None and (self.input, self.output) != ("off", "off")


OFF = ModerationPolicy("off", "off", None)


class EventRecorder(RowWriter[ModerationEvent]):
    """Queues moderation events and writes them in batches from a background task
    (`RowWriter`); without a store, events are only logged."""

    def __init__(self, store: Store | None, *, flush_s: float = 0.25,
                 max_pending: int = 10_000) -> None:
        async def write(events: list[ModerationEvent]) -> None:
            assert store is not None
            await insert_events(store.db, events)

        super().__init__(write, "moderation events", flush_s=flush_s,
                         max_pending=max_pending)
        self.store = store

    def add(self, row: ModerationEvent) -> None:
        if self.store is None:
            logger.info("moderation %s", row)
            return
        super().add(row)


class Moderator:
    """Policies (deployment's and org's), classifiers (built once per spec), background
    checks and the event recorder of one HTTP process."""

    def __init__(self, store: Store | None, *, refresh_s: float = 5.0) -> None:
        self.store = store
        self.refresh_s = refresh_s
        self.recorder = EventRecorder(store)
        self._classifiers: dict[ModerationSpec, Classifier] = {}
        self._orgs: dict[str, tuple[str, str]] = {}
        self._loaded = -math.inf
        self._reading: asyncio.Task[None] | None = None  # the org table's read under way
        self._tasks: set[asyncio.Task[None]] = set()

    async def classifier(self, spec: ModerationSpec) -> Classifier:
        """The classifier of `spec`, built once (in a thread: the local model's files
        take about a second to load, which must not stall the event loop)."""
        found = self._classifiers.get(spec)
        if found is None:
            built = await asyncio.to_thread(build_classifier, spec)
            found = self._classifiers.setdefault(spec, built)
        return found

    async def preload(self, specs: Sequence[ModerationSpec | None]) -> None:
        """Build the classifiers of `specs` now (at startup, not on a first request); the
        local model too when an org has a policy (a deployment without a table uses
        it)."""
        wanted = {spec for spec in specs if spec is not None}
        if self.store is not None and any(
                policy != ("off", "off") for policy in (await self._org_table()).values()):
            wanted.add(DEFAULT_SPEC)
        for spec in wanted:
            await self.classifier(spec)

    async def org_policy(self, org_id: str | None) -> tuple[str, str]:
        """The org's (input, output) policy, from a table reloaded every `refresh_s`."""
        if org_id is None or self.store is None:
            return "off", "off"
        return (await self._org_table()).get(org_id, ("off", "off"))

    async def _org_table(self) -> dict[str, tuple[str, str]]:
        """The org table, at most `refresh_s` old: one read at a time, in the background
        (requests meanwhile use the last table); only a table never read (or invalidated
        by `set_org_policy` here) is waited for, by every request, on that one read."""
        if self.store is not None and time.monotonic() - self._loaded > self.refresh_s:
            if self._reading is None:
                self._reading = asyncio.create_task(self._read_orgs())
            if self._loaded == -math.inf:
                await asyncio.shield(self._reading)
        return self._orgs

    async def _read_orgs(self) -> None:
        assert self.store is not None
        try:
            self._orgs = await org_policies(self.store.db)
            self._loaded = time.monotonic()
        except Exception as exc:  # the store is down: keep the last known table
            logger.warning("reading org moderation policies failed: %s", exc)
            self._loaded = time.monotonic() - self.refresh_s + 1.0  # retry in a second
        finally:
            self._reading = None

    async def policy(self, spec: ModerationSpec | None, deployment: str,
                     org_id: str | None) -> ModerationPolicy:
        """The stricter of the deployment's and the org's policies, per direction."""
        org_in, org_out = await self.org_policy(org_id)
        own = spec or DEFAULT_SPEC
        mode_in, mode_out = stricter(own.input, org_in), stricter(own.output, org_out)
        if (mode_in, mode_out) == ("off", "off"):
            return OFF
        return ModerationPolicy(mode_in, mode_out, await self.classifier(own), own.window,
                                deployment, org_id)

    async def set_org_policy(self, org_id: str, input: str, output: str) -> None:
        """Set an org's policy (seen at once here, within `refresh_s` elsewhere)."""
        if self.store is None:
            raise LookupError("moderation policies need the gateway's store")
        await set_org_policy(self.store.db, org_id, input, output)
        if self._reading is not None:  # it may have read the table before this change
            await asyncio.shield(self._reading)
        self._loaded = -math.inf

    def record(self, policy: ModerationPolicy, request_id: str, direction: str, action: str,
               verdicts: Sequence[Verdict]) -> None:
        """Queue an event for each flagged verdict."""
        for verdict in verdicts:
            if verdict.flagged:
                assert policy.classifier is not None
                self.recorder.add(ModerationEvent(
                    request_id=request_id[:64], created_at=datetime.now(UTC),
                    org_id=policy.org_id, deployment=policy.deployment, direction=direction,
                    action=action, classifier=policy.classifier.name,
                    categories=verdict.flagged_categories, scores=dict(verdict.scores)))

    def audit(self, policy: ModerationPolicy, request_id: str, direction: str,
              texts: Sequence[str]) -> None:
        """Flag mode: classify `texts` in a background task and record what is flagged;
        the caller never waits for it."""
        if policy.classifier is not None and texts:
            self.spawn(self._audit(policy, request_id, direction, list(texts)))

    async def _audit(self, policy: ModerationPolicy, request_id: str, direction: str,
                     texts: list[str]) -> None:
        assert policy.classifier is not None
        try:
            verdicts = await policy.classifier.classify(texts)
        except Exception as exc:
            logger.info("moderation audit of %s failed: %s", request_id, exc)
            return
        self.record(policy, request_id, direction, "flag", verdicts)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait for the background checks in flight (tests and shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        await self.recorder.flush()

    async def aclose(self) -> None:
        await self.drain()
        await self.recorder.close()
        for classifier in self._classifiers.values():
            if isinstance(classifier, UpstreamClassifier):
                await classifier.client.close()

    async def events(self, *, org_id: str | None = None, since: datetime | None = None,
                     limit: int = 100) -> list[dict[str, Any]]:
        if self.store is None:
            return []
        return await list_events(self.store.db, org_id=org_id, since=since, limit=limit)


# ---------------------------------------------------------------------------- admin


async def org_moderation(store: Store, org_id: str, args: Any,
                         moderator: Moderator | None = None) -> dict[str, Any]:
    """Validate and set an org's policy, `{input?, output?}` each off / flag / block (a
    direction left out stays as it was); `AdminError` names a bad field."""
    if not isinstance(args, dict):
        raise AdminError(None, "the body must be a JSON object")
    for name in ("input", "output"):
        if args.get(name) is not None and args[name] not in MODERATION_MODES:
            raise AdminError(name, f"{name} must be one of {', '.join(MODERATION_MODES)}")
    if await store.get_org(org_id) is None:
        raise NotFound("org_id", f"no org {org_id}")
    own = moderator or Moderator(store)
    current = await own.org_policy(org_id)
    policy = (args.get("input") or current[0], args.get("output") or current[1])
    await own.set_org_policy(org_id, *policy)
    return {"org_id": org_id, "input": policy[0], "output": policy[1]}
