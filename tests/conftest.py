"""Shared fixtures: real servers on free loopback ports, stopped by the fixture that started them.

`tansu`, `mqtt_server` and `moto_server` are shared by every test of a pytest process (one per
xdist worker): tests only use them, each with names of its own (`run_id` for topics, groups and
MQTT paths, `s3_bucket` for buckets), so they never see each other's records. Tests that kill,
restart, cut or reconfigure a server (TLS, authentication, durable storage) start their own with
the factories in `fleetrl.devstack`.

How the suite runs side by side (`make test`: pytest-xdist, `--dist loadgroup`) is in
tests/README.md; the grouping and ordering rules are the hooks at the end of this file.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator

import fleet_slots
import pytest
import slowdown

from fleetrl import devstack

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# boto3 must never look for real credentials or reach AWS from a test.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "fleetrl")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "fleetrl")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


@pytest.fixture
def run_id() -> str:
    """A run id unique to the test: topics, MQTT paths and store keys never collide."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def tansu() -> Iterator[devstack.ServerProcess]:
    """A tansu broker (memory storage) shared by this process's tests; `.port` is its Kafka port on
    127.0.0.1. Use it with names of your own (`run_id`); never stop or restart it."""
    with devstack.tansu() as server:
        yield server


@pytest.fixture(scope="session")
def tansu_bootstrap(tansu: devstack.ServerProcess) -> str:
    return f"127.0.0.1:{tansu.port}"


@pytest.fixture(scope="session")
def mqtt_server() -> Iterator[devstack.ServerProcess]:
    """An MQTT broker shared by this process's tests (mosquitto where installed, else amqtt): topics
    under `fleetrl/<run_id>/` only; never stop or restart it."""
    with devstack.mqtt_broker() as server:
        yield server


@pytest.fixture(scope="session")
def moto_server() -> Iterator[devstack.ServerProcess]:
    """moto's S3 server mode shared by this process's tests; `.port` on 127.0.0.1, reached over real
    HTTP with boto3. Use a bucket of your own (`s3_bucket`)."""
    with devstack.moto_s3() as server:
        yield server


@pytest.fixture(scope="session")
def s3_endpoint(moto_server: devstack.ServerProcess) -> str:
    return f"http://127.0.0.1:{moto_server.port}"


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A fresh bucket on the moto server; returns its name."""
    import boto3

    name = f"b-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


# -- running side by side (pytest-xdist) ---------------------------------------------------------------

SHARED_PER_PROCESS = {"tansu", "tansu_bootstrap", "mqtt_server", "moto_server", "s3_endpoint",
                      "terraform", "plugin_dir", "tf_copy", "qwen2_folder", "llama_folder"}
"""The suite's fixtures wider than a test that each xdist worker may build for itself: a server per
worker, cheap folders. Any other module-, class- or session-scoped fixture of the suite is setup its
tests share (a demo run the module's tests read, a PKI, a terraform apply): its tests go to one worker
(below). Plugins' fixtures (pytest's, pytest-asyncio's) are not the suite's and group nothing."""


def _shared_setup(item: pytest.Item) -> str | None:
    """The group of a test that shares wider-than-a-test setup with others (None: it shares none)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    shared = sorted(name for name, defs in info.name2fixturedefs.items()  # the suite's own (a plugin's: baseid "")
                    if name not in SHARED_PER_PROCESS and defs and defs[-1].scope != "function" and defs[-1].baseid)
    if not shared:
        return None
    scope = info.name2fixturedefs[shared[0]][-1].scope
    return item.nodeid.split("::")[0] if scope in ("module", "class") else f"session-{shared[0]}"


def _unit_of(item: pytest.Item) -> str:
    """What xdist hands a worker at once: the test's group, or the test alone."""
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return item.nodeid
    return f"@{mark.args[0] if mark.args else mark.kwargs.get('name', 'default')}"


def _weight(item: pytest.Item) -> int:
    """How early a test should start: the long demo runs first, so that the short tests fill the
    workers around them instead of leaving one worker alone with a long run at the end."""
    marks = {m.name for m in item.iter_markers()}
    return 3 * ("e2e" in marks) + 2 * ("slow" in marks) + ("integration" in marks)


def _spread_fleets(units: list[str], fleet_units: set[str], slots: int, workers: int) -> list[str]:
    """`units` (heaviest first), reordered only when there are fewer fleet slots than workers: then each
    round of `workers` units holds `slots` that start a whole fleet and `workers - slots` others, so that
    a worker that would wait for a slot (`pytest_runtest_protocol` below) mostly has other work instead.
    With a slot for every worker nothing waits, and the heaviest stay first (no long run left at the
    end)."""
    if slots >= workers:
        return units
    fleets = [u for u in units if u in fleet_units]
    others = [u for u in units if u not in fleet_units]
    out: list[str] = []
    while fleets or others:
        out += fleets[:slots] + others[:workers - slots]
        fleets, others = fleets[slots:], others[workers - slots:]
    return out


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test's pytest-timeout bound scaled by the machine's slowdown (tests/slowdown.py). Under xdist
    (`-n`) also: group the tests that share setup (an explicit `xdist_group` mark wins), start the
    heaviest groups first and spread the ones that start a whole fleet. Without xdist the order stays the
    file order."""
    _scale_timeouts(config, items)
    if not hasattr(config, "workerinput"):
        return
    for item in items:
        if item.get_closest_marker("xdist_group") is None and (group := _shared_setup(item)) is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    heaviest: dict[str, int] = {}
    for item in items:
        unit = _unit_of(item)
        heaviest[unit] = max(heaviest.get(unit, 0), _weight(item))
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-heaviest[_unit_of(item)], order[id(item)]))
    units = list(dict.fromkeys(_unit_of(item) for item in items))
    fleet_units = {_unit_of(item) for item in items if _starts_a_fleet(item)}
    workers = int(config.workerinput.get("workercount", 1))
    spread = _spread_fleets(units, fleet_units, slowdown.fleet_slots(), workers)
    rank = {unit: i for i, unit in enumerate(spread)}
    items.sort(key=lambda item: (rank[_unit_of(item)], order[id(item)]))


# -- a machine slower than the reference (tests/slowdown.py) ------------------------------------------------

def pytest_configure(config: pytest.Config) -> None:
    """The process that starts the others measures the machine once; workers and subprocesses inherit the
    factor through the environment (FLEETRL_TEST_SLOWDOWN), and the fleet slots' lock folder likewise."""
    if hasattr(config, "workerinput"):
        return
    slowdown.ensure_factor()
    if not os.environ.get(fleet_slots.SLOTS_ENV):
        os.environ[fleet_slots.SLOTS_ENV] = folder = tempfile.mkdtemp(prefix="fleetrl-fleet-slots-")
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))


