"""``ddiloco export --state-dir DIR --out FILE.safetensors``: write the trained global model as safetensors.

The synchronizer's state dir holds the global model as P flat fp32 fragments (``store``); this
command turns the newest committed version of each into the model's named tensors and writes one
safetensors file that ``safetensors.torch.load_file`` / ``model.load_state_dict`` (or
``ddiloco.training.export_io.load_exported``) reads back.

Design decisions:

- **Read-only, safe next to a running synchronizer.** The state dir is only read: no folder is
  created and no temp file is removed (``StateStore()`` itself would delete ``.*.tmp`` files, which
  on a live state dir are the synchronizer's commits in flight). Every version file is verified by
  its digest; a file pruned or being replaced while we list the folder is simply skipped in favour
  of the next older one that verifies, exactly as recovery does after a crash. Fragments are
  versioned independently, so an export is the newest committed version of *each* fragment, and
  the versions taken are recorded in the metadata.
- **Names and shapes come from meta.json's layout**, which the genesis learner computed from its
  ``named_parameters()``: the file's tensor names are the model's parameter names. Values are the
  synchronizer's fp32 master copy, bit for bit (the per-tensor model dtype is recorded in the
  metadata; loading casts). The outer momentum is optimizer state, not model, and is left out
  unless ``--with-momentum`` asks for it under a prefix that loaders skip.
- **Sharded synchronizers**: each shard's state dir holds its own fragments; ``--state-dir`` may be
  given once per shard and the fragments are put together (fingerprints must agree, every fragment
  must come from exactly one of them). The shards must be of one fleet: every state dir records
  its fleet id (``fleet.json``; one from before fleet ids derives the id it would adopt), and state
  dirs of two fleets (shard 0 of one run, shard 1 of another, same model) are refused. Each
  shard's last commit time and versions are reported, and shards whose last commits are more than
  ``--max-commit-skew-s`` apart (a shard that stopped long before the others, or a state dir kept
  from an earlier attempt) are refused unless ``--accept-skew`` says the mix is meant.
- **Nothing half-written, nothing clobbered.** Every check (state dir, meta.json, a verifying
  version of every fragment, the output folder) happens before anything is written. The file is
  written to a temp name in the output folder, fsynced, and then linked (no ``--force``: the link
  fails if the name exists, so a concurrent writer is never overwritten) or renamed (``--force``)
  into place, and the folder is fsynced. Any failure removes the temp file and exits with 2.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ddiloco.fragments.outer_gradient import scatter
from ddiloco.fragments.partition import Fragment, FragmentLayout, dtype_from_name
from ddiloco.synchronizer.recovery import derived_fleet_id, read_fleet
from ddiloco.synchronizer.store import (
    META,
    FragmentRecord,
    StateError,
    StateStore,
    fsync_dir,
    layout_from_json,
)

FORMAT = "ddiloco-export/1"
"""The ``format`` metadata value; a loader refuses formats it does not know."""
MOMENTUM_PREFIX = "outer_momentum."
"""With ``--with-momentum``, the outer momentum of tensor ``name`` is stored as ``outer_momentum.name``."""
MAX_COMMIT_SKEW_S = 600.0
"""Default bound on how far apart the shards' last commits may be (``--max-commit-skew-s``). A live
fleet's shards each commit every few sync periods, and a finished run's last commits are seconds
apart; ten minutes leaves room for a slow fleet and still catches a shard that stopped (or a state
dir left from another attempt) long before the rest."""


class ExportError(Exception):
    """The export cannot be made; nothing was written."""


class _StateReader(StateStore):
    """A state store that only reads: no folders are created, no temp files are removed."""

    def __init__(self, root: str | os.PathLike[str]) -> None:  # deliberately not super().__init__
        self.root = pathlib.Path(root)
        self.keep_versions = 2


@dataclass
class StateSnapshot:
    """The committed global model read from one or more state dirs."""

    layout: FragmentLayout
    records: dict[int, FragmentRecord]
    model_fingerprint: str
    model: str | None
    protocol: dict
    sources: dict[int, pathlib.Path] = field(default_factory=dict)
    """The state dir each fragment was read from."""
    fleet_id: str = ""
    """The fleet every state dir belongs to."""
    shards: list[ShardReport] = field(default_factory=list)
    """Per state dir: its shard, last commit and versions (in the order given)."""

    @property
    def versions(self) -> dict[int, int]:
        return {p: r.version for p, r in sorted(self.records.items())}


@dataclass(frozen=True)
class ShardReport:
    """What one state dir contributed."""

    root: pathlib.Path
    shard: str
    """"s/S" ("0/1": not sharded)."""
    fleet_id: str
    last_commit_unix: float
    """The newest commit time of the versions taken from it."""
    versions: dict[int, int]

    def line(self) -> str:
        return (f"shard {self.shard} ({self.root}): fleet {self.fleet_id}, last commit {_utc(self.last_commit_unix)}, "
                f"versions {', '.join(f'{p}={v}' for p, v in sorted(self.versions.items()))}")


def _utc(unix: float) -> str:
    return datetime.datetime.fromtimestamp(unix, datetime.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def parse_versions(text: str) -> dict[int, int]:
    """``latest`` (every fragment at its newest verifying version: {}) or ``P=V,P=V`` pins
    (fragments not named are taken at their newest)."""
    text = text.strip()
    if text == "latest":
        return {}
    pins: dict[int, int] = {}
    for item in text.split(","):
        p, sep, v = item.strip().partition("=")
        if not sep or not p.strip().isdigit() or not v.strip().isdigit():
            raise ExportError(f"--fragment-versions: expected 'latest' or FRAGMENT=VERSION[,...], got {text!r}")
        if int(p) in pins:
            raise ExportError(f"--fragment-versions: fragment {int(p)} is given twice")
        pins[int(p)] = int(v)
    return pins


def _read_meta(root: pathlib.Path) -> dict:
    if not root.exists():
        raise ExportError(f"state dir {root} does not exist")
    if not root.is_dir():
        raise ExportError(f"state dir {root} is not a directory")
    try:
        meta = _StateReader(root).read_meta()
    except StateError as exc:
        raise ExportError(str(exc)) from None
    if meta is None:
        raise ExportError(f"state dir {root} has no {META}: it holds no committed state (genesis never finished)")
    missing = [k for k in ("layout", "model_fingerprint", "protocol") if k not in meta]
    if missing:
        raise ExportError(f"{root / META} lacks {', '.join(missing)}: not a ddiloco state dir")
    return meta


def _missing_shards(metas: list[dict[str, Any]]) -> str:
    """", shards [1] of 2 are missing" when the metas say which shards were given."""
    given = [str(m.get("shard", "")) for m in metas]
    if not all(given):
        return ""
    count = int(given[0].partition("/")[2])
    missing = sorted(set(range(count)) - {int(g.partition("/")[0]) for g in given})
    return f"; shards {missing} of {count} are missing" if missing else ""


def _fleet_of(root: pathlib.Path, meta: dict) -> str:
    """The state dir's fleet id (one from before fleet ids: the id it adopts on its next start)."""
    try:
        fleet = read_fleet(root)
    except StateError as exc:
        raise ExportError(str(exc)) from None
    return fleet["fleet_id"] if fleet is not None else derived_fleet_id(meta)


