"""The first global model: one learner uploads every fragment's initial parameters.

Without state, the first learner to say Hello is asked for the genesis upload (``Welcome.state``
genesis_requested); any other learner waits (genesis_pending) and retries. If the uploader
leaves before it finished, the next learner to say Hello takes over and the upload starts over.
Each fragment's upload is checked against itself (a layout of one fragment) and staged; once every
owned fragment is staged the layout must match the one the uploader announced, every fragment is
committed, and ``meta.json`` is written last, so a state dir without it holds no state and a crash
during genesis leaves nothing half-made. The uploader's Hello label ``model`` (a description of
the model: a ModelConfig's JSON or a factory reference) is recorded in ``meta.json`` with the
layout, so an export of the state says what the weights belong to.

A shard sees only its own fragments, so it cannot hash the whole layout from what is uploaded to
it. A sharded learner's Hello carries the whole layout (every fragment's tensors): the shard checks
that it hashes to the Hello's ``layout_hash`` before asking for the upload, and that every
uploaded fragment is that layout's fragment. An older learner sends no layout; its genesis is
committed unchecked, as before, with a warning.

**The fleet.** Every genesis is recorded under a fleet id (``fleet.json``, see ``recovery``), the
same for every shard of one fleet: the uploader's Hello names it (the fleet of the shards holding
state, else the one the lowest shard was asked to record, else the learner's own fresh proposal:
``ddiloco.learner.session``). A Hello that names none (a learner older than fleet ids) gets the id
derived from what every shard shares (``recovery.derived_fleet_id``, as a state dir from before
fleet ids adopts), so the shards such learners seed agree without talking to each other.

**A shard that lost its state** (its state dir wiped, a new volume) must not be seeded from a
newcomer's initialization while the rest of the fleet trains on: the newcomer's values would
replace the trained fragments of every learner (each is told to resync to them), silently. The
learners' Hellos say which versions of the fleet they hold or were told of (``fleet_versions``);
once any Hello shows a version above 0, this synchronizer knows its fleet has merged, and from then
on only a learner that holds every fragment it owns (``Hello.held``) of that fleet may seed it:
its newest global of each fragment, committed at that fragment's version, so versions go on where
they were and the learners holding them need not resync. Anyone else is answered ``reseed_wait``
with the reason (and a warning is logged, once a learner per ``WAIT_LOG_EVERY_S``); an uploader
asked before any Hello showed the merges loses its upload (refused) once one does. An operator
who knows no such learner is left (every learner of the fleet gone) re-seeds explicitly: the
synchronizer started with ``--reseed`` (``SynchronizerConfig.reseed``) takes the next learner's
upload whatever it holds, logged as an operator's re-seed; its fragments then start over at
version 0 from that learner's values, and learners holding newer versions are told to resync. The
unsharded synchronizer works the same way (its learners' Hellos hold the evidence), with one
limit: before any Hello of a trained learner arrives it cannot tell a lost state from a new fleet.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from ddiloco.fragments.chunking import Transfer
from ddiloco.fragments.errors import FragmentError
from ddiloco.fragments.partition import Fragment, FragmentLayout
from ddiloco.fragments.payload import check_header, decode_fragment
from ddiloco.protocol.wire import Hello
from ddiloco.synchronizer.admission import Refused
from ddiloco.synchronizer.global_fragment import GlobalFragment
from ddiloco.synchronizer.inbox import Contribution
from ddiloco.synchronizer.ledger import Ledger
from ddiloco.synchronizer.membership import LearnerRecord, Membership
from ddiloco.synchronizer.recovery import LoadedState, derived_fleet_id, write_fleet
from ddiloco.synchronizer.store import FragmentRecord, StateStore

MAX_MODEL_LABEL_BYTES = 64 * 1024
"""Largest ``model`` label recorded in meta.json. A description is a small JSON document; a
learner sending megabytes there must not bloat the file every start-up reads, so a larger one is
left out (with a warning) rather than cut, which would record an invalid description."""
MAX_VERSION = 1 << 62
"""Largest version a re-seed may continue from (a version counter never comes near it)."""
WAIT_LOG_EVERY_S = 30.0
"""A learner told to wait for a re-seed is logged at most this often (it retries every few seconds)."""


class Genesis:
    def __init__(self, *, store: StateStore, ledger: Ledger, num_fragments: int, owned: list[int],
                 shard: tuple[int, int], protocol: dict, history: int, run_blocking: Callable[..., Awaitable[Any]],
                 codec_threads: int, wall: Callable[[], float]) -> None:
        self.store, self.ledger = store, ledger
        self.num_fragments, self.owned, self.shard = num_fragments, owned, shard
        self.sharded = shard[1] > 1
        self.protocol, self.history = protocol, history
        self.run_blocking, self.codec_threads, self.wall = run_blocking, codec_threads, wall
        self.owner: str | None = None
        self._hello: Hello | None = None
        self._staging: dict[int, tuple[Transfer, torch.Tensor]] = {}
        self.seen: dict[int, int] = {}
        """The newest version of each fragment of the fleet that any Hello showed."""
        self.seen_fleet = ""
        """The fleet of the first Hello that showed a merged version ("" before one did)."""
        self.how = "genesis"
        """How the owner seeds: "genesis" (a new fleet), "reseed" (it holds this shard's fragments of
        a fleet that merged), "operator" (an operator's explicit re-seed)."""
        self._told: dict[str, float] = {}
        self._operator = False
        """The operator allows any learner to seed (``--reseed``), as of the last Hello."""

    @property
    def merged(self) -> bool:
        """Whether the fleet merged a version somewhere (so this synchronizer lost its state)."""
        return any(v > 0 for v in self.seen.values())

    def fleet_for(self, hello: Hello | None) -> str:
        """The fleet id a genesis from ``hello``'s learner would be recorded under: the fleet known
        to have merged (a re-seed keeps the fleet's id, whoever seeds it), else the one the Hello
        names, else the derived one."""
        if hello is None:
            return self.seen_fleet
        return self.seen_fleet or hello.fleet_id or derived_fleet_id(
            {"layout_hash": hello.layout_hash, "model_fingerprint": hello.model_fingerprint, "protocol": self.protocol,
             "shard": f"{self.shard[0]}/{self.shard[1]}"})

    def welcome_fleet(self, state: str, hello: Hello) -> str:
        """The fleet id a Welcome of ``state`` (from ``on_hello``) tells ``hello``'s learner: the one
        its genesis would be recorded under, the uploader's, or the fleet it waits for."""
        if state == "genesis_requested":
            return self.fleet_for(hello)
        if state == "genesis_pending":
            return self.fleet_for(self._hello)
        return self.seen_fleet or hello.fleet_id

    def holds(self, hello: Hello) -> bool:
        """Whether ``hello``'s learner holds every fragment this synchronizer owns, of the fleet
        that merged (a learner naming another fleet does not count)."""
        if self.seen_fleet and hello.fleet_id and hello.fleet_id != self.seen_fleet:
            return False
        return all(p in hello.held for p in self.owned)

    def check(self, hello: Hello) -> None:
        """Refuse (before anything is uploaded) a sharded Hello whose layout is not the one its
        ``layout_hash`` names."""
        if not (self.sharded and hello.layout):
            return
        layout = self._layout(hello)
        if len(layout.fragments) != self.num_fragments:
            raise Refused("FAILED_PRECONDITION", "layout_mismatch",
                          f"the Hello's layout has {len(layout.fragments)} fragments, the protocol {self.num_fragments}")
        if layout.fingerprint != hello.layout_hash:
            raise Refused("FAILED_PRECONDITION", "layout_mismatch",
                          f"the Hello's layout hashes to {layout.fingerprint}, its layout_hash says {hello.layout_hash}")

    def on_hello(self, hello: Hello, rec: LearnerRecord, membership: Membership, *,
                 operator_reseed: bool = False) -> tuple[str, str]:
        """Who uploads, and why: ("genesis_requested", "") for this learner, ("genesis_pending",
        why) while someone else is on it, ("reseed_wait", why) when the fleet merged and this
        learner cannot seed what was lost. ``operator_reseed``: the operator allows any learner."""
        self._note(hello)
        self._operator = operator_reseed
        fits = self.holds(hello) or operator_reseed or not self.merged
        if not fits:
            detail = self._wait_detail(hello)
            now = time.monotonic()
            if now - self._told.get(hello.learner_id, -WAIT_LOG_EVERY_S) >= WAIT_LOG_EVERY_S:
                self._told[hello.learner_id] = now
                self.ledger.log.warning("waiting for a re-seed: this learner cannot seed the lost state",
                                        learner_id=hello.learner_id, fleet_id=self.seen_fleet,
                                        shard=f"{self.shard[0]}/{self.shard[1]}", detail=detail)
            return "reseed_wait", detail
        owner = membership.learners.get(self.owner or "")
        owner_fits = self._hello is not None and (self.holds(self._hello) or operator_reseed or not self.merged)
        if owner is not None and owner.connected and owner is not rec and owner_fits:
            return "genesis_pending", f"the genesis is being uploaded by {self.owner}"
        if self.owner != hello.learner_id:
            self._staging.clear()
        self.owner = hello.learner_id
        self._hello = hello
        self.how = ("reseed" if self.holds(hello) else "operator") if self.merged else "genesis"
        if self.how != "genesis":
            self.ledger.log.warning("re-seeding the lost state" if self.how == "reseed"
                                    else "re-seeding the lost state on the operator's order (--reseed)",
                                    learner_id=hello.learner_id, fleet_id=self.fleet_for(hello),
                                    shard=f"{self.shard[0]}/{self.shard[1]}",
                                    held={p: hello.held.get(p) for p in self.owned},
                                    fleet_versions=dict(sorted(self.seen.items())))
        return "genesis_requested", ""

    def _note(self, hello: Hello) -> None:
        versions = {**hello.fleet_versions, **hello.held}
        for p, v in versions.items():
            if 0 <= p < self.num_fragments:
                self.seen[p] = max(self.seen.get(p, 0), v)
        if not self.seen_fleet and hello.fleet_id and any(v > 0 for v in versions.values()):
            self.seen_fleet = hello.fleet_id

    def _wait_detail(self, hello: Hello) -> str:
        newest = max(self.seen, key=lambda p: self.seen[p])
        fleet = f"fleet {self.seen_fleet}" if self.seen_fleet else "the fleet"
        theirs = {p: hello.held[p] for p in self.owned if p in hello.held}
        why = (f"it names fleet {hello.fleet_id}" if self.seen_fleet and hello.fleet_id
               and hello.fleet_id != self.seen_fleet else f"it holds {theirs or 'none'} of them")
        return (f"this synchronizer (shard {self.shard[0]}/{self.shard[1]}) has no state, but {fleet} has merged "
                f"versions (fragment {newest} at version {self.seen[newest]}): its state was lost. It waits for a "
                f"learner that holds its fragments {self.owned} of that fleet to seed it again; learner "
                f"{hello.learner_id} cannot ({why}). An operator can re-seed it from the next learner instead: "
                "restart it with --reseed")

    @staticmethod
    def _layout(hello: Hello) -> FragmentLayout:
        return FragmentLayout(tuple(Fragment(p, tensors) for p, tensors in enumerate(hello.layout)))

    async def receive(self, rec: LearnerRecord, transfer: Transfer, c: Contribution) -> LoadedState | None:
        """Stage one fragment's upload; the committed state once every owned fragment is in."""
        h = transfer.header
        if rec.learner_id != self.owner:
            self.ledger.reject(c, "protocol", f"genesis is being uploaded by {self.owner}, not {rec.learner_id}")
            return None
        if h.fragment_id not in self.owned:
            self.ledger.reject(c, "unknown_fragment", f"fragment {h.fragment_id} is not owned by this shard")
            return None
        hello = self._hello
        assert hello is not None
        if self.how == "genesis" and self.merged and not self._operator:
            # asked before any Hello showed that the fleet merged: it cannot seed the lost state
            self._staging.clear()
            self.ledger.reject(c, "protocol", "the fleet has merged versions since this learner was asked for the "
                                              "genesis, and it does not hold this synchronizer's fragments")
            return None
        if h.layout_hash and h.layout_hash != hello.layout_hash:
            self.ledger.reject(c, "layout_mismatch",
                               f"genesis fragment {h.fragment_id} is of layout {h.layout_hash}, Hello said {hello.layout_hash}")
            return None
        if self.sharded and hello.layout and tuple(h.tensors) != tuple(hello.layout[h.fragment_id]):
            self.ledger.reject(c, "layout_mismatch",
                               f"genesis fragment {h.fragment_id}'s tensors are not fragment {h.fragment_id} of the "
                               f"layout the Hello sent (layout {hello.layout_hash})")
            return None
        if self.how == "reseed" and h.version > MAX_VERSION:
            self.ledger.reject(c, "protocol", f"re-seed of fragment {h.fragment_id} at version {h.version}")
            return None
        single = FragmentLayout((Fragment(h.fragment_id, h.tensors),))
        header = dataclasses.replace(transfer.header, fragment_id=0)
        try:
            check_header(header, single)
            values = await self.run_blocking(decode_fragment, transfer.under(header), single,
                                             zstd_threads=self.codec_threads)
        except FragmentError as exc:
            self.ledger.reject(c, exc.reason.lower(), str(exc))
            return None
        self._staging[h.fragment_id] = (transfer, values)
        if set(self._staging) >= set(self.owned):
            return await self._commit(rec)
        return None

    async def _commit(self, rec: LearnerRecord) -> LoadedState | None:
        hello = self._hello
        assert hello is not None
        specs = {p: Fragment(p, t.header.tensors) for p, (t, _) in self._staging.items()}
        if self.sharded:
            # A shard sees only its fragments; the others get empty placeholders in the layout.
            layout = FragmentLayout(tuple(specs.get(p, Fragment(p, ())) for p in range(self.num_fragments)))
            if not hello.layout:
                self.ledger.log.warning("genesis layout not checked: the learner's Hello carries no layout (an "
                                        "older learner)", learner_id=rec.learner_id, layout_hash=hello.layout_hash)
        else:
            layout = FragmentLayout(tuple(specs[p] for p in range(self.num_fragments)))
            if layout.fingerprint != hello.layout_hash:
                self._staging.clear()
                self.ledger.reject(Contribution(rec.learner_id, 0, 0, 0, 0, 0, 0.0), "layout_mismatch",
                                   f"genesis tensors give layout {layout.fingerprint}, Hello said {hello.layout_hash}")
                return None
        # A re-seed goes on from the versions of the values uploaded; anything else starts at 0.
        versions = {p: (t.header.version if self.how == "reseed" else 0) for p, (t, _) in self._staging.items()}
        staged = dict(self._staging)
        model = hello.labels.get("model")
        if model is not None and len(model.encode()) > MAX_MODEL_LABEL_BYTES:
            self.ledger.log.warning("model label not recorded: too large", learner_id=rec.learner_id,
                                    bytes=len(model.encode()), limit=MAX_MODEL_LABEL_BYTES)
            model = None
        fleet_id, how = self.fleet_for(hello), self.how

        def commit() -> None:
            for p, (_, values) in staged.items():
                self.store.commit(FragmentRecord(p, versions[p], values, torch.zeros_like(values), 0, self.wall()))
            write_fleet(self.store.root, fleet_id, how, seeded_by=rec.learner_id, versions=versions)
            self.store.write_meta(layout=layout, model_fingerprint=hello.model_fingerprint,
                                  protocol=self.protocol, owned=self.owned, model=model,
                                  layout_hash=hello.layout_hash, shard=self.shard)

        await self.run_blocking(commit)
        self._staging.clear()
        if how != "genesis":
            self.ledger.log.warning("lost state re-seeded", learner_id=rec.learner_id, fleet_id=fleet_id, how=how,
                                    versions=versions, shard=f"{self.shard[0]}/{self.shard[1]}")
        fragments = {p: GlobalFragment(layout[p], values, torch.zeros_like(values), versions[p],
                                       history_size=self.history)
                     for p, (_, values) in staged.items()}
        return LoadedState(layout, hello.layout_hash, hello.model_fingerprint, fragments, merges=0, fleet_id=fleet_id)
