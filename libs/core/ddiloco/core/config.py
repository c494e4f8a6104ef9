"""Configuration shared by every ddiloco component: typed sections of one document, clear errors.

Decisions:

- **Typed, strict, one docstring per field.** Each component declares its configuration as a
  frozen, keyword-only pydantic dataclass in strict mode (``STRICT``) with a docstring under every
  field; ``use_attribute_docstrings`` makes that docstring the field's schema description too. A
  wrong type is refused with the field's path and the expected type: ``"fast"`` is not a float,
  ``2.5`` is not an int, and a string is not a list of patterns (a plain dataclass iterated
  ``"*embed*"`` character by character, so ``*`` matched every tensor). Rules beyond types live in
  ``__post_init__``. Pydantic *dataclasses* rather than models, so configs stay dataclasses:
  ``dataclasses.replace`` re-validates, and code that builds a config in Python is checked exactly
  like a file.
- **One document.** A config file (YAML or JSON) holds one section per component; ``SECTIONS``
  lists them, and any other top-level key is refused by name (``synchroniser:`` fails instead of
  being ignored). Sections are validated in JSON mode: lists become tuples and integers are
  accepted where a float is expected; nothing else is coerced.
- **Presets in one place.** Mode presets are applied to the document by ``ddiloco.core.modes``
  before validation; components only check that their config agrees with its mode.
- **Environment in one place.** Services read environment variables in their command-line entry
  point, never deeper down.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, TypeVar

import yaml
from pydantic import ConfigDict, TypeAdapter, ValidationError

STRICT = ConfigDict(strict=True, extra="forbid", use_attribute_docstrings=True)
"""The pydantic config of every ddiloco config dataclass."""

SECTIONS = ("run", "protocol", "model", "data", "train", "learner", "synchronizer")
"""The sections a config document may hold (each component reads its own)."""

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration that is refused; the message names the offending field."""


def read_document(path: str | pathlib.Path | None) -> dict[str, Any]:
    """Parse a YAML or JSON config file (empty for None); refuse sections nobody reads."""
    data = read_file(path)
    check_sections(data, str(path))
    return data


def read_file(path: str | pathlib.Path | None) -> dict[str, Any]:
    """Parse a YAML or JSON file holding a mapping (empty for None)."""
    if path is None:
        return {}
    p = pathlib.Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {p}: {exc.strerror}") from exc
    kind = "JSON" if p.suffix == ".json" else "YAML"
    try:
        data = json.loads(text) if kind == "JSON" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{p} is not valid {kind}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p} must hold a mapping, got {type(data).__name__}")
    return data


def check_sections(document: dict[str, Any], where: str = "config") -> None:
    unknown = sorted(str(k) for k in document if k not in SECTIONS)
    if unknown:
        raise ConfigError(f"{where}: unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}")


def build(cls: type[T], values: Any, where: str = "") -> T:
    """Validate ``values`` (plain data from a file or flags) into config class ``cls``."""
    label = where or cls.__name__
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(f"config section {label} must be a mapping, got {type(values).__name__}")
    try:
        text = json.dumps(values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config section {label} holds a value that is not plain data: {exc}") from exc
    try:
        return TypeAdapter(cls).validate_json(text)
    except ValidationError as exc:
        raise ConfigError(describe(exc, label)) from None


def describe(exc: ValidationError, where: str) -> str:
    """One line per problem: ``section.field: what is wrong (got VALUE)``."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(part) for part in (where, *err["loc"]) if part != "")
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "unexpected_keyword_argument":
            msg = "unknown key"
        shown = err.get("input")
        got = "" if err["type"] in ("value_error", "assertion_error") or isinstance(shown, dict) else f" (got {shown!r})"
        lines.append(f"{loc}: {msg}{got}")
    return "; ".join(lines)


def replace(obj: T, **changes: Any) -> T:
    """``dataclasses.replace`` for config objects (validates the result)."""
    try:
        return dataclasses.replace(obj, **changes)  # type: ignore[type-var]
    except ValidationError as exc:
        raise ConfigError(describe(exc, type(obj).__name__)) from None


SECRET_FIELDS = frozenset({"token", "auth_tokens"})
"""Config fields that hold credentials: ``to_dict(..., redact=True)`` never writes their values."""


def to_dict(obj: Any, *, redact: bool = False) -> Any:
    """A dataclass (possibly nested) as plain JSON-able data; with ``redact``, credentials (the
    fields in SECRET_FIELDS) become "<redacted>" (for logs and event logs)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            out[f.name] = "<redacted>" if redact and f.name in SECRET_FIELDS and value else to_dict(value, redact=redact)
        return out
    if isinstance(obj, tuple | list):
        return [to_dict(v, redact=redact) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v, redact=redact) for k, v in obj.items()}
    return obj
