"""Every JSON Lines event ddiloco writes, defined once: its log, its name and its fields.

Four logs hold events. Each line is one JSON object: ``event`` (its name), ``t`` (Unix seconds)
and the log's envelope, then the event's own fields.

- ``learner``: a learner's log (``--event-log``; ``ddiloco run`` writes ``learners/<id>.jsonl``,
  and its ``dp`` mode ``learners/dp.jsonl``). Envelope: ``learner_id``, ``incarnation``.
- ``synchronizer``: the synchronizer's log (``synchronizer.jsonl``); ``ddiloco run`` appends
  ``sync_stop`` when it kills the synchronizer.
- ``faults``: the faults a chaos plan injected (``faults.jsonl``).
- ``torchft_replica``: a replica of ``ddiloco bench torchft``. Envelope: ``replica``.

Writers check each event against ``REGISTRY`` with ``validate``: a dict lookup and two set
comparisons. A mismatch raises ``EventSchemaError`` where ``DDILOCO_STRICT_EVENTS=1`` (the test
suite sets it, so a renamed or forgotten field fails loudly); elsewhere it is logged once per
event and problem and the line is written as it is, since a service must not stop training over
a log line. Readers compare ``e["event"]`` with the name constants below. ``docs/events.md`` is
generated from this registry (``reference_markdown``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

STRICT_ENV = "DDILOCO_STRICT_EVENTS"
"""Set to ``1``: a writer raises on an event that does not match its spec (else it logs)."""

# -- logs ---------------------------------------------------------------------------------------

LEARNER_LOG = "learner"
SYNCHRONIZER_LOG = "synchronizer"
FAULTS_LOG = "faults"
TORCHFT_LOG = "torchft_replica"

# -- event names --------------------------------------------------------------------------------

# learner log
START = "start"
STEP = "step"
EVAL = "eval"
END = "end"
SEND = "send"
SKIP = "skip"
RESULT = "result"
DROPPED = "dropped"
APPLY = "apply"
HEAL = "heal"
CONNECT = "connect"
DISCONNECT = "disconnect"
POISONED = "poisoned"
FLUSHED = "flushed"
COMM_RESTART = "comm_restart"
# synchronizer log
SYNC_START = "sync_start"
SYNC_STOP = "sync_stop"
MERGE = "merge"
REJECT = "reject"
NORM_CLIP = "norm_clip"
CLAIM_BOUND = "claim_bound"
# faults log
FAULT = "fault"
# torchft replica log (with STEP and END)
READY = "ready"
SYNC = "sync"
PHASE = "phase"
ERROR = "error"


class EventSchemaError(ValueError):
    """An event that its log's registry does not define, or whose fields do not match it."""


@dataclass(frozen=True)
class LogSpec:
    name: str
    doc: str
    envelope: dict[str, str]
    """Fields every event of the log carries besides ``event`` and ``t`` (name -> meaning)."""


@dataclass(frozen=True)
class EventSpec:
    log: str
    name: str
    doc: str
    required: dict[str, str]
    """Fields every such event carries (name -> meaning), the log's envelope excluded."""
    optional: dict[str, str] = field(default_factory=dict)
    """Fields some writers or some occasions add."""
    open: bool = False
    """Fields beyond these are allowed (``start``: what a caller of ``join`` adds)."""
    keys_required: frozenset[str] = field(init=False, repr=False, compare=False)
    keys_allowed: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        envelope = set(LOGS[self.log].envelope)
        object.__setattr__(self, "keys_required", frozenset(envelope | set(self.required)))
        object.__setattr__(self, "keys_allowed", frozenset(self.keys_required | set(self.optional)))

    def problems(self, keys: Iterable[str]) -> list[str]:
        """What is wrong with an event of this spec carrying ``keys`` (besides ``event``, ``t``)."""
        keys = set(keys)
        out = [f"missing field {k!r}" for k in sorted(self.keys_required - keys)]
        if not self.open:
            out += [f"unknown field {k!r}" for k in sorted(keys - self.keys_allowed)]
        return out


