"""The tier table in tests/conftest.py names tests that exist, so no entry silently stops
applying when a test is renamed or moved (it would fall into the fast tier unnoticed)."""

from __future__ import annotations

import ast
import pathlib

from tests.conftest import E2E, SYSTEM, tier

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _test_names(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test")}


def test_every_entry_names_a_folder_a_file_or_tests_that_exist() -> None:
    for entry in (*E2E, *SYSTEM):
        where, _, name = entry.partition("::")
        path = ROOT / where
        assert path.exists(), f"{entry}: no such file or folder"
        if name:
            assert any(t.startswith(name) for t in _test_names(path)), f"{entry}: no such test in {where}"


def test_a_test_falls_in_the_tier_of_its_place() -> None:
    assert tier("tests/containers/test_images.py::test_real_images") == "system"
    assert tier("tests/lab/test_chaos.py::test_mixed_plan") == "e2e"
    assert tier("tests/training/test_model.py::test_build_is_identical_in_another_process") == "e2e"
    assert tier("tests/training/test_model.py::test_forward_shapes") is None
    assert tier("tests/algorithm/test_merge.py::test_rda") is None
