"""Benchmarks of ddiloco's hot paths; each prints a table and writes JSON (``ddiloco bench NAME``)."""

import json
import pathlib
from typing import Any


def save_result(result: dict[str, Any], out: str | pathlib.Path) -> pathlib.Path:
    """Write a benchmark's JSON results to ``out`` (its folder made as needed); returns the path."""
    path = pathlib.Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
