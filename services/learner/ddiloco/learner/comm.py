"""The learner's communication: what the training thread holds to reach the synchronizer.

Training never touches the network. ``Comm`` owns one lane per synchronizer shard (one, unsharded):
a ``Mailbox`` (``mailbox.py``: the locked hand-off of contributions, requests and merged fragments
between the threads) and a communication thread running a ``Link`` (``session.py``: that shard's
gRPC stream, its sessions and reconnects). Shard ``s`` owns fragment ``p`` when ``p % S == s``
(``ddiloco.protocol.shards``); every call about a fragment goes to its owner's lane, so a shard
that is down or slow holds up only its own fragments, never training and never the other shards.
At step boundaries training calls ``collect`` (nothing here; ``ProcessComm`` reads its channel),
then picks up the synchronizers' requests (``take_requests``: which fragments to send now), hands
contributions to ``submit`` (non-blocking) and picks up merged fragments with ``take_arrivals``.
Modes that wait by design (streaming, diloco) call ``wait_arrival`` with a timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ddiloco.fragments.partition import FragmentLayout
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.events import EventLog
from ddiloco.learner.mailbox import Arrival, Mailbox, Outgoing
from ddiloco.learner.session import JoinState, Link, LiveStats
from ddiloco.protocol.shards import owned, owner


@dataclass
class Lane:
    """One shard's share of the communication: its mailbox, its link and the thread running it."""

    shard: int
    mailbox: Mailbox
    link: Link
    thread: threading.Thread


