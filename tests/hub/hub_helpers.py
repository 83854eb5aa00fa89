"""Helpers shared by the hub tests (imported by name: tests/ folders are not packages)."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from slowdown import scaled

from fleetrl.config import FleetConfig

HUB_KEY = "91f33291cf53510db43db8cc986edda4d4f927324729f2e6c7cc2e114eec40c9"
"""Ed25519 private key (hex) of the hub tests (the default scheme); also a valid HMAC secret."""


def make_config(run: str, stores: dict[str, str], *, anchor_interval: int = 5, s3_endpoint: str | None = None,
                link_costs: dict[str, dict[str, float]] | None = None, **hub: Any) -> FleetConfig:
    """A config whose `home` and regions use the given store URLs (`s3://` ones on `s3_endpoint`)."""

    def store(url: str) -> dict[str, Any]:
        return {"url": url, "endpoint_url": s3_endpoint, "region_name": "us-east-1"} if url.startswith("s3://") \
            else {"url": url}

    regions = [
        {"name": name, "kafka": "127.0.0.1:9", "store": store(url), "link_costs": (link_costs or {}).get(name, {})}
        for name, url in stores.items() if name != "home"
    ] or [{"name": "r1", "kafka": "127.0.0.1:9", "store": {"url": stores["home"] + "-r1"}}]
    return FleetConfig.model_validate({
        "run": run,
        "hub": {"home_store": store(stores["home"]), "anchor_interval": anchor_interval, "threads": 2,
                "frame_bytes": 64 * 1024, **hub},
        "regions": regions,
    })


def tiny_state(seed: int = 0, hidden: int = 64) -> dict[str, torch.Tensor]:
    """A small bf16 state dict shaped like a transformer's, with a tied embedding."""
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(96, hidden, generator=g) * 0.02
    sd = {
        "model.embed_tokens.weight": emb,
        "model.layers.0.self_attn.q_proj.weight": torch.randn(hidden, hidden, generator=g) * 0.02,
        "model.layers.0.self_attn.q_proj.bias": torch.zeros(hidden),
        "model.layers.0.mlp.up_proj.weight": torch.randn(2 * hidden, hidden, generator=g) * 0.02,
        "model.layers.0.input_layernorm.weight": torch.ones(hidden),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": emb,
    }
    return {k: v.to(torch.bfloat16) for k, v in sd.items()}


def step(state: dict[str, torch.Tensor], seed: int, frac: float = 0.03) -> dict[str, torch.Tensor]:
    """A new version: a random `frac` of each tensor's bf16 elements moves by one ulp (ties kept)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name == "lm_head.weight":
            continue
        bits = t.view(torch.int16).clone()
        mask = torch.rand(bits.shape, generator=g) < frac
        sign = torch.where(torch.rand(bits.shape, generator=g) < 0.5, 1, -1).to(torch.int16)
        out[name] = torch.where(mask, bits + sign, bits).view(torch.bfloat16)
    out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


def hub_env() -> dict[str, str]:
    return {**os.environ, "FLEETRL_HUB_KEY": HUB_KEY}


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.1) -> None:
    """Poll `condition` until it holds; fail naming `what` after `timeout_s` (the reference machine's
    figure, scaled by the machine's slowdown)."""
    timeout_s = scaled(timeout_s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


class ReplicatorDaemon:
    """One `fleetrl replicator --region R` process, its JSON log in `log_file`; stopped (or killed) by the
    test that started it, by its pid."""

    def __init__(self, config_file: pathlib.Path, region: str, log_file: pathlib.Path,
                 env: dict[str, str] | None = None) -> None:
        env = {**os.environ, "FLEETRL_HUB_KEY": HUB_KEY, "OMP_NUM_THREADS": "1", **(env or {})}
        self.log_file = log_file
        self._out = open(log_file, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleetrl.cli", "replicator", "--config", str(config_file), "--region", region,
             "--log-json"], env=env, stdout=subprocess.DEVNULL, stderr=self._out)

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        """The JSON events logged so far (only those called `name`, when given)."""
        lines = self.log_file.read_text().splitlines()
        events = [json.loads(line) for line in lines if line.startswith("{")]
        return [e for e in events if name is None or e.get("event") == name]

    def kill(self) -> None:
        """SIGKILL: what a preempted or crashed node's replicator gets (its lease is left to expire)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=scaled(10))
        self._out.close()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=scaled(20))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(timeout=scaled(10))
        self._out.close()
        return code


def three_stores(kind: str, run: str, tmp_path: pathlib.Path, request: Any, anchor_interval: int) -> FleetConfig:
    """Stores `home`, `near`, `far` as directories or in the moto bucket (`kind`); `far` is expensive to
    reach from home but close to `near`: it should copy from `near`."""
    if kind == "s3":
        bucket = request.getfixturevalue("s3_bucket")
        urls = {n: f"s3://{bucket}/{n}" for n in ("home", "near", "far")}
        endpoint = request.getfixturevalue("s3_endpoint")
    else:
        urls, endpoint = {n: (tmp_path / n).as_uri() for n in ("home", "near", "far")}, None
    costs: dict[str, dict[str, float]] = {"near": {"home": 1, "far": 5}, "far": {"home": 10, "near": 1}}
    return make_config(run, urls, s3_endpoint=endpoint, link_costs=costs, anchor_interval=anchor_interval)
