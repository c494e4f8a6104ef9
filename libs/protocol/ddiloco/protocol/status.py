"""``ddiloco status --synchronizer SPEC [--shards S] [--json]``: a synchronizer's live state.

Speaks to a plaintext, TLS or mutual-TLS synchronizer (``--tls-ca``, ``--tls-cert``,
``--tls-key``). A bearer token is read from ``--token-file`` or ``$DDILOCO_TOKEN``, never from the
command line (where ``ps`` would show it).

SPEC is one ``HOST:PORT``, or a sharded synchronizer's shards: a comma-separated list (shard s is
the s-th address) or a pattern holding ``{shard}`` with ``--shards S``
(``ddiloco-synchronizer-{shard}.ddiloco-synchronizer-shards:7000``). Every shard is asked at once,
each within ``--timeout``, and one fleet view is printed:

- the fleet: step = the highest shard's, merges = the sum, token goodput = the shards' goodputs
  weighted by the fragments each owns (every fragment's contributions carry a learner's tokens of
  the same H steps, so a shard receives tokens in proportion to its fragments), rejections summed;
- one row per shard (an unreachable one says why);
- the learners merged across shards: ``live`` is ``yes`` when the learner is live on every shard
  that answered, ``no`` when on none, else on how many; ``seen`` is the longest silence any shard
  reports, ``step`` and ``tok/s`` the highest, the contribution counts summed;
- every fragment, by fragment id, with the shard that serves it.

The shards must agree: the same protocol (P, H, tau, codec, mode) everywhere, each shard serving
only fragments p with p mod S == s, no fragment served twice, no synchronizer answering at two
addresses. Exit status: 0 when every shard answered and they agree; 3 when the shards that answered
disagree (each problem is printed); otherwise 1 when a shard did not answer; 2 for bad arguments.
One address prints exactly the unsharded view.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from typing import Any

import grpc

from ddiloco.core.config import to_dict
from ddiloco.protocol import wire
from ddiloco.protocol.client import get_status
from ddiloco.protocol.credentials import TOKEN_ENV, Credentials, read_token
from ddiloco.protocol.shards import PATTERN, owned, owner, synchronizer_targets

EXIT_UNREACHABLE = 1
EXIT_USAGE = 2
EXIT_INCONSISTENT = 3


def render(s: wire.StatusReply) -> str:
    lines = [
        f"synchronizer {s.synchronizer_id}  mode={s.mode}  state={s.state}  up {s.uptime_s:.0f}s  "
        f"merges={s.merges_total}  quorum K={s.quorum or 'all'}  fleet step {s.fleet_step:.0f}  "
        f"token goodput={s.token_goodput:.1%}",
    ]
    if s.protocol:
        p = s.protocol
        lines.append(f"protocol: P={p.num_fragments} H={p.sync_every} tau={p.overlap} codec={p.global_codec}")
    if s.rejected_by_reason:
        lines.append("rejected: " + ", ".join(f"{k}={v}" for k, v in sorted(s.rejected_by_reason.items())))
    lines.append("")
    lines.append(f"{'learner':<20} {'live':<5} {'seen':>7} {'step':>8} {'tok/s':>9} {'merged':>7} "
                 f"{'rejected':>8} {'supers.':>7}")
    for ls in s.learners:
        lines.append(f"{ls.learner_id:<20} {'yes' if ls.live else 'no':<5} {ls.last_seen_s:>6.1f}s {ls.step:>8} "
                     f"{ls.tokens_per_s:>9.0f} {ls.merged:>7} {ls.rejected:>8} {ls.superseded:>7}")
    lines.append("")
    lines.append(f"{'fragment':>8} {'version':>8} {'round':>6} {'quorum':>6} {'pending':>7} {'grace':>7} "
                 f"{'last merge':>11}")
    now = time.time()
    for f in s.fragments:
        ago = f"{now - f.last_merge_unix:.1f}s ago" if f.last_merge_unix else "-"
        lines.append(f"{f.fragment_id:>8} {f.version:>8} {f.round:>6} {f.last_quorum_size:>6} {f.pending:>7} "
                     f"{f.last_grace_s:>6.2f}s {ago:>11}")
    return "\n".join(lines)


# -- a sharded synchronizer -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ShardReply:
    """What shard ``shard`` at ``address`` answered: its status, or why there is none."""

    shard: int
    address: str
    status: wire.StatusReply | None = None
    error: str = ""


async def ask_shards(targets: list[str], *, credentials: Credentials | None = None,
                     timeout_s: float = 5.0) -> list[ShardReply]:
    """GetStatus of every shard at once (shard s at ``targets[s]``), each within ``timeout_s``."""

    async def one(shard: int, target: str) -> ShardReply:
        try:
            status = await get_status(target, credentials=credentials, timeout_s=timeout_s)
        except grpc.RpcError as exc:
            return ShardReply(shard, target, error=f"{exc.code().name}: {exc.details()}")
        except (OSError, TimeoutError) as exc:
            return ShardReply(shard, target, error=f"{type(exc).__name__}: {exc}")
        return ShardReply(shard, target, status)

    return list(await asyncio.gather(*(one(s, t) for s, t in enumerate(targets))))


def _protocol_key(s: wire.StatusReply) -> tuple[Any, ...] | None:
    p = s.protocol
    return None if p is None else (p.num_fragments, p.sync_every, p.overlap, p.global_codec, p.mode)


def _describe_protocol(s: wire.StatusReply) -> str:
    p = s.protocol
    return "no protocol" if p is None else (f"P={p.num_fragments} H={p.sync_every} tau={p.overlap} "
                                            f"codec={p.global_codec} mode={p.mode}")


def _expected(reply: ShardReply, shards: int) -> list[int] | None:
    """The fragments shard ``reply.shard`` owns under its own protocol (None: it did not say)."""
    if reply.status is None or reply.status.protocol is None:
        return None
    return owned(reply.status.protocol.num_fragments, reply.shard, shards)


def fleet_problems(replies: list[ShardReply]) -> list[str]:
    """Every way the shards that answered disagree with each other or with the shard layout."""
    shards = len(replies)
    up = [r for r in replies if r.status is not None]
    problems: list[str] = []
    if len({_protocol_key(r.status) for r in up if r.status is not None}) > 1:
        problems.append("the shards disagree on the protocol: " + "; ".join(
            f"shard {r.shard} {_describe_protocol(r.status)}" for r in up if r.status is not None))
    by_id: dict[str, list[ShardReply]] = {}
    for r in up:
        assert r.status is not None
        by_id.setdefault(r.status.synchronizer_id, []).append(r)
    for sid, same in sorted(by_id.items()):
        if len(same) > 1:
            problems.append(f"one synchronizer ({sid}) answers for shards {_and(r.shard for r in same)} "
                            f"at {_and(r.address for r in same)}: two addresses for the same shard")
    served: dict[int, list[int]] = {}
    for r in up:
        assert r.status is not None
        ids = [f.fragment_id for f in r.status.fragments]
        for p in ids:
            served.setdefault(p, []).append(r.shard)
        foreign = sorted(p for p in set(ids) if owner(p, shards) != r.shard)
        if foreign:
            problems.append(f"shard {r.shard} ({r.address}) serves fragment(s) {_ids(foreign)}, which are not "
                            f"its own among {shards} shards (p mod {shards} != {r.shard}): is it started as "
                            f"shard {r.shard}/{shards}, and is the address list in shard order?")
        expected = _expected(r, shards)
        if r.status.state == "ready" and expected is not None:
            missing = sorted(set(expected) - set(ids))
            if missing:
                problems.append(f"shard {r.shard} ({r.address}) is ready but does not serve its fragment(s) "
                                f"{_ids(missing)}")
    for p, on in sorted(served.items()):
        if len(on) > 1:
            problems.append(f"fragment {p} is served by shards {_and(on)}")
    return problems


def _and(items: Any) -> str:
    items = [str(i) for i in items]
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else "".join(items)


def _ids(ids: list[int]) -> str:
    return ", ".join(str(p) for p in ids)


def merge_learners(replies: list[ShardReply]) -> list[dict[str, Any]]:
    """One entry per learner id over every shard that answered (see the module's doc)."""
    up = [r for r in replies if r.status is not None]
    seen: dict[str, list[tuple[int, wire.LearnerStatus]]] = {}
    for r in up:
        assert r.status is not None
        for ls in r.status.learners:
            seen.setdefault(ls.learner_id, []).append((r.shard, ls))
    merged = []
    for learner_id, entries in sorted(seen.items()):
        statuses = [ls for _, ls in entries]
        live_on = [s for s, ls in entries if ls.live]
        merged.append({
            "learner_id": learner_id,
            "live": len(live_on) == len(up),
            "live_shards": live_on,
            "known_shards": [s for s, _ in entries],
            "connected_shards": [s for s, ls in entries if ls.connected],
            "last_seen_s": max(ls.last_seen_s for ls in statuses),
            "step": max(ls.step for ls in statuses),
            "tokens_per_s": max(ls.tokens_per_s for ls in statuses),
            "merged": sum(ls.merged for ls in statuses),
            "rejected": sum(ls.rejected for ls in statuses),
            "superseded": sum(ls.superseded for ls in statuses),
            "tokens_merged": sum(ls.tokens_merged for ls in statuses),
            "labels": statuses[0].labels,
        })
    return merged


def fleet_view(replies: list[ShardReply]) -> dict[str, Any]:
    """The merged view of every shard that answered (see the module's doc for each rule)."""
    up = [r for r in replies if r.status is not None]
    statuses = [r.status for r in up if r.status is not None]
    states = {s.state for s in statuses}
    weights = [len(_expected(r, len(replies)) or ()) for r in up]
    goodputs = [s.token_goodput for s in statuses]
    if sum(weights) > 0:
        goodput = sum(w * g for w, g in zip(weights, goodputs, strict=True)) / sum(weights)
    else:
        goodput = sum(goodputs) / len(goodputs) if goodputs else 0.0
    rejected: dict[str, int] = {}
    for s in statuses:
        for reason, n in s.rejected_by_reason.items():
            rejected[reason] = rejected.get(reason, 0) + n
    fragments = sorted(({**to_dict(f), "shard": r.shard} for r in up if r.status is not None
                        for f in r.status.fragments), key=lambda f: (f["fragment_id"], f["shard"]))
    first = statuses[0] if statuses else None
    return {
        "shard_count": len(replies),
        "answering": len(up),
        "state": states.pop() if len(up) == len(replies) and len(states) == 1 else "partial",
        "mode": first.mode if first else "",
        "protocol": to_dict(first.protocol) if first and first.protocol else None,
        "quorum": first.quorum if first else 0,
        "fleet_step": max((s.fleet_step for s in statuses), default=0.0),
        "merges_total": sum(s.merges_total for s in statuses),
        "token_goodput": goodput,
        "rejected_by_reason": dict(sorted(rejected.items())),
        "learners": merge_learners(replies),
        "fragments": fragments,
    }


def fleet_json(spec: str, replies: list[ShardReply], problems: list[str]) -> dict[str, Any]:
    """``--json`` of a sharded synchronizer: every shard as it answered, the merged view, the problems."""
    shards = [{"shard": r.shard, "address": r.address, "reachable": r.status is not None, "error": r.error,
               "owned": _expected(r, len(replies)), "status": to_dict(r.status) if r.status else None}
              for r in replies]
    return {"synchronizer": spec, "shards": shards, "fleet": fleet_view(replies), "problems": problems}


def render_fleet(replies: list[ShardReply], problems: list[str]) -> str:
    view = fleet_view(replies)
    lines = []
    for problem in problems:
        lines.append(f"!! INCONSISTENT SHARDS: {problem}")
    if problems:
        lines.append("")
    lines.append(f"synchronizer: {view['shard_count']} shards, {view['answering']} answering  mode={view['mode']}  "
                 f"state={view['state']}  merges={view['merges_total']}  quorum K={view['quorum'] or 'all'}  "
                 f"fleet step {view['fleet_step']:.0f}  token goodput={view['token_goodput']:.1%}")
    if view["protocol"]:
        p = view["protocol"]
        lines.append(f"protocol: P={p['num_fragments']} H={p['sync_every']} tau={p['overlap']} "
                     f"codec={p['global_codec']}")
    if view["rejected_by_reason"]:
        lines.append("rejected: " + ", ".join(f"{k}={v}" for k, v in view["rejected_by_reason"].items()))
    lines.append("")
    width = max(7, *(len(r.address) for r in replies))
    lines.append(f"{'shard':>5} {'address':<{width}} {'synchronizer':<18} {'state':<17} {'up':>7} {'merges':>7} "
                 f"{'fragments':>9} {'step':>8} {'learners':>9}")
    for r in replies:
        s = r.status
        if s is None:
            lines.append(f"{r.shard:>5} {r.address:<{width}} unreachable: {r.error}")
            continue
        expected = _expected(r, len(replies))
        frags = f"{len(s.fragments)}/{len(expected) if expected is not None else '?'}"
        learners = f"{sum(ls.connected for ls in s.learners)}/{sum(ls.live for ls in s.learners)}"
        lines.append(f"{r.shard:>5} {r.address:<{width}} {s.synchronizer_id:<18} {s.state:<17} {s.uptime_s:>6.0f}s "
                     f"{s.merges_total:>7} {frags:>9} {s.fleet_step:>8.0f} {learners:>9}")
    lines.append("(fragments: served/owned; learners: connected/live)")
    lines.append("")
    answering = view["answering"]
    lines.append(f"{'learner':<20} {'live':<5} {'conn':>5} {'seen':>7} {'step':>8} {'tok/s':>9} {'merged':>7} "
                 f"{'rejected':>8} {'supers.':>7}")
    for ls in view["learners"]:
        n_live = len(ls["live_shards"])
        live = "yes" if ls["live"] else ("no" if n_live == 0 else f"{n_live}/{answering}")
        conn = f"{len(ls['connected_shards'])}/{answering}"
        lines.append(f"{ls['learner_id']:<20} {live:<5} {conn:>5} {ls['last_seen_s']:>6.1f}s {ls['step']:>8} "
                     f"{ls['tokens_per_s']:>9.0f} {ls['merged']:>7} {ls['rejected']:>8} {ls['superseded']:>7}")
    lines.append("")
    lines.append(f"{'fragment':>8} {'shard':>5} {'version':>8} {'round':>6} {'quorum':>6} {'pending':>7} "
                 f"{'grace':>7} {'last merge':>11}")
    now = time.time()
    for f in view["fragments"]:
        ago = f"{now - f['last_merge_unix']:.1f}s ago" if f["last_merge_unix"] else "-"
        lines.append(f"{f['fragment_id']:>8} {f['shard']:>5} {f['version']:>8} {f['round']:>6} "
                     f"{f['last_quorum_size']:>6} {f['pending']:>7} {f['last_grace_s']:>6.2f}s {ago:>11}")
    return "\n".join(lines)


def _fleet(args: argparse.Namespace, targets: list[str], creds: Credentials) -> int:
    replies = asyncio.run(ask_shards(targets, credentials=creds, timeout_s=args.timeout))
    problems = fleet_problems(replies)
    print(json.dumps(fleet_json(args.synchronizer, replies, problems), indent=2) if args.json
          else render_fleet(replies, problems))
    for r in replies:
        if r.status is None:
            print(f"ddiloco status: cannot reach shard {r.shard} ({r.address}): {r.error}", file=sys.stderr)
    for problem in problems:
        print(f"ddiloco status: inconsistent shards: {problem}", file=sys.stderr)
    if problems:
        return EXIT_INCONSISTENT
    return EXIT_UNREACHABLE if any(r.status is None for r in replies) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddiloco status", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--synchronizer", required=True,
                        help=f"HOST:PORT; a sharded synchronizer: one address per shard, comma-separated, shard 0 "
                             f"first, or a pattern holding {PATTERN} with --shards")
    parser.add_argument("--shards", type=int, help=f"number of shards a {PATTERN} pattern expands to")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    parser.add_argument("--tls-ca", help="PEM CA bundle that verifies the synchronizer (enables TLS)")
    parser.add_argument("--tls-cert", help="PEM client certificate (mutual TLS)")
    parser.add_argument("--tls-key", help="PEM client key (mutual TLS)")
    parser.add_argument("--token-file", help=f"file holding a bearer token (default: ${TOKEN_ENV})")
    args = parser.parse_args(argv)
    try:
        targets = synchronizer_targets(args.synchronizer, args.shards)
        creds = Credentials(tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
                            token=read_token(args.token_file))
        if len(targets) > 1:
            return _fleet(args, targets, creds)
        status = asyncio.run(get_status(targets[0], credentials=creds, timeout_s=args.timeout))
    except ValueError as exc:
        print(f"ddiloco status: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except grpc.RpcError as exc:
        print(f"ddiloco status: cannot reach {targets[0]}: {exc.code().name}: {exc.details()}",
              file=sys.stderr)
        return EXIT_UNREACHABLE
    print(json.dumps(to_dict(status), indent=2) if args.json else render(status))
    return 0
