"""The test paths a change touches, for the inner loop (`make test-changed`).

    python tests/changed.py [BASE]      # BASE: a git ref, default main

Prints the test files and folders that cover what differs from BASE (committed or not, and new
files): a changed test file itself; the folder of a changed test helper (conftest.py, *_testkit.py);
and the tests of a changed package (broker/ -> tests/broker, fleetrl/demo/ -> tests/demo and
tests/e2e, fleetrl/*.py -> tests/foundation and tests/test_devstack.py, ...). Nothing when nothing
that tests cover changed. `make test-changed` runs them, fast ones only by default.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {
    "broker/": ["tests/broker"],
    "hub/": ["tests/hub"],
    "rollout/": ["tests/rollout", "tests/workloads"],
    "trainer/": ["tests/trainer", "tests/workloads"],
    "regions/": ["tests/regions"],
    "fleetrl/demo/": ["tests/demo", "tests/e2e"],
    "fleetrl/config/": ["tests/foundation", "tests/broker/test_cli_config.py",
                        "tests/workloads/test_workload_config.py"],
    "fleetrl/": ["tests/foundation", "tests/test_devstack.py"],
    "infra/": ["tests/infra"],
    "examples/": ["tests/foundation/test_config.py", "tests/demo", "tests/e2e/test_demo.py"],
    "pyproject.toml": ["tests/foundation"],
}
"""Longest prefix first wins: fleetrl/demo/ before fleetrl/."""


def changed_files(base: str) -> list[str]:
    def git(*args: str) -> list[str]:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return [line for line in out.splitlines() if line]

    merge_base = git("merge-base", "HEAD", base)[0]
    return sorted(set(git("diff", "--name-only", merge_base) + git("ls-files", "--others", "--exclude-standard")))


def covering_paths(files: list[str]) -> list[str]:
    paths: set[str] = set()
    for f in files:
        path = ROOT / f
        if f.startswith("tests/"):
            if path.name.startswith("test_") and path.suffix == ".py":
                paths.add(f)
            elif path.suffix == ".py" and path.parent != ROOT / "tests":
                paths.add(str(path.parent.relative_to(ROOT)))  # a folder's helper: its tests
            continue
        for prefix in sorted(PACKAGES, key=len, reverse=True):
            if f.startswith(prefix):
                paths.update(PACKAGES[prefix])
                break
    kept = sorted(p for p in paths if (ROOT / p).exists())
    return [p for p in kept if not any(p.startswith(f"{q}/") for q in kept)]  # a file inside a listed folder


def main(argv: list[str]) -> int:
    base = argv[0] if argv else "main"
    try:
        files = changed_files(base)
    except (subprocess.CalledProcessError, IndexError) as exc:
        print(f"tests/changed.py: cannot diff against {base!r} ({exc}); pass a git ref", file=sys.stderr)
        return 2
    print(" ".join(covering_paths(files)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
