"""Shared test fixtures. Tests drive real servers on 127.0.0.1:0 and real processes."""

from __future__ import annotations

import os

import torch

# Two cores here: keep torch from oversubscribing when tests start several processes.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
os.environ.setdefault("DDILOCO_LOG_JSON", "1")


def pytest_collection_modifyitems(config, items) -> None:  # type: ignore[no-untyped-def]
    """The container tests run last: their engine (and its gigabytes of image layers) is
    stopped and removed when they end, so it never shares the machine with the timing-sensitive
    process tests."""
    items.sort(key=lambda item: "containers" in item.path.relative_to(config.rootpath).parts[:2])
