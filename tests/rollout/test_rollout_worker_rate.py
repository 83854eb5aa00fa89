"""The worker reports its recent decoding rate, not its lifetime mean (region credits read it)."""

from __future__ import annotations

import pathlib

import pytest

from fleetrl.config import parse_config
from fleetrl.rollout import RolloutWorker, TorchEngine


def test_rate_covers_the_recent_window(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fleetrl.rollout.worker as worker_mod

    clock = [1000.0]
    monkeypatch.setattr(worker_mod.time, "monotonic", lambda: clock[0])
    config = parse_config("run: rate\nregions:\n  - name: r1\n    kafka: 127.0.0.1:9\n    store: ./s\n",
                          base_dir=tmp_path, env={})
    engine = TorchEngine.from_config(config.model, config.regions[0].engine)
    worker = RolloutWorker(config, "r1", "n1", engine=engine)
    try:
        # busy for a minute at 100 tokens/s ...
        for _ in range(6):
            clock[0] += 10
            engine.tokens_sampled += 1000
            assert worker.stats()["tokens_per_s"] == pytest.approx(100.0)
        # ... then idle (drained) for a minute: the lifetime mean would still say ~50 tokens/s
        for _ in range(6):
            clock[0] += 10
            worker.stats()
        assert worker.stats()["tokens_per_s"] == 0.0
        # and busy again: the rate recovers within the window, without waiting for the lifetime mean
        clock[0] += 10
        engine.tokens_sampled += 2000
        assert worker.stats()["tokens_per_s"] >= 2000 / worker_mod.RATE_WINDOW_S * 0.9
    finally:
        worker.hub.close()
