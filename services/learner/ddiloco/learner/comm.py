"""The learner's communication: what the training thread holds to reach the synchronizer.

Training never touches the network. ``Comm`` owns a ``Mailbox`` (``mailbox.py``: the locked
hand-off of contributions, requests and merged fragments between the two threads) and the
communication thread, which runs a ``Link`` (``session.py``: the gRPC stream, its sessions and
reconnects). At step boundaries training picks up the synchronizer's requests
(``take_requests``: which fragments to send now), hands contributions to ``submit``
(non-blocking) and picks up merged fragments with ``take_arrivals``. Modes that wait by design
(streaming, diloco) call ``wait_arrival`` with a timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from ddiloco.fragments.partition import FragmentLayout
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.events import EventLog
from ddiloco.learner.mailbox import Arrival, Mailbox, Outgoing
from ddiloco.learner.session import Link


class Comm:
    def __init__(self, cfg: LearnerConfig, *, layout: FragmentLayout, model_fingerprint: str, incarnation: int,
                 events: EventLog, held: Callable[[], dict[int, int]],
                 genesis_values: Callable[[], dict[int, torch.Tensor]],
                 labels: dict[str, str] | None = None) -> None:
        self.mailbox = Mailbox(events)
        self._stop = threading.Event()
        self.link = Link(cfg, mailbox=self.mailbox, stop=self._stop, layout=layout,
                         model_fingerprint=model_fingerprint, incarnation=incarnation, events=events, held=held,
                         genesis_values=genesis_values, labels=labels)
        self.stats = self.link.stats
        self.join = self.link.join
        self.draining = self.link.draining
        self.connected = self.link.connected
        self.hurry = threading.Event()
        """Set by a second stop request: ``flush`` stops waiting (what is unsent or unanswered is dropped)."""
        self._thread = threading.Thread(target=self.link.run, name=f"comm-{self.link.learner_id}", daemon=True)

    @property
    def bytes_sent(self) -> int:
        return self.link.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.link.bytes_received

    def start(self) -> None:
        self._thread.start()

    def submit(self, out: Outgoing) -> None:
        """Queue a contribution (see ``Mailbox.submit``) and wake the sender."""
        self.mailbox.submit(out)
        self.link.poke()

    def take_requests(self) -> dict[int, int]:
        """Fragments the synchronizer asked for since the last call: fragment -> round."""
        return self.mailbox.take_requests()

    def take_heals(self) -> set[int]:
        """Fragments whose contributions were refused for their content too often in a row."""
        return self.mailbox.take_heals()

    def resync(self, fragments: tuple[int, ...]) -> None:
        """Fetch the newest global version of ``fragments`` and deliver it as a resync arrival."""
        self.mailbox.want_resync(fragments)
        self.link.poke()

    def training_done(self) -> None:
        """Training ended: tell the synchronizer at once (heartbeat), so no round waits for us."""
        self.stats.training_done = True
        self.beat_now()

    def beat_now(self) -> None:
        """Send a heartbeat now rather than at the next interval (the pace became known, training ended)."""
        self.link.beat_now()

    def take_arrivals(self) -> dict[int, Arrival]:
        return self.mailbox.take_arrivals()

    def peek_version(self, fragment: int) -> int | None:
        return self.mailbox.peek_version(fragment)

    def wait_arrival(self, fragment: int, newer_than: int, timeout_s: float) -> bool:
        """Block until a global of ``fragment`` newer than ``newer_than`` has arrived (or timeout)."""
        return self.mailbox.wait_arrival(fragment, newer_than, timeout_s, self._stop)

    def pending(self) -> int:
        return self.mailbox.pending()

    def flush(self, timeout_s: float) -> bool:
        """Wait until every submitted contribution has been answered (or timeout, or ``hurry``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.hurry.is_set():
            if self.pending() == 0:
                return True
            time.sleep(0.05)
        return self.pending() == 0

    def stop(self, goodbye: str = "finished") -> None:
        self.link.goodbye = goodbye
        self._stop.set()
        self.link.poke()
        if self._thread.ident is not None:  # else it never started (the learner failed first)
            self._thread.join(timeout=15)
        self.mailbox.drop_pending()