def read_state(state_dirs: list[str | os.PathLike[str]], pins: dict[int, int] | None = None, *,
               max_skew_s: float | None = MAX_COMMIT_SKEW_S) -> StateSnapshot:
    """Every fragment's newest verifying committed version (or the pinned one) from ``state_dirs``
    (one, or one per synchronizer shard). Raises ExportError when any fragment has none, when the
    state dirs are of different fleets, or when their last commits are more than ``max_skew_s``
    apart (None: any skew is accepted)."""
    if not state_dirs:
        raise ExportError("no state dir given")
    roots = [pathlib.Path(d) for d in state_dirs]
    metas = [_read_meta(root) for root in roots]
    fleets = [_fleet_of(root, meta) for root, meta in zip(roots, metas, strict=True)]
    for root, fleet in zip(roots[1:], fleets[1:], strict=True):
        if fleet != fleets[0]:
            raise ExportError(f"state dirs {roots[0]} and {root} belong to different fleets ({fleets[0]} vs {fleet}): "
                              "shards of two runs make no model; give the state dirs of one fleet's shards")
    first = metas[0]
    for root, meta in zip(roots[1:], metas[1:], strict=True):
        if meta["model_fingerprint"] != first["model_fingerprint"]:
            raise ExportError(f"state dirs {roots[0]} and {root} hold different models "
                              f"({first['model_fingerprint']} vs {meta['model_fingerprint']})")
        if len(meta["layout"]) != len(first["layout"]):
            raise ExportError(f"state dirs {roots[0]} and {root} have different numbers of fragments "
                              f"({len(first['layout'])} vs {len(meta['layout'])})")
    counts = {str(m.get("shard", "0/1")).partition("/")[2] for m in metas}
    if len(counts) > 1:
        raise ExportError(f"the state dirs come from synchronizers of different shard counts ({sorted(counts)}): "
                          "give the state dirs of one fleet's shards")
    num_fragments = len(first["layout"])
    fragments: dict[int, Fragment] = {}
    sources: dict[int, pathlib.Path] = {}
    for root, meta in zip(roots, metas, strict=True):
        try:
            layout = layout_from_json(meta["layout"])
        except (TypeError, ValueError) as exc:
            raise ExportError(f"{root / META} has an unreadable layout: {exc}") from None
        # A sharded synchronizer's layout has empty placeholders for the fragments other shards own.
        owned = meta.get("owned_fragments", list(range(num_fragments)))
        for p in owned:
            if not isinstance(p, int) or not 0 <= p < num_fragments:
                raise ExportError(f"{root / META}: owned fragment {p!r} is outside 0..{num_fragments - 1}")
            for t in layout[p].tensors:
                try:
                    dtype_from_name(t.dtype)
                except ValueError as exc:
                    raise ExportError(f"{root / META}: tensor {t.name}: {exc}") from None
            if p in sources:
                raise ExportError(f"fragment {p} is in both {sources[p]} and {root}: give each shard's state dir once")
            fragments[p], sources[p] = layout[p], root
    absent = [p for p in range(num_fragments) if p not in fragments]
    if absent:
        raise ExportError(f"fragments {absent} are in none of the state dirs given (a sharded synchronizer: "
                          f"pass --state-dir once per shard{_missing_shards(metas)})")
    layout = FragmentLayout(tuple(fragments[p] for p in range(num_fragments)))
    names = [t.name for frag in layout for t in frag.tensors]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ExportError(f"the layout in {META} names tensors more than once: {twice[:10]}")
    if len(roots) == 1 and first.get("layout_hash") not in (None, layout.fingerprint):
        raise ExportError(f"{roots[0] / META}: its layout hashes to {layout.fingerprint}, "
                          f"but it records {first['layout_hash']}")
    pins = pins or {}
    unknown = sorted(p for p in pins if not 0 <= p < num_fragments)
    if unknown:
        raise ExportError(f"--fragment-versions names fragments {unknown}; the state has 0..{num_fragments - 1}")
    records: dict[int, FragmentRecord] = {}
    for p in range(num_fragments):
        store = _StateReader(sources[p])
        numel = layout[p].numel
        if p in pins:
            rec = store.read(p, pins[p], numel)
            if rec is None:
                raise ExportError(f"fragment {p} has no verifying version {pins[p]} in {sources[p]} "
                                  f"(versions on disk: {store.versions(p) or 'none'})")
        else:
            # What store.load_latest calls "latest", newest first, without reading (and verifying)
            # every older retained version as well: for a large model that would multiply the I/O.
            # A second listing covers a live synchronizer committing (and pruning) past every
            # version of the first listing while it was being read.
            rec = None
            for _ in range(2):
                for version in reversed(store.versions(p)):
                    if (rec := store.read(p, version, numel)) is not None:
                        break
                if rec is not None:
                    break
            if rec is None:
                raise ExportError(f"fragment {p} has no committed version that verifies in {sources[p]} "
                                  f"(files on disk: {store.versions(p) or 'none'}; torn or corrupt files are "
                                  "never exported)")
        records[p] = rec
    shards = []
    for root, meta, fleet in zip(roots, metas, fleets, strict=True):
        taken = {p: r for p, r in records.items() if sources[p] == root}
        shards.append(ShardReport(root, str(meta.get("shard", "0/1")), fleet,
                                  max(r.committed_at for r in taken.values()), {p: r.version for p, r in taken.items()}))
    newest = max(shards, key=lambda r: r.last_commit_unix)
    oldest = min(shards, key=lambda r: r.last_commit_unix)
    skew = newest.last_commit_unix - oldest.last_commit_unix
    if max_skew_s is not None and skew > max_skew_s:
        raise ExportError(
            f"the shards' last commits are {skew:.0f}s apart, more than --max-commit-skew-s {max_skew_s:g}: shard "
            f"{oldest.shard} last committed at {_utc(oldest.last_commit_unix)}, shard {newest.shard} at "
            f"{_utc(newest.last_commit_unix)} (a shard that stopped long before the others, or a state dir from "
            "another attempt); pass --accept-skew to export them together anyway")
    model = next((m["model"] for m in metas if m.get("model") is not None), None)
    return StateSnapshot(layout, records, first["model_fingerprint"], model, first["protocol"], sources, fleets[0],
                         shards)


