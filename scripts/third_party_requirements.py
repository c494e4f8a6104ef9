"""Print the third-party requirements of the workspace's distributions, one per line.

``make install`` installs these first and the workspace's own packages after them (editable,
without dependencies). Building an editable package runs setuptools, which loads the
``egg_info.writers`` plugins of every distribution already installed; installed in one go, a
plugin could be present while a package it imports was not yet (seen: ``kernels``, pulled in by
``transformers``, importing ``huggingface_hub``, which imports ``httpcore2``), and the build
failed now and then on a fresh machine. With every third-party package in place first, nothing
is half-installed when the workspace's packages are built.

Usage: ``python scripts/third_party_requirements.py FOLDER... [--extra NAME]...``: the folders
holding the workspace's ``pyproject.toml`` files, and the extras of the root (the first folder)
to include. Requirements naming a workspace distribution are followed (with their extras), not
printed.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import tomllib

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def third_party(folders: list[pathlib.Path], root_extras: list[str]) -> list[str]:
    projects = {}
    for folder in folders:
        project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        projects[_canonical(project["name"])] = project
    root = _canonical(tomllib.loads((folders[0] / "pyproject.toml").read_text())["project"]["name"])
    out: list[str] = []
    seen: set[tuple[str, str]] = set()

    def follow(name: str, extra: str) -> None:
        if (name, extra) in seen:
            return
        seen.add((name, extra))
        project = projects[name]
        requirements = (project.get("dependencies", []) if not extra
                        else project.get("optional-dependencies", {}).get(extra))
        if requirements is None:
            raise SystemExit(f"{project['name']} has no extra {extra!r}")
        for requirement in requirements:
            match = _NAME.match(requirement)
            if match is None:
                raise SystemExit(f"cannot read the requirement {requirement!r} of {project['name']}")
            dep = _canonical(match.group(1))
            if dep in projects:
                follow(dep, "")
                for e in filter(None, (x.strip() for x in (match.group(2) or "").split(","))):
                    follow(dep, e)
            elif requirement not in out:
                out.append(requirement)

    follow(root, "")
    for extra in root_extras:
        follow(root, extra)
    for name in projects:  # a folder nothing depends on is installed too: so are its dependencies
        follow(name, "")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=pathlib.Path)
    parser.add_argument("--extra", action="append", default=[])
    args = parser.parse_args(argv)
    print("\n".join(third_party(args.folders, args.extra)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
