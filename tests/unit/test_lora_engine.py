"""LoRA adapters through the engine (engine/lora/manager.py): requests name an adapter, the
step's rows carry their slots, and a batch mixing the base model and several adapters
generates what each alone does, and what `peft`'s merged model does in float32; slots are
held only while a request runs, and an adapter's KV blocks are never another's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.test_family_engine_parity import _byte_tokenizer
from tests.unit.test_lora import ADAPTERS, _base, _merged
from tests.unit.test_lora import folders as folders  # the fixture: base + adapters
from tokenyard.engine.llm import LLM
from tokenyard.engine.lora.manager import UnknownAdapter
from tokenyard.wire.sampling_params import SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

PROMPT = [1, 17, 33, 5, 99, 64, 81, 40, 12, 7, 50, 3, 77]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)


def _llm(folders: dict[str, Path], max_loras: int = 2, **extra: Any) -> LLM:
    _byte_tokenizer(folders["base"])
    modules = ",".join(f"{name}={folders[name]}" for name in ADAPTERS)
    # 4-token blocks and 8-token steps: prompts are prefilled in chunks across pages.
    config: dict[str, Any] = {"num_kv_blocks": 64, **extra}
    return LLM(str(folders["base"]), weights="float32", device="cpu", block_size=4,
               max_num_batched_tokens=8, lora_modules=modules, max_loras=max_loras,
               max_lora_rank=8, **config)


def _run(llm: LLM, loras: list[str | None],
         prompt: list[int] = PROMPT) -> list[tuple[list[int], list[float]]]:
    results = llm.generate([prompt] * len(loras), GREEDY, loras=loras)
    out = []
    for result in results:
        completion = result.completions[0]
        assert completion.logprobs is not None
        out.append((completion.token_ids, [e.logprob for e in completion.logprobs]))
    return out


def _peft_greedy(model: Any, steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from full forward passes of `model`."""
    ids = list(PROMPT)
    logprobs = []
    with torch.no_grad():
        for _ in range(steps):
            row = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], dim=-1)
            token = int(row.argmax())
            ids.append(token)
            logprobs.append(float(row[token]))
    return ids[len(PROMPT):], logprobs


def test_a_mixed_batch_matches_peft_merged_and_each_alone(folders: dict[str, Path]) -> None:
    llm = _llm(folders)
    names: list[str | None] = [None, *ADAPTERS]
    together = _run(llm, names)  # one batch: base rows and both adapters in each step
    assert llm.core.runner.loras.in_use is False  # every slot given back
    for name, (tokens, logprobs) in zip(names, together, strict=True):
        alone = _run(llm, [name])[0]
        assert alone[0] == tokens, name
        torch.testing.assert_close(torch.tensor(alone[1]), torch.tensor(logprobs),
                                   atol=1e-4, rtol=0)
        reference = _base().eval() if name is None else _merged(folders, name)
        want_tokens, want_logprobs = _peft_greedy(reference, len(tokens))
        assert tokens == want_tokens, name
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs),
                                   atol=1e-3, rtol=0)
    assert together[1] != together[0] and together[2] != together[0]  # adapters matter


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_a_request_waits_for_a_slot_and_slots_come_back(folders: dict[str, Path],
                                                        overlap: bool) -> None:
    """One slot, two adapters: the second adapter's request waits until the first ends,
    base requests run beside both, and each output is its own alone (with async
    scheduling too, where a slot is rewritten while a step that read it is in flight)."""
    llm = _llm(folders, max_loras=1, async_scheduling=overlap)
    names: list[str | None] = ["qv", "all", None]
    together = _run(llm, names)
    loras = llm.core.runner.loras
    assert loras.bank.num_users == 0 and loras.bank.resident == ["all"]
    for name, got in zip(names, together, strict=True):
        assert _run(llm, [name])[0][0] == got[0], name
    # An aborted request gives its slot back too.
    llm.frontend.add_request("cut", PROMPT, GREEDY, lora="qv")
    llm.frontend.step()
    assert loras.bank.num_users == 1
    llm.frontend.abort("cut")
    assert loras.bank.num_users == 0


def test_an_adapters_kv_blocks_are_its_own(folders: dict[str, Path]) -> None:
    llm = _llm(folders)
    prompt = PROMPT + PROMPT  # several full blocks
    _run(llm, [None], prompt)
    hits = llm.generate([prompt, prompt], GREEDY, loras=[None, "qv"])
    assert hits[0].num_cached_tokens > 0  # the base model's blocks, again
    assert hits[1].num_cached_tokens == 0  # never the base's blocks for an adapter
    again = llm.generate([prompt], GREEDY, loras=["qv"])[0]
    assert again.num_cached_tokens > 0  # but its own


def test_an_unknown_adapter_is_refused(folders: dict[str, Path]) -> None:
    llm = _llm(folders)
    with pytest.raises(UnknownAdapter, match="nope"):
        llm.generate([PROMPT], GREEDY, loras=["nope"])
    assert not llm.core.has_work


def test_a_preempted_request_gives_its_slot_back_and_recomputes(
        folders: dict[str, Path]) -> None:
    """A pool too small for both requests: one is preempted (its slot released, taken
    again when it resumes) and both still answer as alone."""
    llm = _llm(folders, num_kv_blocks=8)  # 32 tokens; each request needs 19
    names: list[str | None] = ["qv", "all"]
    together = _run(llm, names)
    assert llm.core.scheduler.num_preemptions > 0
    assert llm.core.runner.loras.bank.num_users == 0
    for name, got in zip(names, together, strict=True):
        assert _run(llm, [name])[0][0] == got[0], name


def test_an_adapter_replaced_while_running_keeps_its_weights_for_that_request(
        folders: dict[str, Path]) -> None:
    """Registering a name again (the admin API's run-time registration) while a request
    runs with it: that request ends with the weights it started with, the next one gets
    the new adapter, and forgetting the name refuses new requests."""
    llm = _llm(folders)
    want = {name: _run(llm, [name])[0][0] for name in ADAPTERS}
    loras = llm.core.runner.loras
    loras.register("x", folders["qv"])
    frontend = llm.frontend
    frontend.add_request("old", PROMPT, GREEDY, lora="x")
    got: dict[str, list[int]] = {"old": [], "new": []}

    def step() -> None:
        for out in frontend.step():
            for delta in out.deltas:
                got[out.request_id].extend(delta.token_ids)

    step()
    step()
    loras.register("x", folders["all"])  # replaced under the running request
    frontend.add_request("new", PROMPT, GREEDY, lora="x")
    while frontend.has_work:
        step()
    assert got == {"old": want["qv"], "new": want["all"]}
    assert loras.bank.num_users == 0
    assert loras.unregister("x") and not loras.unregister("x")
    with pytest.raises(UnknownAdapter):
        llm.generate([PROMPT], GREEDY, loras=["x"])


def test_switching_adapters_costs_no_extra_step(folders: dict[str, Path]) -> None:
    """Three requests of the base model, and three of the base and two adapters, take the
    same number of steps: an adapter is a row's slot, not a step of its own (no prefix
    cache: each side computes every token)."""
    llm = _llm(folders, enable_prefix_caching=False)
    frontend = llm.frontend
    steps = {}
    for side, names in (("base", [None, None, None]), ("mixed", [None, "qv", "all"])):
        for i, name in enumerate(names):
            frontend.add_request(f"{side}{i}", PROMPT[i:], GREEDY, lora=name)
        steps[side] = 0
        while frontend.has_work:
            frontend.step()
            steps[side] += 1
    assert steps["mixed"] == steps["base"]
