"""ddiloco.core: what every ddiloco part shares and nothing else.

Typed configuration (``config``: strict config dataclasses, the config document and its
sections), the mode presets (``modes``), structured logs (``logs``) and the ``ddiloco`` command
(``cli``), which finds the sub-commands of whichever ddiloco parts are installed.
"""

__version__ = "0.1.0"


def build_labels(service: str) -> dict[str, str]:
    """What a ``ddiloco_build_info`` series says about a process: service, version, Python, torch."""
    import platform
    from importlib import metadata

    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "none"
    return {"service": service, "version": __version__, "python": platform.python_version(), "torch": torch}