def pytest_report_header(config: pytest.Config) -> str:
    how = "measured" if os.environ.get(slowdown.MEASURED_ENV) == "1" else f"set by {slowdown.ENV}"
    return (f"fleetrl: machine slowdown {slowdown.factor():.2f}x the reference ({how}); every deadline "
            f"is scaled by it; {slowdown.fleet_slots()} fleet slot(s) on {len(os.sched_getaffinity(0))} core(s)")


def _scale_timeouts(config: pytest.Config, items: list[pytest.Item]) -> None:
    """pytest-timeout's bound of each test (its `timeout` mark, else the ini's `timeout`) times the factor."""
    factor = slowdown.factor()
    default = float(config.getini("timeout") or 0)
    for item in items:
        mark = item.get_closest_marker("timeout")
        base = default
        if mark is not None:
            base = float(mark.args[0] if mark.args else mark.kwargs.get("timeout", default))
        if base > 0 and factor != 1.0:
            item.add_marker(pytest.mark.timeout(base * factor), append=False)


SLOT_WAIT_BOUND_S = 3600.0
"""How long a fleet test waits for its slots (scaled) before it runs anyway, with a warning: a bound that
only a hung holder reaches, and never a failure of the waiting test."""


def _starts_a_fleet(item: pytest.Item) -> bool:
    return item.get_closest_marker("e2e") is not None or item.get_closest_marker("fleet") is not None


def _slots_wanted(item: pytest.Item) -> int:
    """`@pytest.mark.fleet(slots=N)`: a test that runs N fleets at once holds N slots."""
    return max([int(m.kwargs.get("slots", 1)) for m in item.iter_markers("fleet")] or [1])


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A test that starts a whole fleet waits for a fleet slot before its setup, and so before
    pytest-timeout's clock starts: the wait is not part of its bound."""
    if not _starts_a_fleet(item):
        yield
        return
    with fleet_slots.hold(_slots_wanted(item), slowdown.fleet_slots(), slowdown.scaled(SLOT_WAIT_BOUND_S),
                          lambda text: item.warn(pytest.PytestWarning(text))):
        yield
