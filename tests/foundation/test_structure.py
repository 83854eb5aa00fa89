"""tools/structure.py, the file half of `make lint`'s structural check (docs/architecture.md).

Each test builds a small tree of the repository's shape in tmp_path and reads the findings: a file
over the line limit, an import circle between files (module level, inside a function, relative, or
under TYPE_CHECKING), and what is not a circle (a package's `__init__.py` re-exporting its modules).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fleetrl_structure", ROOT / "tools" / "structure.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


structure = _load()


def _tree(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for folder in ("fleetrl", "broker", "hub", "rollout", "trainer", "regions", "bench"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_a_clean_tree_has_no_findings(tmp_path: pathlib.Path) -> None:
    root = _tree(tmp_path, {
        "hub/__init__.py": "from fleetrl.hub.codec import encode\nfrom fleetrl.hub.stores import Store\n",
        "hub/codec.py": "def encode() -> None: ...\n",
        "hub/stores.py": "from fleetrl.hub import codec\nfrom . import codec as again\n",
        "broker/producer.py": "import fleetrl.hub.codec\n",
    })
    assert structure.findings(root) == []
    assert structure.main(["structure", str(root)]) == 0


def test_a_file_over_the_limit_is_named(tmp_path: pathlib.Path) -> None:
    limit = structure.MAX_LINES
    root = _tree(tmp_path, {"trainer/big.py": "x = 1\n" * (limit + 1), "trainer/ok.py": "x = 1\n" * limit,
                            "bench/long.py": "x = 1\n" * (limit + 1)})
    assert structure.findings(root) == [
        f"trainer/big.py: {limit + 1} lines (at most {limit}): split it at its seam",
        f"bench/long.py: {limit + 1} lines (at most {limit}): split it at its seam",
    ]


def test_circles_through_functions_relative_imports_and_type_checking(tmp_path: pathlib.Path) -> None:
    root = _tree(tmp_path, {
        # hub: module level one way, inside a function the other.
        "hub/s3.py": "from fleetrl.hub.stores import Store\n",
        "hub/stores.py": "class Store: ...\ndef make() -> None:\n    from fleetrl.hub.s3 import S3\n",
        # config: a relative import and a TYPE_CHECKING one.
        "fleetrl/config/models.py": "from ._factory import build\n",
        "fleetrl/config/_factory.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from fleetrl.config.models import Model\n",
        # bench: bare names, as a bench script imports its neighbours.
        "bench/pipeline.py": "def cost() -> None:\n    import cost_fleet\n",
        "bench/cost_fleet.py": "from pipeline import Fleet\n",
        # three files in one ring.
        "rollout/a.py": "from fleetrl.rollout import b\n",
        "rollout/b.py": "from fleetrl.rollout.c import x\n",
        "rollout/c.py": "import fleetrl.rollout.a\n",
    })
    circles = [line for line in structure.findings(root) if line.startswith("import circle")]
    assert circles == [
        "import circle: bench/cost_fleet.py <-> bench/pipeline.py",
        "import circle: fleetrl/config/_factory.py <-> fleetrl/config/models.py",
        "import circle: hub/s3.py <-> hub/stores.py",
        "import circle: rollout/a.py <-> rollout/b.py <-> rollout/c.py",
    ]
    assert structure.main(["structure", str(root)]) == 1
