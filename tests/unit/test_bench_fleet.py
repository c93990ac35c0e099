"""`bench fleet`'s parts that run without replicas: each org's conversations, the orgs'
keys, the decision-time measurement and the tables."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from tokenyard.bench import fleet_decision, fleet_profile
from tokenyard.bench.fleet import PolicyResult, table
from tokenyard.bench.stats import RequestRecord
from tokenyard.bench.tenants import TenantShape, create_tenants, tenant_conversations


def test_an_orgs_requests_share_its_system_prompt_and_extend_their_conversation() -> None:
    shape = TenantShape(system_len=12, input_len=5, output_len=3, turns=3, conversations=2,
                        idle_p=0.0)
    a = list(itertools.islice(tenant_conversations(shape, seed=1), 20))
    b = list(itertools.islice(tenant_conversations(shape, seed=2), 20))
    assert {r.messages[0]["content"] for r in a} == {a[0].messages[0]["content"]}
    assert a[0].messages[0] != b[0].messages[0]  # each org its own system prompt
    assert a == list(itertools.islice(tenant_conversations(shape, seed=1), 20))  # seeded
    last: dict[int, list[dict[str, str]]] = {}
    for r in a:
        assert r.conversation is not None and r.max_tokens == 3
        assert len(r.messages) == 2 + 2 * r.turn and r.turn < 3
        if r.turn:  # the previous turn's prompt, its reply, then a new user turn
            assert r.messages[:len(last[r.conversation])] == last[r.conversation]
        last[r.conversation] = r.messages
    assert len(last) > 2  # finished conversations were replaced by new ones


def test_an_idle_conversation_sits_out_the_orgs_next_requests() -> None:
    shape = TenantShape(system_len=4, input_len=2, output_len=1, turns=50, conversations=3,
                        idle_p=0.5, idle_for=4)
    requests = list(itertools.islice(tenant_conversations(shape, seed=3), 200))
    gaps = [j - i for conv in {r.conversation for r in requests}
            for i, j in itertools.pairwise(
                [n for n, r in enumerate(requests) if r.conversation == conv])]
    # Idle ones wait at least idle_for requests; others take turns at random (a gap of 1).
    assert max(gaps) > shape.idle_for and 1 in gaps


def test_the_shape_refuses_what_it_cannot_build() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        TenantShape(conversations=0)
    with pytest.raises(ValueError, match="idle_p"):
        TenantShape(idle_p=1.0)


def test_a_tenant_is_an_org_with_a_key_in_the_state_directorys_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENYARD_DATABASE_URL", "postgresql://nowhere.invalid/x")  # ignored
    (tenant,) = create_tenants(tmp_path, 1)  # two `tokenyard admin` runs: one tenant only
    assert tenant.org_id.startswith("org_") and tenant.api_key.startswith("sk-")
    assert (tmp_path / "tokenyard.db").exists()


def test_the_decision_is_timed_over_an_index_of_the_size_asked() -> None:
    result = fleet_decision.measure(blocks=3000, members=3, chain=50, prompt_blocks=80,
                                    decisions=40)
    assert (result.blocks, result.members, result.decisions) == (3000, 3, 40)
    assert 0 < result.p50_ms <= result.p99_ms
    text = fleet_decision.table([result, result], goal_ms=0.2)
    assert "| 3,000 | 3 | 80 | 40 | 2 |" in text


def test_the_table_gives_medians_with_their_range_and_the_ratios() -> None:
    def run(policy: str, hit: float, ttft: float) -> PolicyResult:
        return PolicyResult(policy, 10, 0, hit, ttft, 0.01, 5.0, 2 * ttft, 20.0)

    text = table([run("precise", 0.6, 100), run("round_robin", 0.2, 300),
                  run("affinity", 0.3, 150), run("precise", 0.8, 120),
                  run("round_robin", 0.1, 200), run("affinity", 0.4, 250),
                  run("precise", 0.7, 110), run("round_robin", 0.3, 250),
                  run("affinity", 0.5, 200)])
    assert "| precise | 30 (0) | 70.0 (60.0–80.0) % | 110 (100–120) |" in text
    assert "| precise | round_robin | 3.50× | 0.44× |" in text
    assert "| precise | affinity | 1.75× | 0.55× |" in text
    assert "| affinity | round_robin | 2.00× | 0.80× |" in text


def test_the_miss_profile_splits_first_turns_from_what_later_turns_could_hit() -> None:
    shape = TenantShape(system_len=4, input_len=2, output_len=1, turns=3, conversations=2,
                        idle_p=0.0)
    specs = list(itertools.islice(tenant_conversations(shape, seed=5), 8))
    records: list[RequestRecord] = []
    prompts: dict[int | None, int] = {}
    for i, spec in enumerate(specs):
        # A first turn is 40 tokens, of which a 32-token system prompt; each later turn
        # adds 20 to its conversation's last prompt.
        prompt = 40 if spec.turn == 0 else prompts[spec.conversation] + 20
        reachable = 0 if spec.turn == 0 else prompts[spec.conversation] // 16 * 16
        cached = (32 if i else 0) if spec.turn == 0 else reachable
        if i == len(specs) - 1 and spec.turn:
            cached = 0  # the last request's prefix was evicted
        prompts[spec.conversation] = prompt
        records.append(RequestRecord(i, 0.0, 0.0, ok=True, prompt_tokens=prompt,
                                     cached_tokens=cached))
    result = fleet_profile.profile("precise", [(iter(specs), records)], block_size=16,
                                   turns=3, evicted_blocks=7)
    firsts = [s for s in specs if s.turn == 0]
    assert result.first_tokens == 40 * len(firsts)
    assert result.first_cached == 32 * (len(firsts) - 1)  # the org's first found nothing
    last = records[-1].prompt_tokens or 0
    assert result.later_reachable_missed == (0 if specs[-1].turn == 0 else
                                             (last - 20) // 16 * 16)
    assert result.prompt_tokens == sum(r.prompt_tokens or 0 for r in records)
    # The ceiling: every reachable token hit, first turns after the org's first included.
    best = result.later_reachable + 32 * (len(firsts) - 1)
    assert result.ceiling({0: 32}) == best / result.prompt_tokens
    # The live set: two open conversations at most, sharing one 32-token system prompt.
    biggest = max(r.prompt_tokens or 0 for r in records)
    assert 40 <= fleet_profile.working_set_tokens([result]) <= 2 * biggest - 32
    text = fleet_profile.table([result, result])
    assert text.splitlines()[2].startswith("| precise |") and text.endswith("| 14 |")
