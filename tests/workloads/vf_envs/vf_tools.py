"""A tool-using verifiers environment: the sums of `vf_single`, with the harness offering a `calculator` tool and
answering twice (its second call sees the tool's result)."""

from __future__ import annotations

from vf_harness import ToolHarness
from vf_single import SumTaskset

__all__ = ["SumTaskset", "ToolHarness"]
