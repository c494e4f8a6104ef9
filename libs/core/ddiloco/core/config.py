"""Configuration shared by every ddiloco component: protocol constants, mode presets, file loading.

Each component declares a frozen, keyword-only dataclass with a docstring under every field and
validation in ``__post_init__``. Config files are YAML or JSON with one section per component;
``load_section`` builds a dataclass from a section and rejects unknown keys with a clear error,
so a typo in a config file fails loudly instead of being ignored. Command-line flags override a
handful of fields; everything else lives in the file.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import types
import typing
from dataclasses import dataclass
from typing import Any, TypeVar

import yaml

MODES = ("decoupled", "streaming", "diloco")

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class ProtocolConfig:
    """Constants the learners and the synchronizer must agree on (checked at Hello)."""

    mode: str = "decoupled"
    """Mode preset: decoupled (quorum K, grace, no waiting), streaming (all learners, overlap,
    learners wait for the merged fragment), diloco (one fragment, no overlap, learners block)."""
    num_fragments: int = 24
    """P: fragments the model is partitioned into."""
    sync_every: int = 24
    """H: inner steps between two syncs of the same fragment."""
    overlap: int = 2
    """tau: steps between sending a fragment and applying its merged version."""
    max_chunk_bytes: int = 4 * 1024 * 1024 - 64 * 1024
    """Largest chunk of a transfer; gRPC message limits are set from it."""
    global_codec: str = "bf16_zstd"
    """Codec of merged global fragments sent to learners."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.num_fragments < 1 or self.sync_every < 1:
            raise ValueError("num_fragments and sync_every must be >= 1")
        if not 0 <= self.overlap < self.sync_every:
            raise ValueError(f"overlap must satisfy 0 <= tau < H, got tau={self.overlap}, H={self.sync_every}")
        if not 1024 <= self.max_chunk_bytes <= 64 * 1024 * 1024:
            raise ValueError(f"max_chunk_bytes must be in 1 KiB..64 MiB, got {self.max_chunk_bytes}")
        if self.mode == "diloco":
            # The preset: one fragment (the whole model), no overlap. Whatever P/tau were given.
            object.__setattr__(self, "num_fragments", 1)
            object.__setattr__(self, "overlap", 0)


def protocol_for_mode(mode: str, base: ProtocolConfig | None = None) -> ProtocolConfig:
    """The protocol of a mode preset: diloco forces P=1, tau=0; the others keep ``base``'s values."""
    base = base or ProtocolConfig()
    if mode == "diloco":
        return dataclasses.replace(base, mode=mode, num_fragments=1, overlap=0)
    return dataclasses.replace(base, mode=mode)


def read_config_file(path: str | pathlib.Path | None) -> dict[str, Any]:
    """Parse a YAML or JSON config file into a dict (empty for None)."""
    if path is None:
        return {}
    p = pathlib.Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read config file {p}: {exc.strerror}") from exc
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"config file {p} is not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {p} must hold a mapping of sections, got {type(data).__name__}")
    return data


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp) and isinstance(value, dict):
        return build(tp, value, where)  # type: ignore[arg-type]
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(args[0], value, where) if len(args) == 1 else value
    if origin is tuple and isinstance(value, list):
        return tuple(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def build(cls: type[T], values: dict[str, Any], where: str = "") -> T:
    """Instantiate dataclass ``cls`` from a dict, rejecting unknown keys by name."""
    if not isinstance(values, dict):
        raise ValueError(f"config section {where or cls.__name__} must be a mapping")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(
            f"unknown key(s) {', '.join(unknown)} in config section {where or cls.__name__}; "
            f"known: {', '.join(sorted(fields))}")
    kwargs = {k: _coerce(hints[k], v, f"{where}.{k}" if where else k) for k, v in values.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"config section {where or cls.__name__}: {exc}") from exc


def load_section(data: dict[str, Any], section: str, cls: type[T], **overrides: Any) -> T:
    """Build ``cls`` from ``data[section]`` plus non-None ``overrides``."""
    values = dict(data.get(section) or {})
    values.update({k: v for k, v in overrides.items() if v is not None})
    return build(cls, values, section)


def to_dict(obj: Any) -> Any:
    """A dataclass (possibly nested) as plain JSON-able data."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple | list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
