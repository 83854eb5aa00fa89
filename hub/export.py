"""`fleetrl hub export`: a published version as a Hugging Face model folder (DESIGN.md §11, model out).

    fleetrl hub export --version 40 --out ./my-model --max-shard-size 5GB

The folder holds what `AutoModelForCausalLM.from_pretrained` (and vLLM) load: the base model's
`config.json` and `generation_config.json`, the tokenizer with its chat template, and the weights as
safetensors shards with an index, in the base model's dtype (the `dtype` of `model.path`'s config;
`model.publish_dtype` for the tiny model built from config). The version's tensors are checked
(signature, hashes) as any materialize does, cast once from the published dtype to the base dtype,
and written into a temporary folder that is renamed into place at the end, so a failed export
leaves no half-written folder behind.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
from typing import Any

from fleetrl.config import FleetConfig
from fleetrl.hub.errors import HubError
from fleetrl.hub.hub import Hub

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
                   max_shard_size: str = "5GB") -> dict[str, Any]:
    """Write `version` as a Hugging Face folder at `out` (which must not exist); returns a summary."""
    import torch

    target = pathlib.Path(out)
    if target.exists():
        raise HubError(f"{target} already exists; export writes a new folder")
    dtype = base_dtype(config)
    model = config.model.build()
    _load(model, hub.materialize(version), version)
    model = model.to(getattr(torch, dtype))
    model.config.dtype = getattr(torch, dtype)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
    try:
        model.save_pretrained(str(tmp), max_shard_size=max_shard_size)
        tokenizer = _save_tokenizer(config, tmp)
        (tmp / "fleetrl_export.json").write_text(json.dumps({"run": config.run, "version": version}) + "\n")
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    shards = sorted(p.name for p in target.glob("*.safetensors"))
    return {"version": version, "out": str(target), "dtype": dtype, "shards": len(shards), "tokenizer": tokenizer}


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