LOGS: dict[str, LogSpec] = {s.name: s for s in (
    LogSpec(LEARNER_LOG, "A learner's log: `--event-log` of `ddiloco learner`; `ddiloco run` writes "
            "`learners/<learner id>.jsonl` (its `dp` mode `learners/dp.jsonl`). A restarted learner appends "
            "to the same file, beginning with a new `start`.",
            {"learner_id": "the learner's id", "incarnation": "this process's incarnation of the learner"}),
    LogSpec(SYNCHRONIZER_LOG, "The synchronizer's log: `--event-log` of `ddiloco synchronizer` (`synchronizer.jsonl` "
            "in a run folder); the merge log that goodput accounting reads.", {}),
    LogSpec(FAULTS_LOG, "`faults.jsonl` in a run folder: each fault a chaos plan injected.", {}),
    LogSpec(TORCHFT_LOG, "`replica-<r>.<incarnation>.jsonl` of `ddiloco bench torchft`: one torchft replica.",
            {"replica": "the replica group's index"}),
)}

_E = EventSpec
_SPECS: tuple[EventSpec, ...] = (
    # -- learner -------------------------------------------------------------------------------
    _E(LEARNER_LOG, START, "the learner joined the fleet (its incarnation begins)",
       {"num_fragments": "fragments of the model", "fragment_sizes": "numel per fragment",
        "params": "parameters of the model", "genesis": "whether this learner uploaded the global model",
        "mode": "decoupled / streaming / diloco; dp from `ddiloco run --mode dp`"},
       {"start_step": "the step training starts after", "versions": "fragment -> global version it starts from",
        "apply_policy": "how merges are applied",
        "apply_at": "when merges of its contributions are applied: tau (steps after the send) or arrival",
        "config": "the learner's config, secrets redacted",
        "shard": "data shard index", "speed": "its `--speed`"},
       open=True),
    _E(LEARNER_LOG, STEP, "an inner step ended (`t` is its end)",
       {"step": "the step", "loss": "its training loss", "tokens": "tokens this process trained on so far",
        "step_s": "seconds the step computed", "blocked_s": "seconds blocked on the network before it"}),
    _E(LEARNER_LOG, EVAL, "the local model evaluated",
       {"step": "the step", "tokens": "tokens so far", "loss": "evaluation loss"}),
    _E(LEARNER_LOG, END, "training ended (the final evaluation and the last results are logged after)",
       {"step": "the last step", "tokens": "tokens so far", "wall_s": "seconds since training started",
        "blocked_s": "seconds blocked on the network in all"},
       {"eval_loss": "the final evaluation loss, dp mode"}),
    _E(LEARNER_LOG, SEND, "a contribution handed over for sending: the progress of steps `from_step..to_step`",
       {"step": "the step", "fragment": "its fragment", "sequence": "its sequence number",
        "base_version": "the global version it was computed on", "tokens": "tokens it claims",
        "steps": "inner steps it carries", "from_step": "first step covered", "to_step": "last step covered",
        "round": "the round that asked for it; 0: due by the schedule"},
       {"hand_over": "whether it is the learner's last progress on the fragment, handed over as it finishes "
                     "or drains (sent unflagged where it replaces an unsent contribution of the same base)"}),
    _E(LEARNER_LOG, SKIP, "a request left unanswered because the previous answer awaits its merge",
       {"step": "the step", "fragment": "the fragment", "round": "the round asked", "reason": "why"}),
    _E(LEARNER_LOG, RESULT, "the synchronizer's answer to a contribution",
       {"sequence": "the contribution", "fragment": "its fragment",
        "outcome": "merged / rejected / superseded", "version": "version it merged into",
        "reason": "rejection reason", "weight": "its merge weight", "staleness": "versions behind when merged",
        "detail": "free text"}),
    _E(LEARNER_LOG, DROPPED, "a contribution dropped by the learner itself",
       {"sequence": "the contribution", "fragment": "its fragment", "reason": "why"}),
    _E(LEARNER_LOG, APPLY, "a merged fragment applied to the local model",
       {"step": "the step it applies before", "fragment": "the fragment", "version": "its global version",
        "policy": "the apply policy used", "resync": "whether it came from a resync"}),
    _E(LEARNER_LOG, HEAL, "fragments fetched again from the global model",
       {"step": "the step", "fragments": "the fragments", "reason": "why"}),
    _E(LEARNER_LOG, CONNECT, "connected to a synchronizer",
       {"synchronizer_id": "its id", "state": "its state",
        "restarted": "whether it is another synchronizer than the last one connected"},
       {"synchronizer_shard": "which shard, `s/S` (a sharded synchronizer)"}),
    _E(LEARNER_LOG, DISCONNECT, "the stream to the synchronizer broke", {"synchronizer_id": "its id"},
       {"synchronizer_shard": "which shard, `s/S` (a sharded synchronizer)"}),
    _E(LEARNER_LOG, POISONED, "fault injection turned every parameter NaN", {"step": "the step"}),
    _E(LEARNER_LOG, COMM_RESTART, "the communication process (`learner.comm: process`) died and another was started",
       {"exit_code": "how the dead one ended (negative: the signal)", "restarts": "restarts so far",
        "resent": "contributions handed to the new one (not answered yet)", "pid": "the new one's pid"}),
    _E(LEARNER_LOG, FLUSHED, "the learner closed after waiting for its last answers",
       {"all_answered": "whether every contribution was answered", "pending_s": "seconds waited"}),
    # -- synchronizer --------------------------------------------------------------------------
    _E(SYNCHRONIZER_LOG, SYNC_START, "the synchronizer (re)started", {"synchronizer_id": "its id"}),
    _E(SYNCHRONIZER_LOG, SYNC_STOP, "the synchronizer was stopped or killed (written by `ddiloco run`)", {}),
    _E(SYNCHRONIZER_LOG, MERGE, "a fragment merged",
       {"fragment": "the fragment", "version": "the new version", "round": "its round",
        "wait_s": "from the round's request to the merge", "quorum": "contributions merged",
        "learners": "their learner ids", "grace_s": "grace waited", "sync_s": "the round's sync time",
        "staleness": "each contribution's staleness", "scale": "the outer step's scale",
        "merge_s": "seconds the merge computed", "commit_s": "seconds its state commit took",
        "cpu_s": "the process's CPU seconds so far",
        "contributions": "`[learner_id, incarnation, sequence]` of each contribution merged"},
       {"rx_bytes": "chunk payload bytes the process received so far",
        "tx_bytes": "chunk payload bytes it sent so far",
        "momentum": "the outer step's momentum (0 for a round of hand-overs only, unless "
                    "`synchronizer.hand_over_momentum`)"}),
    _E(SYNCHRONIZER_LOG, REJECT, "a contribution rejected",
       {"fragment": "its fragment", "learner": "its learner id", "incarnation": "its incarnation",
        "sequence": "its sequence number", "reason": "the reason"}),
    _E(SYNCHRONIZER_LOG, NORM_CLIP, "a contribution clipped by the norm guard",
       {"learner_id": "its learner", "fragment": "its fragment", "sequence": "its sequence number",
        "detail": "the norms"}),
    _E(SYNCHRONIZER_LOG, CLAIM_BOUND, "a contribution merged with fewer steps or tokens than it claimed: the "
                                      "claim guard's bound, or the weight guard's with action bound",
       {"learner_id": "its learner", "fragment": "its fragment", "sequence": "its sequence number",
        "steps": "the steps it is merged with", "tokens": "the tokens it is merged with",
        "detail": "what it claimed and why that was cut"}),
    # -- faults --------------------------------------------------------------------------------
    _E(FAULTS_LOG, FAULT, "a fault injected: the plan's fault event, and whether it worked",
       {"kind": "what broke", "at_s": "due seconds after the start, or null", "at_step": "due step, or null",
        "target": "the learner", "duration_s": "how long it lasts", "restart_after_s": "restart delay, or null",
        "new_id": "restarted under a new id", "net": "the network fault", "value": "the network fault's value",
        "ok": "whether it was injected"},
       {"error": "why it could not be"}),
    # -- torchft replica -----------------------------------------------------------------------
    _E(TORCHFT_LOG, READY, "the replica is built and waits for the go", {"pid": "its process id"}),
    _E(TORCHFT_LOG, SYNC, "torchft's commit vote",
       {"ok": "committed", "participants": "replicas in the quorum", "manager_step": "the manager's step"}),
    _E(TORCHFT_LOG, PHASE, "one timed phase of the overhead mode",
       {"kind": "off / on", "repeat": "the repeat", "steps": "steps timed", "seconds": "their seconds",
        "syncs": "syncs in the phase", "commits": "commits in it", "min_participants": "the smallest quorum"}),
    _E(TORCHFT_LOG, STEP, "an inner step (run mode)", {"step": "the step", "step_s": "its seconds"}),
    _E(TORCHFT_LOG, END, "the replica finished", {}),
    _E(TORCHFT_LOG, ERROR, "the replica failed", {"error": "the exception"}),
)
del _E

