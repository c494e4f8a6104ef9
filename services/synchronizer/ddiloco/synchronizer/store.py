"""Durable state: every merge is committed to the state dir before it is broadcast.

Layout of the state dir::

    meta.json                         run identity: fragment layout, model fingerprint, protocol
    fragments/p0003/v000000000012.frag  one file per committed version of fragment 3

Why one file per version (rather than an append-only log plus snapshots): fragments merge
independently and concurrently, each commit is small (1/P of the model), and a version file is
self-contained, so a commit is one atomic file creation (write to a temp name, fsync, rename,
fsync the directory) and recovery is "take the newest file that verifies". Nothing ever has to be
replayed or compacted, and the last few versions double as the history that re-anchoring of
stale contributions needs. Files older than the retention are deleted after each commit.

Each file holds a JSON header (fragment, version, merges, sizes) and the fp32 parameters and
outer momentum, followed by an xxh3-128 digest of everything before it. A torn or partly
written file fails the digest and is never loaded; temp files are removed at start-up.
``meta.json`` is written last at genesis, so a state dir without it holds no state. Besides the
layout and the model fingerprint it may carry ``model``: the description of the model the
genesis learner announced (its Hello label ``model``, kept verbatim), so that the trained weights
can be exported with what builds them. State dirs from before that field simply lack it.

One synchronizer per state dir. A second one would delete the first's commits in flight (the
temp files it removes at start-up) and commit its own version N over the first's, so the version
N the first broadcast is not the one on disk. ``StateStore()`` therefore takes an exclusive lock on
``synchronizer.lock`` in the state dir (``flock``, non-blocking) and holds it while the store is
open: a second process on the same dir is refused before it touches anything, with the dir and
the holder's pid and host in the error. The kernel releases the lock when the holder closes the
store or dies, SIGKILL included, so a restart never finds a stale lock; the file itself stays (it
is never deleted, which would let two processes lock two different files). The lock belongs to
the process: stores of one dir within it share it (an engine restarted in the same process). It
needs a filesystem whose locks work across every machine that mounts it: a local disk, a
ReadWriteOnce volume, NFSv4, or NFSv3 with lockd (not mounted ``local_lock=flock`` or ``all``,
which keeps locks on one machine); where locking fails, the start is refused.
Readers (``export``, ``eval``) do not lock and do not use ``StateStore()`` (``export._StateReader``).

Beside ``meta.json`` lies ``fleet.json``: the id of the fleet the state belongs to and how it was
made (``genesis``), written before ``meta.json``, so a state dir with meta has its fleet id.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import mmap
import os
import pathlib
import socket
import struct
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from ddiloco.fragments.partition import Fragment, FragmentLayout, TensorSpec

MAGIC = b"DDLOFRG1"
_LEN = struct.Struct("<Q")
META = "meta.json"
LOCK = "synchronizer.lock"
"""Held (``flock``) by the one process that writes the state dir; holds that process's pid and host."""


class StateError(Exception):
    """The state dir is unusable (belongs to another model, unreadable meta, cannot be locked)."""


class StateLocked(StateError):
    """Another process holds the state dir's lock: a second synchronizer on the same state dir."""


@dataclass
class FragmentRecord:
    fragment: int
    version: int
    params: torch.Tensor
    momentum: torch.Tensor
    merges: int = 0
    committed_at: float = 0.0
    contributors: dict[str, list[int]] | None = None
    """learner id -> [incarnation, sequence] of each contribution merged into this version."""
    paces: dict[str, float] | None = None
    """learner id -> its pace (steps per second) as the claim guard measured it at this commit."""


def fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: pathlib.Path, data: bytes | list[bytes | memoryview]) -> None:
    """Write via a temp file in the same folder, fsync, rename over ``path``, fsync the folder."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    parts = [data] if isinstance(data, bytes | memoryview) else data
    with open(tmp, "wb") as f:
        for part in parts:
            f.write(part)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def layout_to_json(layout: FragmentLayout) -> list[list[list]]:
    return [[[t.name, list(t.shape), t.dtype] for t in frag.tensors] for frag in layout]


def layout_from_json(doc: list[list[list]]) -> FragmentLayout:
    return FragmentLayout(tuple(
        Fragment(p, tuple(TensorSpec(n, tuple(s), d) for n, s, d in tensors)) for p, tensors in enumerate(doc)))


@dataclass
class _HeldLock:
    fd: int
    users: int


_held: dict[tuple[int, int], _HeldLock] = {}
"""This process's state dir locks, by the lock file's (device, inode)."""
_held_guard = threading.Lock()


def _holder(fd: int) -> str:
    """Who holds the lock, as the holder wrote it into the lock file (best effort)."""
    try:
        doc = json.loads(os.pread(fd, 4096, 0) or b"{}")
        since = datetime.datetime.fromtimestamp(float(doc["since"]), datetime.UTC).isoformat(timespec="seconds")
        return f"pid {int(doc['pid'])} on host {doc['host']}, since {since}"
    except (OSError, ValueError, TypeError, KeyError):
        return "holder unknown"


def lock_state_dir(root: pathlib.Path) -> tuple[int, int]:
    """Take (or, in a process that holds it already, share) the exclusive lock of the state dir
    ``root``; the key to give to ``unlock_state_dir``. Raises ``StateLocked`` when another
    process holds it, ``StateError`` when the filesystem cannot lock. A process refused changes
    nothing: the lock file is there already (its holder made it), and only a holder writes it."""
    path = root / LOCK
    for _ in range(3):  # the lock file replaced between our open and our lock: lock the new one
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise StateError(f"state dir {root}: cannot open its lock file {path}: {exc}") from exc
        kept = False
        try:
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            with _held_guard:
                held = _held.get(key)
                if held is not None:
                    held.users += 1
                    return key
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # EWOULDBLOCK: another open file description holds it
                    raise StateLocked(
                        f"state dir {root} is in use by another synchronizer ({_holder(fd)}; lock file {path}); "
                        "two on one state dir would overwrite each other's commits: stop that one, or give "
                        "this one a state dir of its own") from None
                except OSError as exc:  # ENOLCK, EOPNOTSUPP...: the filesystem cannot lock
                    raise StateError(
                        f"state dir {root}: cannot lock {path} ({exc}); the state dir must be on a local disk or a "
                        "filesystem whose locks work across the machines that mount it") from exc
                with contextlib.suppress(FileNotFoundError):
                    now = os.stat(path)
                    if (now.st_dev, now.st_ino) == key:
                        os.ftruncate(fd, 0)
                        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                  "since": time.time()}).encode(), 0)
                        _held[key] = _HeldLock(fd, 1)
                        kept = True
                        return key
        finally:
            if not kept:
                os.close(fd)
    raise StateError(f"state dir {root}: its lock file {path} keeps being replaced; is another tool deleting it?")


def unlock_state_dir(key: tuple[int, int]) -> None:
    """Give back one use of a lock taken by ``lock_state_dir``; the last one releases it."""
    with _held_guard:
        held = _held.get(key)
        if held is None:
            return
        held.users -= 1
        if held.users == 0:
            del _held[key]
            os.close(held.fd)  # releases the flock


class StateStore:
    """Reads and writes the synchronizer's state dir, holding its lock while open (``close``)."""

    _unlock: weakref.finalize | None = None

    def __init__(self, root: str | pathlib.Path, *, keep_versions: int = 5) -> None:
        self.root = pathlib.Path(root)
        self.keep_versions = max(2, keep_versions)
        self.root.mkdir(parents=True, exist_ok=True)
        # Before anything else is touched: the temp files removed below may be another
        # synchronizer's commits in flight.
        key = lock_state_dir(self.root)
        self._unlock = weakref.finalize(self, unlock_state_dir, key)
        (self.root / "fragments").mkdir(exist_ok=True)
        with _held_guard:
            first = _held[key].users == 1
        if first:  # another store of this dir open in this process may have commits in flight
            self._remove_temp_files()

    def close(self) -> None:
        """Release the state dir's lock (once this process's last store of it is closed or
        collected); a later ``StateStore()`` on the dir locks it again."""
        if self._unlock is not None:
            self._unlock()

    def _remove_temp_files(self) -> None:
        for tmp in self.root.rglob(".*.tmp"):
            tmp.unlink(missing_ok=True)

    def _dir(self, fragment: int) -> pathlib.Path:
        return self.root / "fragments" / f"p{fragment:04d}"

    @staticmethod
    def _name(version: int) -> str:
        return f"v{version:012d}.frag"

    # -- meta -----------------------------------------------------------------------------

    def read_meta(self) -> dict | None:
        """The ``meta.json`` document (None before genesis); ``doc.get("model")`` is the model's
        description when the genesis learner sent one, None otherwise (and in older state dirs)."""
        path = self.root / META
        if not path.exists():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise StateError(f"{path} is unreadable: {exc}") from exc

    def write_meta(self, *, layout: FragmentLayout, model_fingerprint: str, protocol: dict,
                   owned: list[int], model: str | None = None, layout_hash: str | None = None,
                   shard: tuple[int, int] = (0, 1)) -> None:
        """``layout_hash``: the whole model's layout (a shard's ``layout`` holds only its own
        fragments; learners announce the whole one); ``shard``: (s, S)."""
        doc = {
            "format": 1,
            "layout_hash": layout_hash or layout.fingerprint,
            "layout": layout_to_json(layout),
            "model_fingerprint": model_fingerprint,
            "protocol": protocol,
            "owned_fragments": owned,
            "created_unix": time.time(),
        }
        if shard != (0, 1):  # additive, like "model": unsharded state dirs stay as they were
            doc["shard"] = f"{shard[0]}/{shard[1]}"
        # Optional and additive: readers use .get("model"), so "format" stays 1 and state dirs
        # written before (or by learners that send no description) load unchanged.
        if model is not None:
            doc["model"] = model
        atomic_write(self.root / META, json.dumps(doc, indent=1).encode())

    # -- fragments ------------------------------------------------------------------------

    def commit(self, record: FragmentRecord) -> pathlib.Path:
        """Durably write one fragment version; prune versions beyond the retention."""
        folder = self._dir(record.fragment)
        folder.mkdir(parents=True, exist_ok=True)
        params = record.params.detach().contiguous().cpu().numpy().astype("<f4", copy=False)
        momentum = record.momentum.detach().contiguous().cpu().numpy().astype("<f4", copy=False)
        header = json.dumps({
            "fragment": record.fragment, "version": record.version, "merges": record.merges,
            "num_values": int(params.size), "committed_at": record.committed_at or time.time(),
            "contributors": record.contributors or {}, "paces": record.paces or {},
        }).encode()
        h = xxhash.xxh3_128()
        parts: list[bytes | memoryview] = [MAGIC, _LEN.pack(len(header)), header,
                                           memoryview(params).cast("B"), memoryview(momentum).cast("B")]
        for part in parts:
            h.update(part)
        parts.append(h.digest())
        path = folder / self._name(record.version)
        atomic_write(path, parts)
        for old in self.versions(record.fragment)[:-self.keep_versions]:
            (folder / self._name(old)).unlink(missing_ok=True)
        return path

    def versions(self, fragment: int) -> list[int]:
        """Committed version numbers of a fragment on disk, ascending (unverified)."""
        folder = self._dir(fragment)
        if not folder.exists():
            return []
        out = []
        for p in folder.glob("v*.frag"):
            try:
                out.append(int(p.stem[1:]))
            except ValueError:
                continue
        return sorted(out)

    def read(self, fragment: int, version: int, num_values: int) -> FragmentRecord | None:
        """Load and verify one version file; None if it is missing, torn or corrupt."""
        return self._read(fragment, version, num_values, momentum=True)

    def read_params(self, fragment: int, version: int, num_values: int) -> torch.Tensor | None:
        """Only the parameters of one verified version file (None if missing, torn or corrupt):
        what re-anchoring a stale contribution needs. The file is mapped, not read into memory,
        so the only allocation is the returned tensor."""
        rec = self._read(fragment, version, num_values, momentum=False)
        return rec.params if rec is not None else None

    def _read(self, fragment: int, version: int, num_values: int, *, momentum: bool) -> FragmentRecord | None:
        path = self._dir(fragment) / self._name(version)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < len(MAGIC) + _LEN.size + 16:
                    return None
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
                    return self._parse(memoryview(blob), fragment, version, num_values, momentum)
        except (OSError, ValueError):
            return None

    @staticmethod
    def _parse(blob: memoryview, fragment: int, version: int, num_values: int,
               with_momentum: bool) -> FragmentRecord | None:
        try:
            if bytes(blob[:len(MAGIC)]) != MAGIC:
                return None
            if xxhash.xxh3_128_digest(blob[:-16]) != bytes(blob[-16:]):
                return None
            (hlen,) = _LEN.unpack_from(blob, len(MAGIC))
            start = len(MAGIC) + _LEN.size
            try:
                header = json.loads(bytes(blob[start:start + hlen]))
            except (json.JSONDecodeError, UnicodeDecodeError):
                return None
            body = start + hlen
            n = int(header["num_values"])
            if n != num_values or header["fragment"] != fragment or header["version"] != version:
                return None
            if len(blob) != body + 8 * n + 16:
                return None
            params = torch.from_numpy(np.frombuffer(blob, dtype="<f4", count=n, offset=body).copy())
            momentum = (torch.from_numpy(np.frombuffer(blob, dtype="<f4", count=n, offset=body + 4 * n).copy())
                        if with_momentum else torch.empty(0))
            paces = header.get("paces")
            return FragmentRecord(fragment, version, params, momentum, int(header.get("merges", 0)),
                                  float(header.get("committed_at", 0.0)), header.get("contributors") or {},
                                  paces if isinstance(paces, dict) else {})
        finally:
            blob.release()

    def load_latest(self, fragment: int, num_values: int) -> tuple[FragmentRecord | None, list[FragmentRecord]]:
        """The newest verifiable version and the older verifiable ones (history, ascending)."""
        latest: FragmentRecord | None = None
        history: list[FragmentRecord] = []
        for version in reversed(self.versions(fragment)):
            rec = self.read(fragment, version, num_values)
            if rec is None:
                continue
            if latest is None:
                latest = rec
            else:
                history.append(rec)
        return latest, list(reversed(history))
