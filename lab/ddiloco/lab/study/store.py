"""The study's results folder: one JSON file per case, written once, claimed while it runs.

Decisions:

- **Resumable by construction.** A case's result is ``<id>.json``, written to a temporary file,
  flushed to disk and renamed, so a study killed at any moment leaves whole results or none; a
  rerun skips every case whose file holds the same settings and runs the rest.
- **Several workers share a folder.** A case being run is claimed by ``<id>.lock`` (created
  exclusively, holding the worker's pid); another worker skips it. A claim whose process is gone
  (a killed worker) is taken over, so nothing stays claimed for ever.
- **A result computed under other settings is never reused**: a file whose settings differ (a
  default changed since) is reported and left alone, not overwritten, until it is moved away.
  The data order, the final evaluation's set and the Python version are settings too; a result
  saved before they were recorded reads as Python ``unknown``, so it matches no case that can
  run (``Case.matches``): reindexing names it by its settings (``...-eval_batches_32-
  python_unknown``), its content untouched.
- **Names follow the defaults.** A case's id names only what differs from the defaults, so when a
  default changes, ``reindex`` renames every result to the id its own settings have now (the old
  default's result becomes ``decoupled-warmup_steps_30...``, freeing ``decoupled.json`` for the
  new default); both study commands run it first. A name already taken is left alone and reported.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
from collections.abc import Iterator
from typing import Any

from ddiloco.lab.procs import running
from ddiloco.lab.study.case import Case, saved_settings


class ResultsError(RuntimeError):
    """A results file is unreadable or holds another case's settings."""


class Results:
    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = pathlib.Path(folder)

    def path(self, case: Case) -> pathlib.Path:
        return self.folder / f"{case.id}.json"

    def get(self, case: Case) -> dict[str, Any] | None:
        """The saved result of ``case``; None when there is none. Raises ``ResultsError`` for a
        damaged file or one holding other settings."""
        path = self.path(case)
        try:
            saved = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise ResultsError(f"{path}: unreadable result ({exc}); move it away to run the case again") from exc
        if not isinstance(saved, dict) or not case.matches(saved):
            raise ResultsError(f"{path}: holds a result computed with other settings (a default changed?); "
                               "move it away to run the case again")
        return saved

    def save(self, case: Case, result: dict[str, Any]) -> pathlib.Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path(case)
        tmp = path.with_suffix(f".tmp.{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(json.dumps(result, indent=1) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path

    def reindex(self) -> list[tuple[pathlib.Path, pathlib.Path]]:
        """Rename each result whose file name is not the id of its settings under today's defaults;
        returns the (old, new) paths renamed. A result whose settings no longer make a case (a
        setting since removed) or whose new name is taken stays where it is."""
        moved: list[tuple[pathlib.Path, pathlib.Path]] = []
        while True:  # a name freed by one rename may be the target of another: until nothing moves
            before = len(moved)
            for path in sorted(self.folder.glob("*.json")):
                try:
                    saved = json.loads(path.read_text())
                    case = Case(**saved_settings(saved))
                except (OSError, ValueError, KeyError, TypeError):
                    continue
                target = self.path(case)
                if target != path and not target.exists():
                    os.replace(path, target)
                    moved.append((path, target))
            if len(moved) == before:
                return moved

    def all(self) -> list[dict[str, Any]]:
        """Every saved result (damaged files are skipped by the caller's choice: they raise)."""
        out = []
        for path in sorted(self.folder.glob("*.json")):
            try:
                out.append(json.loads(path.read_text()))
            except ValueError as exc:
                raise ResultsError(f"{path}: unreadable result ({exc})") from exc
        return out

    @contextlib.contextmanager
    def claim(self, case: Case) -> Iterator[bool]:
        """Claim ``case`` for this process: yields True when it may run it (the claim is released
        on leaving), False when a live worker holds it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        lock = self.folder / f"{case.id}.lock"
        for _ in range(2):
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if _holder_alive(lock):
                    yield False
                    return
                with contextlib.suppress(FileNotFoundError):
                    lock.unlink()
                continue
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            try:
                yield True
            finally:
                with contextlib.suppress(FileNotFoundError):
                    lock.unlink()
            return
        yield False


def _holder_alive(lock: pathlib.Path) -> bool:
    try:
        pid = int(lock.read_text().strip() or "0")
    except (OSError, ValueError):
        return False
    return pid > 0 and running(pid)
