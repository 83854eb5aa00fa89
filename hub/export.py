"""`fleetrl hub export`: a published version as a Hugging Face model folder (DESIGN.md §11, model out).

    fleetrl hub export --version 40 --out ./my-model --max-shard-size 5GB
    fleetrl hub export --version 40 --out ./my-adapter            # a LoRA run: the adapter, for peft
    fleetrl hub export --version 40 --out ./my-model --merged     # a LoRA run: merged into its base

A version of full weights becomes what `AutoModelForCausalLM.from_pretrained` (and vLLM) load: the
base model's `config.json` and `generation_config.json`, the tokenizer with its chat template, and the
weights as safetensors shards with an index, in the base model's dtype (the `dtype` of `model.path`'s
config; `model.publish_dtype` for the tiny model built from config). A LoRA adapter version becomes a
peft adapter folder (`PeftModel.from_pretrained(base, folder)` loads it; its base is the version its
manifest names, exported the same way), or with `merged` a full folder: the base version with the
adapter merged by peft (`merge_and_unload`, in fp32), then cast to the base dtype. The version's
tensors are checked (signature, hashes) as any materialize does, and written into a temporary folder
that is renamed into place at the end, so a failed export leaves no half-written folder behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

from fleetrl.config import FleetConfig
from fleetrl.hub.errors import HubError
from fleetrl.hub.hub import Hub
from fleetrl.hub.peft_folder import save_peft_adapter

_DTYPES = ("float32", "bfloat16", "float16")


def base_dtype(config: FleetConfig) -> str:
    """The dtype the base model folder was saved in (`dtype`, or `torch_dtype` in older folders)."""
    path = config.model.path
    if path is None:
        return config.model.publish_dtype
    cfg = json.loads((pathlib.Path(path) / "config.json").read_text())
    found = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return str(found) if found in _DTYPES else "float32"


def export_version(hub: Hub, config: FleetConfig, version: int, out: str | os.PathLike[str],
                   max_shard_size: str = "5GB", merged: bool = False) -> dict[str, Any]:
    """Write `version` at `out` (which must not exist): a Hugging Face folder, or for a LoRA adapter
    version a peft adapter folder (with `merged`: a Hugging Face folder of the merged weights).
    Returns a summary."""
    target = pathlib.Path(out)
    if target.exists():
        raise HubError(f"{target} already exists; export writes a new folder")
    adapter = hub.manifest(version).adapter
    with _staged(target) as tmp:
        if adapter is not None and not merged:
            info, tensors = hub.materialize_adapter(version, adapter.base)
            save_peft_adapter(tmp, info, tensors, base_model=_base_name(config))
            _stamp(tmp, config, version, base=adapter.base, kind="peft_adapter")
            return {"version": version, "out": str(target), "kind": "peft_adapter", "base": adapter.base,
                    "modules": len(tensors) // 2, "r": info.r}
        summary = _write_model(hub, config, version, tmp, max_shard_size)
        _stamp(tmp, config, version, base=None if adapter is None else adapter.base,
               kind="model" if adapter is None else "merged")
    shards = sorted(p.name for p in target.glob("*.safetensors"))
    return {"version": version, "out": str(target), "kind": "model" if adapter is None else "merged",
            "shards": len(shards), **summary}


def _write_model(hub: Hub, config: FleetConfig, version: int, folder: pathlib.Path,
                 max_shard_size: str) -> dict[str, Any]:
    """The full weights of `version` (an adapter merged into its base) as a Hugging Face folder."""
    import torch

    dtype = base_dtype(config)
    model = config.model.build()
    adapter = hub.manifest(version).adapter
    _load(model, hub.materialize(version if adapter is None else adapter.base), version)
    if adapter is not None:
        model = _merge(model, hub, version, adapter.base, folder)
    model = model.to(getattr(torch, dtype))
    model.config.dtype = getattr(torch, dtype)
    model.save_pretrained(str(folder), max_shard_size=max_shard_size)
    return {"dtype": dtype, "tokenizer": _save_tokenizer(config, folder)}


def _merge(model: Any, hub: Hub, version: int, base: int, scratch: pathlib.Path) -> Any:
    """`model` (holding the base version) with adapter `version` merged in by peft, in fp32."""
    from peft import PeftModel

    info, tensors = hub.materialize_adapter(version, base)
    with tempfile.TemporaryDirectory(dir=scratch.parent, prefix=".adapter-") as folder, \
            warnings.catch_warnings():
        # peft 0.21 asks transformers 5 `is_gradient_checkpointing`, which warns that it was renamed.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        save_peft_adapter(folder, info, {k: v.float() for k, v in tensors.items()})
        return PeftModel.from_pretrained(model.float(), folder).merge_and_unload()


@contextlib.contextmanager
def _staged(target: pathlib.Path) -> Iterator[pathlib.Path]:
    """A temporary folder next to `target`, renamed to it when the block succeeds, removed otherwise."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _stamp(folder: pathlib.Path, config: FleetConfig, version: int, base: int | None, kind: str) -> None:
    stamp: dict[str, Any] = {"run": config.run, "version": version, "kind": kind}
    if base is not None:
        stamp["base_version"] = base
    (folder / "fleetrl_export.json").write_text(json.dumps(stamp) + "\n")


def _base_name(config: FleetConfig) -> str | None:
    """What the adapter config names as its base: the model folder, when the base came from one."""
    return str(pathlib.Path(config.model.path).resolve()) if config.model.path is not None else None


def _load(model: Any, state: dict[str, Any], version: int) -> None:
    """Copy the version's tensors into the model; tied aliases (stored once) follow their source."""
    import torch

    params = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    covered: set[int] = set()
    with torch.no_grad():
        for name, tensor in state.items():
            param = params.get(name)
            if param is None or tuple(param.shape) != tuple(tensor.shape):
                raise HubError(f"version {version}: tensor {name!r} does not fit the configured model "
                               f"(model.path / model.tiny): was it published by another run?")
            param.copy_(tensor)
            covered.add(id(param))
    missing = [n for n, p in model.named_parameters() if id(p) not in covered]
    if missing:
        raise HubError(f"version {version} lacks {len(missing)} parameter(s) of the model, first {missing[0]!r}")


def _save_tokenizer(config: FleetConfig, folder: pathlib.Path) -> str | None:
    source = config.model.tokenizer_source
    if source == "char":
        return None  # the character tokenizer lives in code, not in a folder
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(source, local_files_only=True).save_pretrained(str(folder))
    return source
