"""Start-up on an existing state dir: the global model as it was last committed.

With ``meta.json`` present, the fragment layout, the model fingerprint and every owned fragment's
newest verifiable version are loaded, with the older verifiable versions as re-anchoring history
(a torn or corrupt file fails its digest and is skipped), so versions continue monotonically
after any crash. The protocol constants the state was created with must match the config: a
state dir of another layout is refused rather than reinterpreted. The learners of the last
committed merges are returned too, for the rejoin hold.

The state's fleet id (the run it belongs to: one id for every shard of a fleet, made at the
fleet's first genesis) is in ``fleet.json`` beside ``meta.json``. Genesis writes it before
``meta.json``, so a state dir with ``meta.json`` and no ``fleet.json`` is one from before fleet ids:
it adopts one on its first start here and records it. The adopted id is derived from what every
shard of such a fleet shares (the whole model's layout hash, the model fingerprint, the protocol,
the shard count), so the shards of one old fleet adopt the same id without talking to each other.
A separate file rather than a field of ``meta.json``: it is written before ``meta.json`` by genesis
and by itself on adoption, and ``meta.json``'s writer (``store``) stays as it was.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import secrets
import time
from dataclasses import dataclass, field

from ddiloco.core.logs import get_logger
from ddiloco.fragments.partition import FragmentLayout
from ddiloco.synchronizer.global_fragment import GlobalFragment
from ddiloco.synchronizer.store import FragmentRecord, StateError, StateStore, atomic_write, layout_from_json

PROTOCOL_KEYS = ("num_fragments", "sync_every", "overlap", "mode")
"""Protocol constants a state dir is bound to."""
FLEET = "fleet.json"
"""The state dir's fleet record: ``{"fleet_id", "recorded_unix", "how", ...}`` (see the module doc)."""


def new_fleet_id() -> str:
    """A fresh fleet id (64 random bits: two runs never share one by chance)."""
    return "fleet-" + secrets.token_hex(8)


def derived_fleet_id(meta: dict) -> str:
    """The fleet id a state dir from before fleet ids adopts, and a genesis from a learner older
    than fleet ids is recorded under: the same for every shard of one such fleet (it hashes what
    their ``meta.json`` files share). Two such runs of the same model and protocol derive the same
    id; ``export``'s commit-time bound still tells their shards apart."""
    shards = str(meta.get("shard", "0/1")).partition("/")[2]
    # Only the protocol constants a state dir is bound to: a codec or chunk size changed between
    # two shards' starts (one shard re-created after a config change) is still one fleet.
    protocol = {k: (meta.get("protocol") or {}).get(k) for k in PROTOCOL_KEYS}
    doc = {"layout_hash": meta.get("layout_hash"), "model_fingerprint": meta.get("model_fingerprint"),
           "protocol": protocol, "shards": shards}
    return "legacy-" + hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def read_fleet(root: str | os.PathLike[str]) -> dict | None:
    """The state dir's fleet record (None when it has none: before genesis, or from before fleet
    ids). Only reads: safe next to a running synchronizer (``export``)."""
    path = pathlib.Path(root) / FLEET
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as exc:
        raise StateError(f"{path} is unreadable: {exc}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("fleet_id"), str) or not doc["fleet_id"]:
        raise StateError(f"{path} holds no fleet_id")
    return doc


def write_fleet(root: str | os.PathLike[str], fleet_id: str, how: str, **fields: object) -> None:
    """Record ``fleet_id`` in the state dir (atomically). ``how``: "genesis" (a new fleet's first
    state), "reseed" (a learner of the fleet seeded a shard that lost its state), "operator" (an
    operator's explicit re-seed), "adopted" (a state dir from before fleet ids)."""
    doc = {"fleet_id": fleet_id, "recorded_unix": time.time(), "how": how, **fields}
    atomic_write(pathlib.Path(root) / FLEET, json.dumps(doc, indent=1).encode())


@dataclass
class LoadedState:
    layout: FragmentLayout
    layout_hash: str
    model_fingerprint: str
    fragments: dict[int, GlobalFragment]
    merges: int
    """Merges committed over the state's life."""
    last_contributors: frozenset[str] = field(default_factory=frozenset)
    """Learners merged into the newest version of any fragment."""
    fleet_id: str = ""
    """The fleet this state belongs to (``fleet.json``)."""
    paces: dict[str, float] = field(default_factory=dict)
    """The learners' paces the newest commit carries (the claim guard starts from them)."""


def load_state(store: StateStore, *, protocol: dict, owned: list[int], history: int) -> LoadedState | None:
    """The state in ``store`` (None when it holds none yet); StateError when it is unusable."""
    meta = store.read_meta()
    if meta is None:
        return None
    for key in PROTOCOL_KEYS:
        if meta["protocol"].get(key) != protocol[key]:
            raise StateError(
                f"state dir {store.root} was created with {key}={meta['protocol'].get(key)!r}, "
                f"config says {protocol[key]!r}; use another state dir or the original config")
    theirs = meta.get("owned_fragments")
    if theirs is not None and sorted(theirs) != sorted(owned):
        raise StateError(f"state dir {store.root} holds fragments {sorted(theirs)}, this synchronizer (shard "
                         f"{meta.get('shard', '?')}) owns {sorted(owned)}: every shard needs a state dir of its own, "
                         "and the number of shards is fixed for a fleet's life")
    layout = layout_from_json(meta["layout"])
    fragments: dict[int, GlobalFragment] = {}
    merges = 0
    contributors: set[str] = set()
    newest: FragmentRecord | None = None
    for p in owned:
        spec = layout[p]
        latest, older = store.load_latest(p, spec.numel)
        if latest is None:
            raise StateError(f"state dir {store.root} has no verifiable version of fragment {p}")
        frag = GlobalFragment(spec, latest.params, latest.momentum, latest.version, merges=latest.merges,
                              last_merge_unix=latest.committed_at, history_size=history, reader=functools.partial(store.read_params, p, num_values=spec.numel))
        frag.history.clear()
        for rec in [*older, latest]:
            frag.note_committed(rec.version, rec.committed_at)
            frag.remember(rec.version, rec.params)
            frag.note_merged(rec.version, rec.contributors or {})
        fragments[p] = frag
        merges += latest.merges
        contributors.update((latest.contributors or {}).keys())
        if newest is None or latest.committed_at > newest.committed_at:
            newest = latest
    fleet = read_fleet(store.root)
    if fleet is None:
        fleet = {"fleet_id": derived_fleet_id(meta)}
        write_fleet(store.root, fleet["fleet_id"], "adopted")
        get_logger("ddiloco.synchronizer").info(
            "fleet id adopted: the state dir is from before fleet ids", state_dir=str(store.root),
            fleet_id=fleet["fleet_id"], shard=meta.get("shard", "0/1"))
    return LoadedState(layout, meta["layout_hash"], meta["model_fingerprint"], fragments, merges,
                       frozenset(contributors), fleet["fleet_id"], (newest.paces or {}) if newest else {})
