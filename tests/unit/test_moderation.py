"""Moderation's parts without a server: the local model against its own package's
predictions and its speed, the blocklist, the fleet file's `moderation` table, policies
(the stricter of org and deployment) over a real store, the audit trail, and the
hold-back of streamed text."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest

from tests.unit.test_store import database_url, run  # noqa: F401
from tokenyard.deployments import FleetConfigError, parse_fleet
from tokenyard.gateway.admin import AdminError
from tokenyard.gateway.moderate import _Held
from tokenyard.gateway.moderation import (
    BlocklistClassifier,
    Moderator,
    ProfanityClassifier,
    org_moderation,
    stricter,
)
from tokenyard.moderation_spec import ModerationSpec
from tokenyard.store.repo import DEFAULT_ORG_ID, Store
from tokenyard.wire.outputs import CompletionDelta

TEXTS = [
    "hello there, my friend", "you are a fucking idiot", "What is the capital of France?",
    "", "shit", "The dog, a friendly little terrier named Max, went home.",
    "Please summarise this article about the economy in three sentences.",
    "go to hell you piece of garbage", "I love my damn cat",
]


@pytest.fixture(scope="module")
def local() -> ProfanityClassifier:
    return ProfanityClassifier()


def test_local_model_gives_its_package_probabilities(local: ProfanityClassifier) -> None:
    from profanity_check import predict_prob

    expected = predict_prob(TEXTS)
    for text, want in zip(TEXTS, expected, strict=True):
        assert local.probability(text) == pytest.approx(float(want), abs=1e-9), text
    verdicts = asyncio.run(local.classify(TEXTS))
    assert [v.flagged for v in verdicts] == [float(p) >= 0.5 for p in expected]
    assert verdicts[1].flagged and verdicts[1].flagged_categories == ["profanity", "harassment"]
    assert not verdicts[2].flagged and verdicts[2].scores["profanity"] < 0.1


def test_local_model_is_fast_enough_for_the_request_path(local: ProfanityClassifier) -> None:
    """Input moderation's budget is 2 ms p50; a chat prompt of a few hundred characters
    takes the local model tens of µs."""
    prompt = " ".join(TEXTS) * 4  # ~700 characters
    times = []
    for _ in range(300):
        began = time.perf_counter()
        local.verdict(prompt)
        times.append(time.perf_counter() - began)
    p50 = statistics.median(times)
    print(f"local classifier p50 {p50 * 1e6:.0f} µs for {len(prompt)} characters")
    assert p50 < 0.002


def test_blocklist_flags_its_categories_case_insensitively() -> None:
    blocklist = BlocklistClassifier({"violence": [r"\bkill\b", "murder"], "pets": ["terrier"]})
    a, b, c = asyncio.run(blocklist.classify(
        ["How do I KILL a process?", "a Terrier and a murder", "skills"]))
    assert a.flagged and a.flagged_categories == ["violence"]
    assert b.categories == {"violence": True, "pets": True} and b.scores["pets"] == 1.0
    assert not c.flagged and c.scores == {"violence": 0.0, "pets": 0.0}


def test_stricter() -> None:
    assert stricter("off", "flag") == "flag" and stricter("block", "flag") == "block"
    assert stricter("off", "off") == "off"


def fleet(moderation: dict[str, object]) -> dict[str, object]:
    return {"deployments": [{"name": "d", "urls": ["http://127.0.0.1:1"],
                             "moderation": moderation}]}


def test_fleet_file_moderation_table() -> None:
    spec = parse_fleet(fleet({
        "input": "block", "output": "flag", "classifier": "blocklist", "window": 24,
        "patterns": {"violence": [r"\bkill\b"], "pets": ["terrier", "labrador"]},
    })).deployments["d"].moderation
    assert spec == ModerationSpec(input="block", output="flag", classifier="blocklist",
                                  window=24, patterns=(("violence", (r"\bkill\b",)),
                                                       ("pets", ("terrier", "labrador"))))
    assert parse_fleet({"deployments": [{"name": "d", "urls": ["http://x"]}]}) \
        .deployments["d"].moderation is None
    for bad, field in (({"input": "deny"}, "moderation.input"),
                       ({"classifier": "magic"}, "moderation.classifier"),
                       ({"classifier": "blocklist"}, "moderation.patterns"),
                       ({"classifier": "blocklist", "patterns": {"x": ["("]}},
                        "moderation.patterns.x"),
                       ({"classifier": "upstream"}, "moderation.url"),
                       ({"window": 0}, "moderation.window"),
                       ({"colour": "red"}, "unknown field")):
        with pytest.raises(FleetConfigError, match=field.replace(".", r"\.")):
            parse_fleet(fleet(bad))


def test_org_policy_is_combined_with_the_deployments(database_url: str) -> None:  # noqa: F811
    async def scenario(store: Store) -> None:
        await store.ensure_default_org()
        moderator = Moderator(store)
        flagging = ModerationSpec(input="flag", output="off", classifier="blocklist",
                                  patterns=(("v", ("kill",)),))
        policy = await moderator.policy(flagging, "d", DEFAULT_ORG_ID)
        assert (policy.input, policy.output) == ("flag", "off")
        assert isinstance(policy.classifier, BlocklistClassifier)
        assert not (await moderator.policy(None, "d", DEFAULT_ORG_ID)).active

        result = await org_moderation(store, DEFAULT_ORG_ID, {"input": "block",
                                                              "output": "flag"}, moderator)
        assert result == {"org_id": DEFAULT_ORG_ID, "input": "block", "output": "flag"}
        policy = await moderator.policy(flagging, "d", DEFAULT_ORG_ID)
        assert (policy.input, policy.output) == ("block", "flag")  # the stricter of each
        # A deployment without a table gets the local model for its org's policy.
        policy = await moderator.policy(None, "d", DEFAULT_ORG_ID)
        assert isinstance(policy.classifier, ProfanityClassifier) and policy.active
        # Other processes read it within refresh_s; a fresh moderator reads it at once.
        assert await Moderator(store).org_policy(DEFAULT_ORG_ID) == ("block", "flag")
        # One direction at a time; off/off removes the row.
        await org_moderation(store, DEFAULT_ORG_ID, {"input": "off"}, moderator)
        assert await moderator.org_policy(DEFAULT_ORG_ID) == ("off", "flag")
        await org_moderation(store, DEFAULT_ORG_ID, {"output": "off"}, moderator)
        assert await Moderator(store).org_policy(DEFAULT_ORG_ID) == ("off", "off")
        with pytest.raises(AdminError, match="input must be one of"):
            await org_moderation(store, DEFAULT_ORG_ID, {"input": "deny"})
        with pytest.raises(AdminError, match="no org"):
            await org_moderation(store, "org_nope", {"input": "flag"})

    run(database_url, scenario)


def test_flag_mode_audits_in_the_background_and_records(database_url: str) -> None:  # noqa: F811
    async def scenario(store: Store) -> None:
        await store.ensure_default_org()
        moderator = Moderator(store)
        spec = ModerationSpec(input="flag", output="flag", classifier="blocklist",
                              patterns=(("violence", ("kill",)),))
        policy = await moderator.policy(spec, "dep", DEFAULT_ORG_ID)
        began = time.perf_counter()
        moderator.audit(policy, "req-1", "input", ["how to kill a process", "hello"])
        assert time.perf_counter() - began < 0.001  # nothing awaited
        assert await moderator.events() == []  # not yet run
        await moderator.drain()
        (event,) = await moderator.events(org_id=DEFAULT_ORG_ID)
        assert (event["request_id"], event["deployment"], event["direction"],
                event["action"], event["classifier"], event["categories"]) == (
            "req-1", "dep", "input", "flag", "blocklist", ["violence"])
        assert event["scores"] == {"violence": 1.0}
        await moderator.aclose()

    run(database_url, scenario)


def delta(text: str, finish: str | None = None) -> CompletionDelta:
    return CompletionDelta(index=0, text=text, token_ids=[len(text)], logprobs=None,
                           finish_reason=finish, stop_reason=None)


def test_held_text_is_released_only_behind_the_window() -> None:
    held = _Held()
    for piece in ["The ", "dog ", "is ", "a ", "friendly ", "little "]:
        held.add(delta(piece))
    out = held.release(8)  # keep at least 8 characters back
    assert out is not None and out.text == "The dog is a "
    assert held.text == "friendly little " and held.context == "The dog is a "[-8:]
    assert out.token_ids == [4, 4, 3, 2] and out.finish_reason is None
    assert held.release(len(held.text) + 1) is None  # nothing can go yet
    held.add(delta("terrier.", "stop"))
    out = held.release(8)  # a finished completion goes whole
    assert out is not None and out.text == "friendly little terrier."
    assert out.finish_reason == "stop" and not held.deltas
