"""ninfer_core.resources: the assets directory of a wheel install and of a checkout."""

from pathlib import Path

import pytest

from ninfer_core import resources
from ninfer_core.errors import NinferError


@pytest.fixture
def package_dir(monkeypatch, tmp_path):
    """A fake package directory `tmp/ninfer_core` with the locator's cache cleared around it."""
    pkg = tmp_path / "ninfer_core"
    pkg.mkdir()
    monkeypatch.setattr(resources, "_PACKAGE_DIR", pkg)
    resources.assets_dir.cache_clear()
    yield pkg
    resources.assets_dir.cache_clear()


def test_checkout_assets_are_found():
    resources.assets_dir.cache_clear()
    repo_assets = Path(__file__).resolve().parents[1] / "assets"
    assert resources.assets_dir() == repo_assets
    assert resources.asset_path("chat_template.jinja").is_file()


def test_installed_copy_wins_over_a_sibling(package_dir):
    (package_dir / "assets").mkdir()
    (package_dir.parent / "assets").mkdir()
    assert resources.assets_dir() == package_dir / "assets"


def test_sibling_used_when_no_installed_copy(package_dir):
    (package_dir.parent / "assets").mkdir()
    assert resources.assets_dir() == package_dir.parent / "assets"


def test_missing_assets_raise(package_dir):
    with pytest.raises(NinferError, match="assets directory is missing"):
        resources.assets_dir()
    (package_dir / "assets").mkdir()
    resources.assets_dir.cache_clear()
    with pytest.raises(NinferError, match="'nope.txt' not found"):
        resources.asset_path("nope.txt")