REGISTRY: dict[str, dict[str, EventSpec]] = {log: {s.name: s for s in _SPECS if s.log == log} for log in LOGS}
"""Log -> event name -> its spec."""


def spec(log: str, event: str) -> EventSpec:
    try:
        return REGISTRY[log][event]
    except KeyError:
        raise EventSchemaError(f"no event {event!r} in the {log} log") from None


def problems(log: str, event: str, keys: Iterable[str]) -> list[str]:
    """What is wrong with ``event`` carrying ``keys`` (``event`` and ``t`` excluded) in ``log``."""
    found = REGISTRY[log].get(event)
    if found is None:
        return [f"unknown event {event!r}"]
    return found.problems(keys)


def strict() -> bool:
    return os.environ.get(STRICT_ENV) == "1"


_warned: set[tuple[str, str, str]] = set()


def validate(log: str, event: str, keys: Iterable[str]) -> None:
    """Check one event before it is written: raises ``EventSchemaError`` when strict, else logs a
    warning (once per log, event and problem)."""
    found = REGISTRY[log].get(event)
    if found is not None:
        keys = keys if isinstance(keys, (set, frozenset)) else set(keys)
        if found.keys_required <= keys and (found.open or keys <= found.keys_allowed):
            return
    wrong = problems(log, event, keys)
    message = f"{log} log, event {event!r}: " + "; ".join(wrong)
    if strict():
        raise EventSchemaError(message)
    key = (log, event, message)
    if key not in _warned:
        _warned.add(key)
        from ddiloco.core.logs import get_logger

        get_logger("ddiloco.events").warning("event does not match its schema", detail=message)


