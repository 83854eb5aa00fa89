"""Cross-region bytes per version: one replicator per region vs every node pulling from home.

Three rollout regions of four nodes each follow a run of V versions (a Qwen2-architecture model
built from config, bf16; each version moves a random 3 % of the elements by one ulp, as an RL step
at a small learning rate does). Every store is a directory; each actor has its own store clients, so
the bytes each one GETs from a store outside its region are counted exactly.

* naive: each node materializes every version straight from the home store;
* ours: each region's `Replicator` copies every version from the cheapest store holding it (home or
  a peer region, by link cost) into the region store, and the nodes read only their region store.
  A region that follows the chain copies only an anchor's delta and rebuilds the anchor's dense
  objects from its own chain, keeping them only when byte for byte the published ones (hub/rebuild.py).

Both sides count the bytes of every GET that crosses a region boundary: objects, manifests and the
`latest` pointer that nodes (naive) or replicators (ours) poll. Writes (holder markers, 0 bytes) are
not counted on either side.

`copies_per_version`: complete copies of each version held in region stores at the end (every object
of the version present), averaged over versions: exactly R. `wan_copies_per_version`: object bytes
the replicators read across regions / object bytes published, per version: below R because anchors
are rebuilt in each region rather than copied. `rebuilt_bytes_per_version`: the anchor bytes built
locally instead.

    .venv/bin/python bench/replication.py [--quick]

Last line: `result: wan_ratio=… copies_per_version=… wan_copies_per_version=… rebuilt_bytes_per_version=…
naive_bytes_per_version=… ours_bytes_per_version=…`
"""

from __future__ import annotations

import argparse
import os
import pathlib
import tempfile
import time
from typing import Any

import torch

from fleetrl.hub.signing import generate_ed25519

os.environ.setdefault("FLEETRL_HUB_KEY", generate_ed25519()[0])  # this run's signing key (Ed25519, the default)

from fleetrl.config import FleetConfig, ModelConfig, TinyModelConfig
from fleetrl.hub import Hub, ObjectStore, Replicator, open_store
from fleetrl.hub.manifest import object_key

REGIONS = ("us-west", "eu-west", "ap-south")
NODES = 4
# us-west is next to home; eu-west is nearer to us-west than to home; ap-south nearest to eu-west.
LINK_COSTS = {
    "us-west": {"home": 1, "eu-west": 6, "ap-south": 9},
    "eu-west": {"home": 5, "us-west": 2, "ap-south": 6},
    "ap-south": {"home": 9, "us-west": 7, "eu-west": 2},
}


def config_for(root: pathlib.Path) -> FleetConfig:
    return FleetConfig.model_validate({
        "run": "bench",
        "hub": {"home_store": (root / "home").as_uri(), "anchor_interval": 8, "threads": 2},
        "regions": [{"name": r, "kafka": "127.0.0.1:9", "store": (root / r).as_uri(), "link_costs": LINK_COSTS[r]}
                    for r in REGIONS],
    })


