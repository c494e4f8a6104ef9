"""Shared test fixtures. Tests drive real servers on 127.0.0.1:0 and real processes."""

from __future__ import annotations

import os

import torch

# Two cores here: keep torch from oversubscribing when tests start several processes.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
os.environ.setdefault("DDILOCO_LOG_JSON", "1")
