"""``ddiloco status --synchronizer HOST:PORT [--json]``: a synchronizer's live state.

Speaks to a plaintext, TLS or mutual-TLS synchronizer (``--tls-ca``, ``--tls-cert``,
``--tls-key``). A bearer token is read from ``--token-file`` or ``$DDILOCO_TOKEN``, never from the
command line (where ``ps`` would show it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import grpc

from ddiloco.core.config import to_dict
from ddiloco.protocol import wire
from ddiloco.protocol.client import get_status
from ddiloco.protocol.credentials import TOKEN_ENV, Credentials, read_token


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddiloco status", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--synchronizer", required=True, help="HOST:PORT")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    parser.add_argument("--tls-ca", help="PEM CA bundle that verifies the synchronizer (enables TLS)")
    parser.add_argument("--tls-cert", help="PEM client certificate (mutual TLS)")
    parser.add_argument("--tls-key", help="PEM client key (mutual TLS)")
    parser.add_argument("--token-file", help=f"file holding a bearer token (default: ${TOKEN_ENV})")
    args = parser.parse_args(argv)
    try:
        creds = Credentials(tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
                            token=read_token(args.token_file))
        status = asyncio.run(get_status(args.synchronizer, credentials=creds, timeout_s=args.timeout))
    except ValueError as exc:
        print(f"ddiloco status: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(f"ddiloco status: cannot reach {args.synchronizer}: {exc.code().name}: {exc.details()}",
              file=sys.stderr)
        return 1
    print(json.dumps(to_dict(status), indent=2) if args.json else render(status))
    return 0