def record(log: str, event: str, fields: Mapping[str, Any], *, t: float) -> dict[str, Any]:
    """The line for ``event``, validated: ``event``, ``t``, then ``fields`` (envelope included)."""
    validate(log, event, fields.keys())
    return {"event": event, "t": t, **fields}


def names(log: str) -> frozenset[str]:
    return frozenset(REGISTRY[log])


# -- the reference ------------------------------------------------------------------------------

DOC_BEGIN = "<!-- events: generated from ddiloco.core.events, do not edit by hand -->"
DOC_END = "<!-- events: end -->"


def reference_markdown() -> str:
    """The events reference (the generated part of ``docs/events.md``)."""
    out = [DOC_BEGIN]
    for log in LOGS.values():
        out += ["", f"### `{log.name}`", "", log.doc]
        if log.envelope:
            out += ["", "Every event also carries " + ", ".join(f"`{k}` ({v})" for k, v in log.envelope.items())
                    + "."]
        out += ["", "| event | meaning | fields | optional fields |", "|---|---|---|---|"]
        for s in REGISTRY[log.name].values():
            req = ", ".join(f"`{k}` ({v})" for k, v in s.required.items()) or "—"
            opt = ", ".join(f"`{k}` ({v})" for k, v in s.optional.items())
            if s.open:
                opt = (opt + ", " if opt else "") + "any other field the caller of `join` passes"
            out.append(f"| `{s.name}` | {s.doc} | {req} | {opt or '—'} |")
    out += ["", DOC_END]
    return "\n".join(out) + "\n"


__all__ = ["APPLY", "CLAIM_BOUND", "COMM_RESTART", "CONNECT", "DISCONNECT", "DOC_BEGIN", "DOC_END", "DROPPED", "END", "ERROR", "EVAL", "FAULT",
           "FAULTS_LOG", "FLUSHED", "HEAL", "LEARNER_LOG", "LOGS", "MERGE", "NORM_CLIP", "PHASE", "POISONED", "READY",
           "REGISTRY", "REJECT", "RESULT", "SEND", "SKIP", "START", "STEP", "STRICT_ENV", "SYNC", "SYNCHRONIZER_LOG",
           "SYNC_START", "SYNC_STOP", "TORCHFT_LOG", "EventSchemaError", "EventSpec", "LogSpec", "names",
           "problems", "record", "reference_markdown", "spec", "strict", "validate"]