def state_tensors(snapshot: StateSnapshot, *, with_momentum: bool = False) -> dict[str, torch.Tensor]:
    """The named fp32 tensors of the snapshot (and ``outer_momentum.``-prefixed momenta if asked)."""
    out: dict[str, torch.Tensor] = {}
    for frag in snapshot.layout:
        rec = snapshot.records[frag.index]
        # Fresh tensors per name (not views of the flat buffer): safetensors refuses shared storage.
        params = {t.name: torch.empty(t.shape, dtype=torch.float32) for t in frag.tensors}
        scatter(frag, rec.params, params)
        out.update(params)
        if with_momentum:
            momenta = {t.name: torch.empty(t.shape, dtype=torch.float32) for t in frag.tensors}
            scatter(frag, rec.momentum, momenta)
            out.update({MOMENTUM_PREFIX + name: m for name, m in momenta.items()})
    return out


def export_metadata(snapshot: StateSnapshot, *, with_momentum: bool = False,
                    now: datetime.datetime | None = None) -> dict[str, str]:
    """The file's string metadata (safetensors metadata values must be strings; structured
    values are JSON)."""
    from ddiloco.core import __version__

    now = now or datetime.datetime.now(datetime.UTC)
    records = snapshot.records
    meta = {
        "format": FORMAT,
        "model_fingerprint": snapshot.model_fingerprint,
        "layout_hash": snapshot.layout.fingerprint,
        "num_fragments": str(snapshot.layout.num_fragments),
        "fragment_versions": json.dumps({str(p): r.version for p, r in sorted(records.items())}),
        "fragment_merges": json.dumps({str(p): r.merges for p, r in sorted(records.items())}),
        "fragment_committed_at": json.dumps({str(p): r.committed_at for p, r in sorted(records.items())}),
        "tensor_dtypes": json.dumps({t.name: t.dtype for frag in snapshot.layout for t in frag.tensors}),
        "protocol": json.dumps(snapshot.protocol, sort_keys=True),
        "exported_at": now.isoformat(timespec="seconds").replace("+00:00", "Z"),
        "software_version": __version__,
        "fleet_id": snapshot.fleet_id,
    }
    if snapshot.model is not None:
        meta["model"] = snapshot.model
    if with_momentum:
        meta["momentum_prefix"] = MOMENTUM_PREFIX
    return meta


