"""Two ranks (FSDP2 over gloo, torchrun) train to the same parameters as one process; sharded
checkpoints (each rank writes its own shards) resume exactly; a sharded publish (each rank encodes
the tensors it owns, rank 0 writes the manifest) matches a single-process publish bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from slowdown import scaled
from trainer_groups import HUB_KEY

from fleetrl.config import FleetConfig
from fleetrl.hub import Hub, Manifest
from fleetrl.trainer.checkpoint import latest

WORKER = Path(__file__).parent / "dist_equivalence_worker.py"
PUBLISH_WORKER = Path(__file__).parent / "sharded_publish_worker.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
PARAM_ATOL = 1e-4
"""Parameters start at ~0.02 and move ~0.03 in 3 AdamW steps at lr 1e-2; the two runs differ only
in the order gradients are summed (per-rank partial sums, then gloo's reduce-scatter), which
measures ~2e-5 here. A wrong loss scale or a lost shard moves them by far more (and shows in the
pre-clip gradient norm, compared at 1e-4 relative)."""


def _run(cmd: list[str], tmp: Path, *extra: str) -> dict[str, object]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = tmp / "out.pt"
    proc = subprocess.run([*cmd, str(WORKER), "--out", str(out), "--steps", "3", *extra], env=env, cwd=tmp,
                          capture_output=True, text=True, timeout=scaled(180))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, object] = torch.load(out)
    return result


@pytest.mark.slow
def test_two_ranks_match_one_process(tmp_path: Path) -> None:
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = _run([sys.executable], tmp_path / "one")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    two = _run(torchrun, tmp_path / "two")
    p1, p2 = one["params"], two["params"]
    assert isinstance(p1, dict) and isinstance(p2, dict)
    assert p1.keys() == p2.keys()
    initial = _initial_params()
    moved = max((p1[k] - initial[k]).abs().max().item() for k in p1)
    assert moved > 10 * PARAM_ATOL  # the steps really changed the weights
    for k in p1:
        torch.testing.assert_close(p2[k], p1[k], atol=PARAM_ATOL, rtol=0, msg=lambda m, k=k: f"{k}: {m}")
    torch.testing.assert_close(torch.tensor(two["stats"]), torch.tensor(one["stats"]), rtol=1e-4, atol=1e-6)
    # Resumed from the sharded checkpoint, the second half's steps give the same bits again.
    for run in (one, two):
        resumed, params = run["resumed"], run["params"]
        assert isinstance(resumed, dict) and isinstance(params, dict) and resumed.keys() == params.keys()
        for k in params:
            assert torch.equal(resumed[k], params[k]), k
    # One shard file per rank, next to the metadata; the two-rank checkpoint reads back in one process.
    assert [f for f in two["shard_files"] if f.endswith(".distcp")] == ["__0_0.distcp", "__1_0.distcp"]
    assert [f for f in one["shard_files"] if f.endswith(".distcp")] == ["__0_0.distcp"]
    sharded = latest(tmp_path / "two" / "ckpt")
    assert sharded is not None and sharded.shards is not None
    model, optimizer = sharded.weights()
    assert model.keys() == p1.keys() and optimizer["state"]


@pytest.mark.slow
def test_two_ranks_match_one_process_with_two_ppo_epochs(tmp_path: Path) -> None:
    """Two updates per step: the old logprobs (one no-grad pass on every rank, padded alike) and the
    step-wide totals of each update add up across ranks as in one process."""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = _run([sys.executable], tmp_path / "one", "--ppo-epochs", "2")
    two = _run(TORCHRUN, tmp_path / "two", "--ppo-epochs", "2")
    p1, p2 = one["params"], two["params"]
    assert isinstance(p1, dict) and isinstance(p2, dict) and p1.keys() == p2.keys()
    for k in p1:
        torch.testing.assert_close(p2[k], p1[k], atol=PARAM_ATOL, rtol=0, msg=lambda m, k=k: f"{k}: {m}")
    stats1, stats2 = torch.tensor(one["stats"]), torch.tensor(two["stats"])
    torch.testing.assert_close(stats2, stats1, rtol=1e-3, atol=1e-6)
    assert (stats1[:, 4] > 0).all()  # approx KL: the second update's ratio is not 1


def _initial_params() -> dict[str, torch.Tensor]:
    from fleetrl.config import ModelConfig

    return {k: v.detach() for k, v in ModelConfig().build().state_dict().items()}


def _tensors(m: Manifest) -> list[tuple[object, ...]]:
    """Each tensor as readers see it: the parts' bytes (sha256), ranges and digests, not where they
    are packed (each rank packs its own objects)."""
    return [(t.name, t.dtype, t.shape, t.sha256, t.encoding, t.tied_to,
             [(p.sha256, p.length, p.start, p.stop, p.changed_digest) for p in t.parts],
             None if t.delta is None else [(p.sha256, p.start, p.stop) for p in t.delta]) for t in m.tensors]


@pytest.mark.slow
def test_sharded_publish_matches_one_process_publish(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "FLEETRL_HUB_KEY": HUB_KEY}
    for name, launcher in (("one", [sys.executable]), ("two", TORCHRUN)):
        out = tmp_path / name
        out.mkdir()
        proc = subprocess.run([*launcher, str(PUBLISH_WORKER), "--out", str(out)], env=env, cwd=out,
                              capture_output=True, text=True, timeout=scaled(180))
        assert proc.returncode == 0, proc.stderr[-3000:]
        configs = [FleetConfig.model_validate({"run": "sharded", "hub": {"home_store": (out / s).as_uri()},
                                               "regions": [{"name": "r1", "kafka": "127.0.0.1:9",
                                                            "store": str(out / "r1")}]})
                   for s in ("sharded", "single")]
        with Hub.from_config(configs[0]) as sharded, Hub.from_config(configs[1]) as single:
            assert sharded.versions() == single.versions() == [0, 1, 2]
            for v in (0, 1, 2):
                ms, m1 = sharded.manifest(v), single.manifest(v)
                assert (ms.parent, ms.anchor) == (m1.parent, m1.anchor) == (v - 1 if v else None, 0)
                assert _tensors(ms) == _tensors(m1), (name, v)
                a, b = sharded.materialize(v), single.materialize(v)
                assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16))
                                                    for k in a)
            if name == "two":  # both ranks uploaded parts: the anchor's parts live in objects of each rank
                assert len(sharded.manifest(0).objects) >= 2