@dataclass
class FleetJoin:
    """The joins of every shard, seen as one (what ``DecoupledSync.join`` waits for)."""

    joins: list[JoinState] = field(default_factory=list)
    failure: str | None = None
    """Why the communication itself could not run (the communication process's; never set here)."""

    @property
    def error(self) -> str | None:
        errors = [j.error for j in self.joins if j.error]
        return "; ".join(errors) if errors else None

    @property
    def ready(self) -> bool:
        """Every shard joined, or one refused (nothing more to wait for)."""
        return all(j.ready.is_set() for j in self.joins) or self.error is not None

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a shard still joining; whether all are (or one refused)."""
        waiting = [j for j in self.joins if not j.ready.is_set()]
        if waiting and self.error is None:
            waiting[0].ready.wait(timeout_s)
        return self.ready

    @property
    def pending(self) -> list[int]:
        """Shards not joined yet."""
        return [s for s, j in enumerate(self.joins) if not j.ready.is_set()]

    @property
    def genesis(self) -> bool:
        """This learner uploaded the global model to every shard (a new fleet)."""
        return all(j.genesis for j in self.joins)

    @property
    def fleet_step(self) -> int:
        return max(j.fleet_step for j in self.joins)

    @property
    def fetched(self) -> dict[int, tuple[int, torch.Tensor]]:
        """The fleet's global fragments, from every shard that had them (a shard this learner
        uploaded the genesis to contributes none: the learner's own values are that shard's)."""
        return {p: v for j in self.joins for p, v in j.fetched.items()}


class Comm:
    def __init__(self, cfg: LearnerConfig, *, layout: FragmentLayout, model_fingerprint: str, incarnation: int,
                 events: EventLog, held: Callable[[], dict[int, int]],
                 genesis_values: Callable[[], dict[int, torch.Tensor]],
                 labels: dict[str, str] | None = None,
                 mailbox: Callable[[EventLog], Mailbox] = Mailbox) -> None:
        """``mailbox``: how each lane's mailbox is made (the communication process's forwards what
        training takes to the training process)."""
        targets = cfg.targets
        self.shards = len(targets)
        self._stop = threading.Event()
        self.stats = LiveStats()
        """What the heartbeats of every shard report (written by the training thread)."""
        self.draining = threading.Event()
        """Set by ``drain`` or by any shard asking this learner to leave."""
        self.lanes: list[Lane] = []
        for s, target in enumerate(targets):
            box = mailbox(events)
            link = Link(cfg, mailbox=box, stop=self._stop, layout=layout, model_fingerprint=model_fingerprint,
                        incarnation=incarnation, events=events, held=held, genesis_values=genesis_values,
                        labels=labels, target=target, shard=s, shards=self.shards,
                        fragments=tuple(owned(layout.num_fragments, s, self.shards)),
                        stats=self.stats, draining=self.draining)
            name = f"comm-{link.learner_id}" + (f"-shard{s}" if self.shards > 1 else "")
            self.lanes.append(Lane(s, box, link, threading.Thread(target=link.run, name=name, daemon=True)))
        self.join = FleetJoin([lane.link.join for lane in self.lanes])
        self.hurry = threading.Event()
        """Set by a second stop request: ``flush`` stops waiting (what is unsent or unanswered is dropped)."""

    def lane(self, fragment: int) -> Lane:
        """The lane of the shard that owns ``fragment``."""
        return self.lanes[owner(fragment, self.shards)]

    @property
    def bytes_sent(self) -> int:
        return sum(lane.link.bytes_sent for lane in self.lanes)

    @property
    def bytes_received(self) -> int:
        return sum(lane.link.bytes_received for lane in self.lanes)

    def start(self) -> None:
        for lane in self.lanes:
            lane.thread.start()

    def claim(self, numel: int) -> None:
        """No slot to compute a contribution into: the thread reads the training loop's own tensor
        (``ProcessComm.claim`` lends shared memory)."""
        return None

    def release(self, claim: None) -> None:
        """Nothing claimed, nothing to give back."""

    def submit(self, out: Outgoing, claim: None = None) -> None:
        """Queue a contribution (see ``Mailbox.submit``) and wake its shard's sender."""
        lane = self.lane(out.fragment)
        lane.mailbox.submit(out)
        lane.link.poke()

    def collect(self) -> None:
        """Nothing to read: the communication thread fills the mailboxes as things come in
        (``ProcessComm.collect`` reads its channel here)."""

    def take_requests(self) -> dict[int, int]:
        """Fragments the synchronizer asked for since the last call: fragment -> round."""
        return {p: r for lane in self.lanes for p, r in lane.mailbox.take_requests().items()}

    def take_heals(self) -> set[int]:
        """Fragments whose contributions were refused for their content too often in a row."""
        return {p for lane in self.lanes for p in lane.mailbox.take_heals()}

    def resync(self, fragments: tuple[int, ...]) -> None:
        """Fetch the newest global version of ``fragments`` and deliver each as a resync arrival."""
        for lane in self.lanes:
            mine = tuple(p for p in fragments if owner(p, self.shards) == lane.shard)
            if mine:
                lane.mailbox.want_resync(mine)
                lane.link.poke()

    def training_done(self) -> None:
        """Training ended: tell every shard at once (heartbeat), so no round waits for us."""
        self.stats.training_done = True
        self.beat_now()

    def beat_now(self) -> None:
        """Send a heartbeat now rather than at the next interval (the pace became known, training ended)."""
        for lane in self.lanes:
            lane.link.beat_now()

    def take_arrivals(self) -> dict[int, Arrival]:
        return {p: a for lane in self.lanes for p, a in lane.mailbox.take_arrivals().items()}

    def peek_version(self, fragment: int) -> int | None:
        return self.lane(fragment).mailbox.peek_version(fragment)

    def wait_arrival(self, fragment: int, newer_than: int, timeout_s: float) -> bool:
        """Block until a global of ``fragment`` newer than ``newer_than`` has arrived (or timeout)."""
        return self.lane(fragment).mailbox.wait_arrival(fragment, newer_than, timeout_s, self._stop)

    def pending(self) -> int:
        return sum(lane.mailbox.pending() for lane in self.lanes)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every submitted contribution has been answered (or timeout, or ``hurry``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.hurry.is_set():
            if self.pending() == 0:
                return True
            time.sleep(0.05)
        return self.pending() == 0

    def stop(self, goodbye: str = "finished") -> None:
        for lane in self.lanes:
            lane.link.goodbye = goodbye
        self._stop.set()
        for lane in self.lanes:
            lane.link.poke()
        deadline = time.monotonic() + 15
        for lane in self.lanes:
            if lane.thread.ident is not None:  # else it never started (the learner failed first)
                lane.thread.join(timeout=max(0.1, deadline - time.monotonic()))
            lane.mailbox.drop_pending()
