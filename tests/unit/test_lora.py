"""LoRA adapters over one base model (engine/lora/): PEFT folders load, and the model
with an adapter's slot on its rows scores as `peft`'s merged model does in float32; rows
of different adapters and of none share one op; slots are evicted least recently used,
never while a request holds them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import peft
import pytest
import torch
import transformers

from tests.unit.test_model_parity import _randomize
from tokenyard.engine.attention_backend import CausalAttention
from tokenyard.engine.lora.adapter import AdapterError, load_adapter
from tokenyard.engine.lora.bank import LoraBank, SlotsFull
from tokenyard.engine.models.hf_loader import read_hf_config
from tokenyard.engine.models.llama import LlamaForCausalLM

TINY: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

#: name -> LoraConfig kwargs: q/v only (the PEFT default for Llama), and every projection
#: with rsLoRA's scale.
ADAPTERS: dict[str, dict[str, Any]] = {
    "qv": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "all": {"r": 8, "lora_alpha": 16, "use_rslora": True,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                               "up_proj", "down_proj"]},
}


def _base() -> Any:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    _randomize(model)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = _base()
    base.save_pretrained(root / "base")
    out = {"base": root / "base"}
    for i, (name, kwargs) in enumerate(ADAPTERS.items()):
        torch.manual_seed(10 + i)
        # init_lora_weights=False: B random too, so the adapter changes the output.
        tuned = peft.get_peft_model(_base(), peft.LoraConfig(init_lora_weights=False, **kwargs))
        tuned.save_pretrained(root / name)
        out[name] = root / name
    return out


def _ours(folders: dict[str, Path]) -> LlamaForCausalLM:
    model = LlamaForCausalLM(read_hf_config(folders["base"])).eval()
    model.load_weights(_base().state_dict().items())
    return model


def _merged(folders: dict[str, Path], name: str) -> Any:
    tuned = peft.PeftModel.from_pretrained(_base(), str(folders[name]))
    return tuned.merge_and_unload().eval()


IDS = [1, 17, 33, 5, 99, 64, 2, 81, 40, 12, 7]


def _scores(model: LlamaForCausalLM) -> torch.Tensor:
    ids = torch.tensor(IDS)
    hidden = model(ids, torch.arange(len(IDS)), CausalAttention())
    return torch.log_softmax(model.compute_logits(hidden), dim=-1)


def test_each_adapter_scores_as_peft_merged_in_float32(folders: dict[str, Path]) -> None:
    model = _ours(folders)
    bank = LoraBank(model, max_loras=2, max_rank=8, device=torch.device("cpu"))
    slots = {name: bank.load(load_adapter(folders[name], name)) for name in ADAPTERS}
    plain = _scores(model)
    with torch.no_grad():
        ref = torch.log_softmax(_base()(torch.tensor([IDS])).logits[0], dim=-1)
    torch.testing.assert_close(plain, ref, atol=1e-3, rtol=0)
    for name, slot in slots.items():
        bank.rows.set(torch.full((len(IDS),), slot))
        got = _scores(model)
        bank.rows.set(None)
        with torch.no_grad():
            want = torch.log_softmax(_merged(folders, name)(torch.tensor([IDS])).logits[0], -1)
        assert (got - plain).abs().max() > 1e-2, f"{name}: the adapter changes nothing"
        torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def test_rows_of_different_adapters_share_one_op(folders: dict[str, Path]) -> None:
    model = _ours(folders)
    bank = LoraBank(model, max_loras=2, max_rank=8, device=torch.device("cpu"))
    for name in ADAPTERS:
        bank.load(load_adapter(folders[name], name))
    weights = model.layers[0].qkv_proj.lora
    assert weights is not None
    x = torch.randn(5, 64)
    mixed = torch.tensor([0, 1, 2, 1, 0])
    bank.rows.set(mixed)
    together = weights.delta(x)
    for row, slot in enumerate(mixed.tolist()):
        bank.rows.set(torch.tensor([slot]))
        alone = weights.delta(x[row:row + 1])
        torch.testing.assert_close(together[row:row + 1], alone)
    assert together[0].abs().max() == 0 and together[4].abs().max() == 0


def test_slots_are_evicted_lru_but_never_in_use(folders: dict[str, Path]) -> None:
    model = _ours(folders)
    bank = LoraBank(model, max_loras=1, max_rank=8, device=torch.device("cpu"))
    qv, every = (load_adapter(folders[n], n) for n in ADAPTERS)
    slot = bank.load(qv)
    assert bank.load(qv) == slot and bank.num_loads == 1
    bank.acquire(slot)
    with pytest.raises(SlotsFull):
        bank.load(every)
    bank.release(slot)
    assert bank.load(every) == slot and bank.resident == ["all"]
    # The q/v adapter left k, o and the MLP alone: reloading it clears what "all" wrote.
    assert bank.load(qv) == slot
    down = model.layers[0].down_proj.lora
    assert down is not None and down.a.abs().max() == 0


@pytest.mark.parametrize("change, message", [
    ({"use_dora": True}, "DoRA"),
    ({"bias": "all"}, "biases"),
    ({"peft_type": "PREFIX_TUNING"}, "only LORA"),
    ({"r": 64}, "max_lora_rank"),
])
def test_adapters_the_engine_cannot_apply_exactly_are_refused(
        folders: dict[str, Path], tmp_path: Path, change: dict[str, Any], message: str) -> None:
    folder = tmp_path / "bad"
    folder.mkdir()
    config = json.loads((folders["qv"] / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **change}))
    (folder / "adapter_model.safetensors").write_bytes(
        (folders["qv"] / "adapter_model.safetensors").read_bytes())
    with pytest.raises(AdapterError, match=message):
        load_adapter(folder, "bad", max_rank=8)
