"""The tensor hub (DESIGN.md §5): exact delta weights in object stores, signed manifests, replication.

The trainer publishes each version of the policy (bf16 bit patterns) into the home store as a sparse
delta from the previous one, with a dense anchor every K versions; one replicator per region copies
each version into the region store from the cheapest store that holds it; rollout nodes
materialize versions from their region store only.
"""

from fleetrl.hub.errors import (
    BaseMismatch,
    CodecError,
    HubError,
    IntegrityError,
    LeaseLost,
    ObjectExists,
    ObjectNotFound,
    SignatureError,
    StoreError,
    UnknownVersion,
    VersionConflict,
)
from fleetrl.hub.hub import Changed, Hub, StoreCheck
from fleetrl.hub.lease import Lease
from fleetrl.hub.manifest import AdapterInfo, Manifest, TensorEntry
from fleetrl.hub.peft_folder import save_peft_adapter
from fleetrl.hub.publisher import PublishedVersion
from fleetrl.hub.replicator import Replicator, VersionHints
from fleetrl.hub.sharded import ShardParts, ShardPlan, ShardPublisher, ShardReport
from fleetrl.hub.stores import DirStore, ObjectStore, open_store

__all__ = [
    "AdapterInfo",
    "BaseMismatch",
    "Changed",
    "CodecError",
    "DirStore",
    "Hub",
    "HubError",
    "IntegrityError",
    "Lease",
    "LeaseLost",
    "Manifest",
    "ObjectExists",
    "ObjectNotFound",
    "ObjectStore",
    "PublishedVersion",
    "Replicator",
    "ShardParts",
    "ShardPlan",
    "ShardPublisher",
    "ShardReport",
    "SignatureError",
    "StoreCheck",
    "StoreError",
    "TensorEntry",
    "UnknownVersion",
    "VersionConflict",
    "VersionHints",
    "open_store",
    "save_peft_adapter",
]
