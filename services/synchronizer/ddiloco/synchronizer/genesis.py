"""The first global model: one learner uploads every fragment's initial parameters.

Without state, the first learner to say Hello is asked for the genesis upload (``Welcome.state``
genesis_requested); any other learner waits (genesis_pending) and retries. If the uploader
leaves before it finished, the next learner to say Hello takes over and the upload starts over.
Each fragment's upload is checked against itself (a layout of one fragment) and staged; once every
owned fragment is staged the layout must match the one the uploader announced, every fragment is
committed at version 0, and ``meta.json`` is written last, so a state dir without it holds no
state and a crash during genesis leaves nothing half-made. The uploader's Hello label ``model``
(a description of the model: a ModelConfig's JSON or a factory reference) is recorded in
``meta.json`` with the layout, so an export of the state says what the weights belong to.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from ddiloco.fragments.chunking import Transfer
from ddiloco.fragments.errors import FragmentError
from ddiloco.fragments.partition import Fragment, FragmentLayout
from ddiloco.fragments.payload import check_header, decode_fragment
from ddiloco.protocol.wire import Hello
from ddiloco.synchronizer.global_fragment import GlobalFragment
from ddiloco.synchronizer.inbox import Contribution
from ddiloco.synchronizer.ledger import Ledger
from ddiloco.synchronizer.membership import LearnerRecord, Membership
from ddiloco.synchronizer.recovery import LoadedState
from ddiloco.synchronizer.store import FragmentRecord, StateStore

MAX_MODEL_LABEL_BYTES = 64 * 1024
"""Largest ``model`` label recorded in meta.json. A description is a small JSON document; a
learner sending megabytes there must not bloat the file every start-up reads, so a larger one is
left out (with a warning) rather than cut, which would record an invalid description."""


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

    def on_hello(self, hello: Hello, rec: LearnerRecord, membership: Membership) -> str:
        """Who uploads: this learner ("genesis_requested") or someone already on it ("genesis_pending")."""
        owner = membership.learners.get(self.owner or "")
        if owner is None or not owner.connected or owner is rec:
            if self.owner != hello.learner_id:
                self._staging.clear()
            self.owner = hello.learner_id
            self._hello = hello
            return "genesis_requested"
        return "genesis_pending"

    async def receive(self, rec: LearnerRecord, transfer: Transfer, c: Contribution) -> LoadedState | None:
        """Stage one fragment's upload; the committed state once every owned fragment is in."""
        h = transfer.header
        if rec.learner_id != self.owner:
            self.ledger.reject(c, "protocol", f"genesis is being uploaded by {self.owner}, not {rec.learner_id}")
            return None
        if h.fragment_id not in self.owned:
            self.ledger.reject(c, "unknown_fragment", f"fragment {h.fragment_id} is not owned by this shard")
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
        else:
            layout = FragmentLayout(tuple(specs[p] for p in range(self.num_fragments)))
            if layout.fingerprint != hello.layout_hash:
                self._staging.clear()
                self.ledger.reject(Contribution(rec.learner_id, 0, 0, 0, 0, 0, 0.0), "layout_mismatch",
                                   f"genesis tensors give layout {layout.fingerprint}, Hello said {hello.layout_hash}")
                return None
        staged = dict(self._staging)
        model = hello.labels.get("model")
        if model is not None and len(model.encode()) > MAX_MODEL_LABEL_BYTES:
            self.ledger.log.warning("model label not recorded: too large", learner_id=rec.learner_id,
                                    bytes=len(model.encode()), limit=MAX_MODEL_LABEL_BYTES)
            model = None

        def commit() -> None:
            for p, (_, values) in staged.items():
                self.store.commit(FragmentRecord(p, 0, values, torch.zeros_like(values), 0, self.wall()))
            self.store.write_meta(layout=layout, model_fingerprint=hello.model_fingerprint,
                                  protocol=self.protocol, owned=self.owned, model=model,
                                  layout_hash=hello.layout_hash, shard=self.shard)

        await self.run_blocking(commit)
        self._staging.clear()
        fragments = {p: GlobalFragment(layout[p], values, torch.zeros_like(values), 0, history_size=self.history)
                     for p, (_, values) in staged.items()}
        return LoadedState(layout, hello.layout_hash, hello.model_fingerprint, fragments, merges=0)
