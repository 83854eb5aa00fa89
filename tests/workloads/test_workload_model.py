"""Model in and out without brokers: chat rendering equals `apply_chat_template`, fp16 and fp32 single-file
folders (Llama, Qwen3, Mistral, Qwen2) run in the torch engine with the generation config's EOS ids, a bf16
engine computes what `from_pretrained` does, and the tiny model exports as a loadable folder."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
import yaml

from fleetrl.broker import Sampling
from fleetrl.config import FleetConfig, ModelConfig, TorchEngineConfig, parse_config
from fleetrl.demo.hf_inputs import build_model_folder
from fleetrl.hub import Hub
from fleetrl.hub.export import export_version
from fleetrl.rollout.engine import GroupRequest
from fleetrl.rollout.errors import TaskError
from fleetrl.rollout.tokenize import load_codec
from fleetrl.rollout.torch_engine import TorchEngine

CHATS = [
    [{"role": "user", "content": "Say the word red."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write blue a few times."},
     {"role": "assistant", "content": "blue blue"}, {"role": "user", "content": "Again, in gold."}],
]


@pytest.mark.parametrize("messages", CHATS)
def test_rendered_ids_are_apply_chat_templates(qwen2_folder: pathlib.Path, messages: list[dict[str, str]]) -> None:
    from transformers import AutoTokenizer

    codec = load_codec(ModelConfig(path=str(qwen2_folder)))
    tok = AutoTokenizer.from_pretrained(str(qwen2_folder), local_files_only=True)
    ids = codec.render(messages)
    assert ids == tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")  # the generation prompt is there
    with pytest.raises(TaskError, match="no chat template"):
        load_codec(ModelConfig()).render(messages)  # the char tokenizer has none


@pytest.mark.parametrize(("arch", "dtype"), [("llama", "float16"), ("qwen3", "float16"), ("mistral", "float16"),
                                            ("qwen2", "float32")])
def test_single_file_folders_run_with_every_eos_id(tmp_path: pathlib.Path, arch: str, dtype: str) -> None:
    folder = build_model_folder(tmp_path / dtype, arch=arch, dtype=dtype, max_shard_size="50MB")
    assert (folder / "model.safetensors").is_file() and not (folder / "model.safetensors.index.json").exists()
    engine = TorchEngine.from_config(ModelConfig(path=str(folder)), TorchEngineConfig(max_batch=4, dtype=dtype))
    assert engine.eos_ids == frozenset({0, 2})  # generation_config lists <|im_end|> and <|endoftext|>
    codec = load_codec(ModelConfig(path=str(folder)), sorted(engine.eos_ids))
    samples = engine.generate(GroupRequest("g", codec.render(CHATS[0]), Sampling(max_new_tokens=5), 4))
    assert len(samples) == 4 and all(s.finish_reason in ("stop", "length") for s in samples)
    assert all(len(s.completion_ids) == len(s.logprobs) >= 1 for s in samples)


def _tiny_config(tmp: pathlib.Path) -> FleetConfig:
    data: dict[str, Any] = {"run": "tiny", "hub": {"home_store": (tmp / "home").as_uri()},
                            "regions": [{"name": "r1", "kafka": "127.0.0.1:9", "store": (tmp / "r1").as_uri()}]}
    return parse_config(yaml.safe_dump(data), env={})


def test_the_tiny_model_exports_as_a_loadable_folder(tmp_path: pathlib.Path) -> None:
    from transformers import AutoModelForCausalLM

    config = _tiny_config(tmp_path)
    state = {k: v.to(torch.bfloat16) for k, v in config.model.build().state_dict().items()}
    with Hub.from_config(config) as hub:
        version = hub.publish(state).version
        summary = export_version(hub, config, version, tmp_path / "out", max_shard_size="50KB")
        with pytest.raises(Exception, match="already exists"):
            export_version(hub, config, version, tmp_path / "out")
    assert summary["dtype"] == "bfloat16" and summary["shards"] > 1 and summary["tokenizer"] is None
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in state.items())


def test_a_bf16_engine_computes_what_from_pretrained_does(qwen2_folder: pathlib.Path) -> None:
    """The engine casts the fp32 masters to bf16 but keeps RoPE's frequencies in fp32, as transformers
    loads a bf16 checkpoint: the same logits, bit for bit (a cast `inv_freq` is off by ~4e-3)."""
    from transformers import AutoModelForCausalLM

    engine = TorchEngine.from_config(ModelConfig(path=str(qwen2_folder)), TorchEngineConfig(dtype="bfloat16"))
    loaded = AutoModelForCausalLM.from_pretrained(str(qwen2_folder), local_files_only=True).eval()
    assert loaded.dtype == torch.bfloat16
    ids = torch.tensor([load_codec(ModelConfig(path=str(qwen2_folder))).render(CHATS[1])])
    with torch.no_grad():
        assert torch.equal(engine.model(input_ids=ids).logits, loaded(input_ids=ids).logits)
