"""Load a model written by ``ddiloco export`` into a torch module with one call.

    model = build_model(cfg, seed)            # or any nn.Module with the trained parameter names
    meta = load_exported(model, "model.safetensors")

An export is a plain safetensors file: its tensors are the model's parameters by their
``named_parameters()`` names, in fp32 (the synchronizer's master copy), and its string metadata
says what they are (``format``, ``model``, ``model_fingerprint``, ``fragment_versions``, ...; see
docs/export.md). ``safetensors.torch.load_file`` plus ``load_state_dict(strict=False)`` reads it
too; this helper adds what that does not:

- **All checks before any write.** Names and shapes are compared from the file's header (no
  tensor data is read for that), and a mismatch raises ``ExportLoadError`` listing every missing,
  unexpected and mismatched tensor, with the module left exactly as it was.
- **Parameters only.** Training synchronizes parameters, never buffers (a module's buffers are
  its own: running statistics, masks), so buffers are neither expected in the file nor touched.
  Tied parameters are one parameter: the export holds it once under its first name, and a file
  holding it under another of its names (a plain ``state_dict``) loads as well.
- **Casts on copy.** Each tensor is copied into the existing parameter, in the parameter's dtype
  and on its device, one tensor at a time, so a bf16 or GPU model loads an fp32 file without a
  second full copy of the model in memory.

This module belongs to the training library (it never imports a service): whoever loads
a trained model needs the model's code, not the service that trained it.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import torch
from torch import nn

FORMAT_PREFIX = "ddiloco-export/"
KNOWN_FORMATS = frozenset({"ddiloco-export/1"})
"""Export formats this loader reads; files without a ``format`` (any safetensors file holding the
parameters) are read as well."""
_LISTED = 20
"""Names listed per category in an error message (the count is always given)."""


class ExportLoadError(ValueError):
    """The file cannot be loaded into this module; the module was not changed."""

    def __init__(self, message: str, *, missing: list[str] | None = None, unexpected: list[str] | None = None,
                 mismatched: list[str] | None = None) -> None:
        super().__init__(message)
        self.missing = missing or []
        self.unexpected = unexpected or []
        self.mismatched = mismatched or []


class ExportMetadata(dict):
    """The file's metadata (a dict of strings), plus what a non-strict load left out."""

    missing: list[str]
    """Parameters of the module the file does not hold (kept as they were)."""
    unexpected: list[str]
    """Tensors of the file the module has no parameter for (ignored)."""


def _open(path: str | os.PathLike[str]) -> Any:
    from safetensors import safe_open

    p = pathlib.Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model file {p} does not exist")
    if not p.is_file():
        raise ExportLoadError(f"model file {p} is not a file")
    try:
        return safe_open(str(p), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own SafetensorError for a malformed header
        raise ExportLoadError(f"{p} is not a readable safetensors file: {exc}") from None


def _check_format(path: str | os.PathLike[str], metadata: dict[str, str]) -> None:
    fmt = metadata.get("format")
    if fmt is not None and fmt.startswith(FORMAT_PREFIX) and fmt not in KNOWN_FORMATS:
        raise ExportLoadError(f"{path} is in export format {fmt!r}; this version reads {sorted(KNOWN_FORMATS)} "
                              "(upgrade ddiloco to load it)")


def read_export_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The string metadata of an exported file (empty for a safetensors file without any).

    Raises FileNotFoundError when the file does not exist, ExportLoadError when it is not a
    safetensors file or is in an export format newer than this version reads."""
    with _open(path) as f:
        metadata = dict(f.metadata() or {})
    _check_format(path, metadata)
    return metadata


def _listing(kind: str, names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED]) + (f", ... ({len(names) - _LISTED} more)" if len(names) > _LISTED else "")
    return f"{len(names)} {kind}: {shown}"


def load_exported(model: nn.Module, path: str | os.PathLike[str], *, strict: bool = True) -> ExportMetadata:
    """Copy the parameters in ``path`` into ``model`` and return the file's metadata.

    ``strict``: every parameter of the module must be in the file and every tensor of the file
    must be a parameter of the module (outer-momentum tensors of ``--with-momentum`` exports are
    not parameters and are always skipped). Not strict: the tensors both have are loaded, and the
    returned metadata's ``missing`` / ``unexpected`` say what was left out. A shape mismatch is an
    error either way. On any error (ExportLoadError, FileNotFoundError) the module is unchanged.
    """
    with _open(path) as f:
        metadata = dict(f.metadata() or {})
        _check_format(path, metadata)
        skip_prefix = metadata.get("momentum_prefix") or None
        in_file = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()  # noqa: SIM118 (not a dict)
                   if not (skip_prefix and name.startswith(skip_prefix))}
        # Every name of every parameter, tied ones included; a parameter is expected once.
        params: dict[str, nn.Parameter] = dict(model.named_parameters(remove_duplicate=False))
        canonical: dict[int, str] = {}
        for name, p in params.items():
            canonical.setdefault(id(p), name)
        source: dict[str, str] = {}
        """canonical parameter name -> the file's tensor that fills it"""
        unexpected: list[str] = []
        for name in in_file:
            param = params.get(name)
            if param is None:
                unexpected.append(name)
                continue
            target = canonical[id(param)]
            if target not in source or name == target:  # prefer the canonical name when a file has both
                source[target] = name
        missing = [name for name in canonical.values() if name not in source]
        mismatched = [f"{target} (file {list(in_file[name])}, model {list(params[target].shape)})"
                      for target, name in source.items() if in_file[name] != tuple(params[target].shape)]
        problems = []
        on_meta = [target for target in source if params[target].is_meta]
        if on_meta:  # copying into a meta tensor silently does nothing
            problems.append(_listing("on the meta device (materialize the module first, e.g. "
                                     "module.to_empty(device='cpu'))", on_meta))
        if mismatched:
            problems.append(_listing("with other shapes", mismatched))
        if strict and missing:
            problems.append(_listing("missing from the file", missing))
        if strict and unexpected:
            problems.append(_listing("not in the model", unexpected))
        if problems:
            hint = "" if not metadata.get("model") else f"; the file's model: {metadata['model']}"
            raise ExportLoadError(f"{path} does not fit this model: " + "; ".join(problems) + hint,
                                  missing=missing if strict else [], unexpected=unexpected if strict else [],
                                  mismatched=mismatched)
        with torch.no_grad():
            for target, name in source.items():
                param = params[target]
                param.copy_(f.get_tensor(name).to(device=param.device, dtype=param.dtype))
    out = ExportMetadata(metadata)
    out.missing, out.unexpected = missing, unexpected
    return out


__all__ = ["ExportLoadError", "ExportMetadata", "load_exported", "read_export_metadata"]
