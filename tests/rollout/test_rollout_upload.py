"""One packed upload of a version's changes (rollout/_upload.py): the weights are bit for bit what the
tensor-by-tensor scatter wrote, with int32 positions, and nothing is pinned on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fleetrl.rollout import _upload
from fleetrl.rollout._upload import ChangeUploader, position_dtype

torch.set_num_threads(1)


def _params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(33, 17, generator=g), torch.randn(5, generator=g).to(torch.bfloat16),
            torch.randn(64, 3, generator=g).to(torch.float16), torch.randn(7, generator=g)]


def _changes(params: list[torch.Tensor], seed: int) -> list[tuple[np.ndarray, torch.Tensor]]:
    """Sorted distinct positions (some tensors none, one every element) and bf16 values, as the hub gives them."""
    rng = np.random.default_rng(seed)
    out = []
    for i, p in enumerate(params):
        n = p.numel()
        k = [n // 3, n, 0, 1][i]
        pos = np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64)
        out.append((pos, torch.from_numpy(rng.standard_normal(k).astype(np.float32)).to(torch.bfloat16)))
    return out


def _old_path(params: list[torch.Tensor], changes: list[tuple[np.ndarray, torch.Tensor]]) -> None:
    """The engine's scatter before issue 50: int64 positions and values copied tensor by tensor."""
    for p, (pos, values) in zip(params, changes, strict=True):
        p.view(-1).index_copy_(0, torch.from_numpy(pos), values.to(p.dtype))


@pytest.mark.parametrize("int32_limit", [2**31 - 1, 40])
def test_a_packed_upload_writes_what_the_tensor_by_tensor_scatter_wrote(monkeypatch: pytest.MonkeyPatch,
                                                                         int32_limit: int) -> None:
    # With a limit of 40 elements the 33 x 17 and 64 x 3 tensors take the int64 fallback, the others int32.
    monkeypatch.setattr(_upload, "_INT32_MAX_ELEMENTS", int32_limit)
    want, got = _params(), _params()
    uploader = ChangeUploader(torch.device("cpu"))
    for seed in (1, 2):  # the second version reuses (and grows) the buffer
        changes = _changes(want, seed)
        _old_path(want, changes)
        uploader.scatter([(p.view(-1), pos, values) for p, (pos, values) in zip(got, changes, strict=True)])
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
    assert uploader._host is not None and not uploader._host.is_pinned()
    uploader.scatter([])  # nothing changed: nothing to copy


def test_positions_are_int32_below_two_to_the_31_elements() -> None:
    assert position_dtype(151936 * 896) == torch.int32
    assert position_dtype(2**31 - 1) == torch.int32
    assert position_dtype(2**31) == torch.int64