def check_destination(out: pathlib.Path, *, force: bool) -> None:
    """Refuse, before any work, an output that cannot or must not be written."""
    parent = out.parent
    if out.is_dir():
        raise ExportError(f"--out {out} is a directory; give a file name")
    if out.exists() and not force:
        raise ExportError(f"--out {out} exists; pass --force to replace it")
    if not parent.exists():
        raise ExportError(f"cannot write {out}: folder {parent} does not exist")
    if not parent.is_dir():
        raise ExportError(f"cannot write {out}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"cannot write {out}: folder {parent} is not writable")


def write_safetensors(out: pathlib.Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str], *,
                      force: bool) -> int:
    """Write atomically (temp file, fsync, link or rename, fsync the folder); returns the file size."""
    from safetensors.torch import save_file

    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        # Create the temp file ourselves first: its mode is what the user's umask gives any new
        # file. safetensors writes owner-only files, which would surprise whoever shares the model.
        fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o666)
        mode = os.fstat(fd).st_mode & 0o777
        os.close(fd)
        save_file(tensors, str(tmp), metadata=metadata)
        os.chmod(tmp, mode)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        size = tmp.stat().st_size
        if force:
            os.replace(tmp, out)
        else:
            try:
                os.link(tmp, out)  # atomic "create if absent": never replaces a file that appeared meanwhile
            except FileExistsError:
                raise ExportError(f"--out {out} exists; pass --force to replace it") from None
            except OSError:  # a file system without hard links: check, then rename
                if out.exists():
                    raise ExportError(f"--out {out} exists; pass --force to replace it") from None
                os.replace(tmp, out)
        fsync_dir(out.parent)
        return size
    except OSError as exc:
        raise ExportError(f"cannot write {out}: {exc}") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