def versions(tiny: TinyModelConfig, count: int) -> Any:
    """bf16 states: a model built from config, then random one-ulp moves of 3 % of the elements."""
    model = ModelConfig(tiny=tiny).build()
    state = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    g = torch.Generator().manual_seed(0)
    for _ in range(count):
        yield {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
        nxt = {}
        for name, t in state.items():
            bits = t.view(torch.int16)
            move = (torch.rand(bits.shape, generator=g) < 0.03).to(torch.int16)
            sign = torch.where(torch.rand(bits.shape, generator=g) < 0.5, 1, -1).to(torch.int16)
            nxt[name] = (bits + move * sign).view(torch.bfloat16)
        state = nxt


def clients(config: FleetConfig) -> dict[str, ObjectStore]:
    return {name: open_store(name, store) for name, store in config.stores().items()}


def foreign_bytes(view: dict[str, ObjectStore], home_region: str) -> int:
    """Bytes an actor of `home_region` read from every store outside its region."""
    return sum(s.stats.get_bytes for name, s in view.items() if name != home_region)


class Node:
    """A rollout node: keeps its weights and updates them in place to each new version."""

    def __init__(self, config: FleetConfig, region: str, read_from: str) -> None:
        self.view = clients(config)
        self.hub = Hub(config, store=read_from, stores=self.view)
        self.region, self.state, self.version = region, None, None  # type: ignore[var-annotated]

    def follow(self, version: int) -> None:
        assert self.hub.latest() == version  # how a node learns of a version: polling `latest`
        self.state = self.hub.materialize(version, into=self.state, have_version=self.version)
        self.version = version

    def wan_bytes(self) -> int:
        return foreign_bytes(self.view, self.region)


def simulate(tiny: TinyModelConfig, count: int, root: pathlib.Path) -> dict[str, float]:
    config = config_for(root)
    naive = [Node(config, r, read_from="home") for r in REGIONS for _ in range(NODES)]
    local = [Node(config, r, read_from=r) for r in REGIONS for _ in range(NODES)]
    rep_views = {r: clients(config) for r in REGIONS}
    replicators = {r: Replicator(config, r, stores=rep_views[r]) for r in REGIONS}
    version_bytes = 0
    manifests = []
    with Hub.from_config(config) as trainer:
        for state in versions(tiny, count):
            pv = trainer.publish(state)
            manifests.append(trainer.manifest(pv.version))
            version_bytes += sum(manifests[-1].objects.values())
            for region in sorted(REGIONS, key=lambda r: LINK_COSTS[r]["home"]):  # nearest regions first
                replicators[region].replicate_once()
            for node in naive + local:
                node.follow(pv.version)
    reference = naive[0].state
    assert reference is not None
    for n in local:  # every node holds the same bits, whichever way they came
        assert n.state is not None
        assert all(torch.equal(n.state[k].view(torch.int16), reference[k].view(torch.int16)) for k in reference)
    ours = sum(foreign_bytes(rep_views[r], r) for r in REGIONS) + sum(n.wan_bytes() for n in local)
    wan_copies = sum(sum(s.stats.object_bytes for name, s in rep_views[r].items() if name != r) for r in REGIONS)
    stores = clients(config)
    held = sum(all(stores[r].exists(object_key(config.run, o)) for o in m.objects) for r in REGIONS for m in manifests)
    rebuilt = sum(rep.rebuilt_bytes for rep in replicators.values())
    for n in naive + local:
        n.hub.close()
    for rep in replicators.values():
        rep.close()
    return {"naive": sum(n.wan_bytes() for n in naive) / count, "ours": ours / count,
            "copies": held / count, "wan_copies": wan_copies / version_bytes, "rebuilt": rebuilt / count,
            "version_bytes": version_bytes / count, "local_node_wan": sum(n.wan_bytes() for n in local)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer versions")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tiny = (TinyModelConfig(vocab_size=2048, hidden_size=128, intermediate_size=352, num_hidden_layers=2)
            if args.quick else
            TinyModelConfig(vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=4))
    count = 10 if args.quick else 12  # both include an anchor after version 0 (anchor_interval 8)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fleetrl-bench-") as tmp:
        r = simulate(tiny, count, pathlib.Path(tmp))
    print(f"{len(REGIONS)} regions x {NODES} nodes, {count} versions, {r['version_bytes']:,.0f} object bytes "
          f"per version on average ({time.perf_counter() - t0:.1f} s)")
    print(f"  naive (every node pulls from home): {r['naive']:>14,.0f} cross-region bytes per version")
    print(f"  ours (one replicator per region):   {r['ours']:>14,.0f} cross-region bytes per version")
    print(f"  complete copies of each version in region stores: {r['copies']:.2f} (regions: {len(REGIONS)})")
    print(f"  object bytes copied across regions per version byte: {r['wan_copies']:.2f}; "
          f"anchor bytes rebuilt in regions per version: {r['rebuilt']:,.0f}")
    print(f"  bytes nodes read outside their region: {r['local_node_wan']:,}")
    print(f"result: wan_ratio={r['naive'] / r['ours']:.2f} copies_per_version={r['copies']:.2f} "
          f"wan_copies_per_version={r['wan_copies']:.2f} rebuilt_bytes_per_version={r['rebuilt']:.0f} "
          f"naive_bytes_per_version={r['naive']:.0f} ours_bytes_per_version={r['ours']:.0f}")


if __name__ == "__main__":
    main()
