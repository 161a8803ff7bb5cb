"""docs/modules.md is what scripts/module_map.py makes of the code: it cannot go stale."""

from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import ROOT

_spec = importlib.util.spec_from_file_location("module_map", ROOT / "scripts" / "module_map.py")
assert _spec is not None and _spec.loader is not None
module_map = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(module_map)


def test_the_module_map_is_current():
    assert module_map.main(["--check"]) == 0, "docs/modules.md is stale: run python scripts/module_map.py"


def test_every_module_says_what_it_holds():
    for path in module_map.modules():
        assert module_map.summary(path), path


def test_a_new_module_without_a_docstring_is_named(tmp_path, monkeypatch):
    package = tmp_path / "psframe"
    package.mkdir()
    (package / "__init__.py").write_text('"""A package."""\n')
    (package / "quiet.py").write_text("x = 1\n")
    monkeypatch.setattr(module_map, "ROOT", tmp_path)
    monkeypatch.setattr(module_map, "PACKAGE", package)
    with pytest.raises(module_map.MissingDocstring, match="psframe/quiet.py has no docstring"):
        module_map.render()


def test_a_module_added_to_the_code_shows_in_the_map(tmp_path, monkeypatch):
    package = tmp_path / "psframe"
    package.mkdir()
    (package / "__init__.py").write_text('"""A package."""\n')
    (package / "fresh.py").write_text('"""What it holds,\nin two lines.\n\nDetails."""\n')
    monkeypatch.setattr(module_map, "ROOT", tmp_path)
    monkeypatch.setattr(module_map, "PACKAGE", package)
    assert "| `fresh` | What it holds, in two lines. |" in module_map.render()
