"""LoRA adapters on the embedded model itself (SmolLM2-135M-Instruct, float32): random
`peft` adapters served by the engine give `peft`'s merged model's greedy tokens and their
logprobs within 1e-3, with a base request and a second adapter's in the same steps."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import peft
import pytest
import torch

from tokenyard.engine.llm import LLM
from tokenyard.wire.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]

#: name -> LoraConfig kwargs: every projection the engine adapts, and a smaller rsLoRA one
#: on o and the MLP only.
ADAPTERS: dict[str, dict[str, Any]] = {
    "smol-all": {"r": 8, "lora_alpha": 16,
                 "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                    "up_proj", "down_proj"]},
    "smol-mlp": {"r": 4, "lora_alpha": 8, "use_rslora": True,
                 "target_modules": ["o_proj", "gate_proj", "up_proj", "down_proj"]},
}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


def _merged_adapters(hf_model: Any, root: Path) -> dict[str, tuple[Path, Any]]:
    """Each adapter over a copy of `hf_model` (peft changes the model it wraps), random A
    and B (init_lora_weights=False: nn.Linear's init, B nonzero), saved as peft saves it;
    with peft's merged model of it."""
    out = {}
    for i, (name, kwargs) in enumerate(ADAPTERS.items()):
        torch.manual_seed(20 + i)
        config = peft.LoraConfig(init_lora_weights=False, **kwargs)
        tuned = peft.get_peft_model(copy.deepcopy(hf_model), config)
        tuned.save_pretrained(str(root / name))
        out[name] = (root / name, tuned.merge_and_unload().eval())
    return out


def _reference(model: Any, prompt: list[int], tokens: list[int]) -> tuple[list[int],
                                                                           list[float]]:
    """`model`'s greedy choice and its logprob at each of `tokens`' steps, teacher-forced
    on them (all choices equal to `tokens`: its own greedy continuation)."""
    ids = torch.tensor([prompt + tokens[:-1]])
    with torch.inference_mode():
        rows = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:].float(), dim=-1)
    choices = rows.argmax(dim=-1)
    return choices.tolist(), [float(rows[i, t]) for i, t in enumerate(tokens)]


def test_peft_adapters_on_smollm2_match_the_merged_model(llm: LLM, hf_model: Any,
                                                         tmp_path: Path) -> None:
    adapters = _merged_adapters(hf_model, tmp_path)
    loras = llm.core.loras
    for name, (folder, _) in adapters.items():
        loras.register(name, folder)
    try:
        prompt = llm.frontend.prompt_token_ids(CHAT)
        names: list[str | None] = [None, *ADAPTERS]
        results = llm.generate([prompt] * len(names), GREEDY, loras=names)  # one batch
        assert not loras.in_use  # every slot given back
    finally:
        for name in adapters:
            loras.unregister(name)
    ours = []
    for result in results:
        completion = result.completions[0]
        assert completion.logprobs is not None
        ours.append((completion.token_ids, [e.logprob for e in completion.logprobs]))
    assert ours[1][0] != ours[0][0] and ours[2][0] != ours[0][0]  # the adapters matter
    for lora, (tokens, logprobs) in zip(names, ours, strict=True):
        reference = hf_model if lora is None else adapters[lora][1]
        choices, want = _reference(reference, prompt, tokens)
        assert choices == tokens, lora
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want),
                                   atol=1e-3, rtol=0)
