"""pyproject.toml lists every package of the repository, and maps static/ and templates/ into the wheel.

The package list is explicit (static/ and templates/ are mapped into
``app``, which rules out automatic discovery), so a new package that is
not added here would be missing from the wheel; ``test_install.py`` builds
and installs the real thing, slowly, and this catches the omission at once.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def code_packages() -> set[str]:
    found = set()
    for top in ("app", "trainer_bridge"):
        for init in (REPO / top).rglob("*.py"):
            if "__pycache__" not in init.parts:
                found.add(".".join(init.parent.relative_to(REPO).parts))
    return found


def test_every_python_package_is_listed():
    assert code_packages() <= set(CONFIG["packages"])


def test_every_asset_folder_is_listed_and_mapped():
    mapped = CONFIG["package-dir"]
    assert mapped == {"app.static": "static", "app.templates": "templates"}
    for package, folder in mapped.items():
        for sub in [p for p in (REPO / folder).rglob("*") if p.is_dir()]:
            name = ".".join([package, *sub.relative_to(REPO / folder).parts])
            assert name in CONFIG["packages"], f"{sub} is not in the wheel: add {name!r} to packages"
    assert CONFIG["package-data"] == {"app.static": ["**/*"], "app.templates": ["**/*"]}
