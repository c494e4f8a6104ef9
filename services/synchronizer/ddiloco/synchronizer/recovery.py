"""Start-up on an existing state dir: the global model as it was last committed.

With ``meta.json`` present, the fragment layout, the model fingerprint and every owned fragment's
newest verifiable version are loaded, with the older verifiable versions as re-anchoring history
(a torn or corrupt file fails its digest and is skipped), so versions continue monotonically
after any crash. The protocol constants the state was created with must match the config: a
state dir of another layout is refused rather than reinterpreted. The learners of the last
committed merges are returned too, for the rejoin hold.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from ddiloco.fragments.partition import FragmentLayout
from ddiloco.synchronizer.global_fragment import GlobalFragment
from ddiloco.synchronizer.store import StateError, StateStore, layout_from_json

PROTOCOL_KEYS = ("num_fragments", "sync_every", "overlap", "mode")
"""Protocol constants a state dir is bound to."""


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
    for p in owned:
        spec = layout[p]
        latest, older = store.load_latest(p, spec.numel)
        if latest is None:
            raise StateError(f"state dir {store.root} has no verifiable version of fragment {p}")
        frag = GlobalFragment(spec, latest.params, latest.momentum, latest.version, merges=latest.merges,
                              history_size=history, reader=functools.partial(store.read_params, p, num_values=spec.numel))
        frag.history.clear()
        for rec in [*older, latest]:
            frag.remember(rec.version, rec.params)
            frag.note_merged(rec.version, rec.contributors or {})
        fragments[p] = frag
        merges += latest.merges
        contributors.update((latest.contributors or {}).keys())
    return LoadedState(layout, meta["layout_hash"], meta["model_fingerprint"], fragments, merges,
                       frozenset(contributors))
