"""A harness whose own bug ends every episode with an error (`agent: {harness: {id: vf_failing}}`)."""

from __future__ import annotations

import verifiers.v1 as vf

__all__ = ["FailingHarness"]


class FailingHarness(vf.Harness[vf.HarnessConfig]):
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, *args: object, **kwargs: object) -> vf.ProgramResult:
        raise KeyError("the harness's own bug")