@dataclass(frozen=True)
class ExportSummary:
    out: pathlib.Path
    tensors: int
    parameters: int
    bytes: int
    versions: dict[int, int]
    metadata: dict[str, str]


def export(state_dirs: list[str | os.PathLike[str]], out: str | os.PathLike[str], *,
           pins: dict[int, int] | None = None, force: bool = False, with_momentum: bool = False,
           report: Callable[[str], None] | None = None,
           max_skew_s: float | None = MAX_COMMIT_SKEW_S) -> ExportSummary:
    """Export the committed global model to ``out``; ExportError (nothing written) when it cannot.

    ``report`` receives one line per step (what was found, each shard's last commit, each
    fragment's version). ``max_skew_s``: see ``read_state``."""
    say = report or (lambda _line: None)
    out = pathlib.Path(out)
    check_destination(out, force=force)
    snapshot = read_state(state_dirs, pins, max_skew_s=max_skew_s)
    say(f"{', '.join(str(d) for d in state_dirs)}: {snapshot.layout.num_fragments} fragments, model "
        f"{snapshot.model_fingerprint}, layout {snapshot.layout.fingerprint}"
        + ("" if snapshot.model is not None else " (no model description recorded)"))
    for shard in snapshot.shards:
        say(f"  {shard.line()}")
    if len(snapshot.shards) > 1:
        times = [r.last_commit_unix for r in snapshot.shards]
        say(f"  the shards' last commits are {max(times) - min(times):.0f}s apart"
            + (" (accepted: --accept-skew)" if max_skew_s is None else f" (at most {max_skew_s:g}s allowed)"))
    for p, rec in sorted(snapshot.records.items()):
        frag = snapshot.layout[p]
        say(f"  fragment {p}: version {rec.version} ({rec.merges} merge{'' if rec.merges == 1 else 's'}), "
            f"{len(frag.tensors)} tensors, {frag.numel:,} values")
    tensors = state_tensors(snapshot, with_momentum=with_momentum)
    metadata = export_metadata(snapshot, with_momentum=with_momentum)
    size = write_safetensors(out, tensors, metadata, force=force)
    return ExportSummary(out, len(tensors), sum(frag.numel for frag in snapshot.layout), size,
                         snapshot.versions, metadata)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ddiloco export", description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="Exit status: 0 written; 2 nothing written (the reason is on stderr).")
    parser.add_argument("--state-dir", dest="state_dirs", action="append", required=True, metavar="DIR",
                        help="the synchronizer's state dir (a sharded synchronizer: once per shard)")
    parser.add_argument("--out", required=True, metavar="FILE.safetensors", help="file to write")
    parser.add_argument("--fragment-versions", default="latest", metavar="latest|P=V,...",
                        help="'latest' (default): each fragment's newest verifying version; or pin "
                             "fragments to retained versions, e.g. 0=12,3=11 (the others: newest)")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    parser.add_argument("--with-momentum", action="store_true",
                        help=f"also write the outer momentum, as {MOMENTUM_PREFIX}NAME tensors")
    parser.add_argument("--max-commit-skew-s", type=float, default=MAX_COMMIT_SKEW_S, metavar="S",
                        help="refuse shards whose last commits are more than S seconds apart "
                             f"(default {MAX_COMMIT_SKEW_S:g})")
    parser.add_argument("--accept-skew", action="store_true",
                        help="export shards whose last commits are further apart than --max-commit-skew-s")
    args = parser.parse_args(argv)

    def say(line: str) -> None:
        print(f"ddiloco export: {line}", file=sys.stderr)

    try:
        if not args.max_commit_skew_s >= 0:
            raise ExportError(f"--max-commit-skew-s must be >= 0, got {args.max_commit_skew_s:g}")
        summary = export(args.state_dirs, args.out, pins=parse_versions(args.fragment_versions), force=args.force,
                         with_momentum=args.with_momentum, report=say,
                         max_skew_s=None if args.accept_skew else args.max_commit_skew_s)
    except ExportError as exc:
        say(f"{exc}; nothing written")
        return 2
    versions = list(summary.versions.values())
    say(f"wrote {summary.out}: {summary.tensors} tensors, {summary.parameters:,} parameters, "
        f"{summary.bytes:,} bytes, fragment versions {min(versions)}..{max(versions)}"
        + (" (with outer momentum)" if args.with_momentum else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
