"""``make lint``'s rules fail when broken: each is planted in a copy of the tree, and the real tools run there.

The copy holds the Python files of ``app/``, ``trainer_bridge/`` and ``tests/``
and ``pyproject.toml``; ``lint-imports`` (the contracts in pyproject.toml) and
``python -m tests.lint`` (tests/lint.py) run in it as ``make lint`` runs them,
with the copy as the working directory and the import path. The untouched
copy passes both, so each failure is the planted breach's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _python_only(directory: str, names: list[str]) -> list[str]:
    return [
        n
        for n in names
        if n == "__pycache__" or (not n.endswith(".py") and not (Path(directory) / n).is_dir())
    ]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tree")
    for package in ("app", "trainer_bridge", "tests"):
        shutil.copytree(REPO / package, root / package, ignore=_python_only)
    shutil.copy(REPO / "pyproject.toml", root)
    return root


@pytest.fixture
def tree(pristine, tmp_path) -> Path:
    """A fresh copy of the tree for one plant."""
    root = tmp_path / "tree"
    shutil.copytree(pristine, root)
    return root


def run(root: Path, cmd: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    return run(root, [str(LINT_IMPORTS), "--no-cache"])


def lint_tests(root: Path) -> subprocess.CompletedProcess:
    return run(root, [sys.executable, "-m", "tests.lint"])


def contracts(root: Path) -> list[dict]:
    return tomllib.loads((root / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def broken(result: subprocess.CompletedProcess) -> str:
    """The output of a failed run (one that passed fails the test, with what it printed)."""
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    return " ".join(out.split())  # import-linter wraps long contract names


def plant(root: Path, path: str, text: str) -> None:
    file = root / path
    file.parent.mkdir(parents=True, exist_ok=True)
    with open(file, "a") as f:
        f.write("\n" + text + "\n")


def module_file(root: Path, module: str) -> str:
    """A file in which to plant an import made by ``module``: a new one in a package, else the module's."""
    path = Path(*module.split("."))
    return (path / "_planted.py").as_posix() if (root / path).is_dir() else f"{path}.py"


def test_the_tree_as_it_is_passes_every_rule(pristine):
    result = lint_imports(pristine)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 broken" in result.stdout
    result = lint_tests(pristine)
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


# --- the import rule: no module of tests/ imports a test module --------------------------


@pytest.mark.parametrize(
    "path, importer",
    [
        ("tests/ranks/test_page_state.py", "tests.ranks.test_page_state"),  # a test module
        ("tests/helpers/browser.py", "tests.helpers.browser"),  # a helper, on behalf of every test using it
        ("tests/cluster/conftest.py", "tests.cluster.conftest"),
        ("tests/bench/scale.py", "tests.bench.scale"),
    ],
)
def test_a_module_of_tests_importing_a_test_module_breaks_the_import_contract(tree, path, importer):
    plant(tree, path, "from tests.incidents.test_stacks import captures  # noqa: F401")
    out = broken(lint_imports(tree))
    assert "No module of tests/ imports a test module" in out and " BROKEN" in out
    assert f"{importer} is not allowed to import tests.incidents.test_stacks" in out


def test_a_test_folder_the_import_contract_does_not_list_fails(tree):
    plant(tree, "tests/newarea/__init__.py", "")
    plant(tree, "tests/newarea/test_new.py", "def test_new():\n    pass")
    out = broken(lint_tests(tree))
    assert "tests/newarea/test_new.py:1: a test module the import contract does not list" in out


# --- the existing contracts of app/ and trainer_bridge/ still fail when broken -----------


def test_the_dashboard_importing_mindspore_breaks_its_contract(tree):
    plant(tree, "app/_planted.py", "import mindspore  # noqa: F401")
    out = broken(lint_imports(tree))
    assert "The dashboard imports only the run-directory contract of the trainer's package BROKEN" in out
    assert "app is not allowed to import mindspore: - app._planted -> mindspore" in out


def test_the_run_directory_contract_importing_the_dashboard_breaks_its_contract(tree):
    plant(tree, "trainer_bridge/rundir/_planted.py", "import app.audit  # noqa: F401")
    out = broken(lint_imports(tree))
    assert "The run-directory contract imports no MindSpore and none of the trainer BROKEN" in out
    assert (
        "trainer_bridge.rundir is not allowed to import app: - trainer_bridge.rundir._planted -> app.audit"
        in out
    )


def test_a_lower_layer_of_app_importing_a_higher_one_breaks_the_layers_contract(tree):
    """Read from pyproject.toml, so that it holds for whatever order the layers contract gives."""
    [layers] = [c for c in contracts(tree) if c["type"] == "layers"]
    container = layers["containers"][0]
    top = layers["layers"][0].split("|")[0].strip()
    bottom = layers["layers"][-1].split("|")[0].strip()
    low, high = f"{container}.{bottom}", f"{container}.{top}"
    plant(tree, module_file(tree, low), f"import {high}  # noqa: F401")
    out = broken(lint_imports(tree))
    assert f"{layers['name']} BROKEN" in out and f"{low} is not allowed to import {high}" in out


def test_an_import_cycle_inside_one_layer_fails_even_inside_a_function(tree):
    """Two modules of the run model's one layer: the layers contract allows it, the cycle rule does not."""
    plant(tree, "app/run/health.py", "def _planted():\n    from app.run import state  # noqa: F401")
    assert lint_imports(tree).returncode == 0  # within a layer: not the contract's business
    out = broken(lint_tests(tree))
    assert "an import cycle:" in out and "app.run.health" in out and "app.run.state" in out


# --- tests.lint: one operator token, one app fixture ------------------------------------


@pytest.mark.parametrize(
    "text, says",
    [
        ('TOKEN = "another-operator-token-0123456789"', "TOKEN = a string"),
        ('OPERATOR_TOKEN = f"op-{1}"', "OPERATOR_TOKEN = a string"),
        ('ENV = {"RANKWATCH_TOKEN": "t" * 32}', '"RANKWATCH_TOKEN": a string'),
        ('SETTINGS = {"TOKEN": "hub-token"}', '"TOKEN": a string'),
        ('def app_with(make_app):\n    return make_app(None, TOKEN="kw-token")', "TOKEN= a string"),
    ],
)
def test_an_operator_token_of_its_own_fails(tree, text, says):
    plant(tree, "tests/stop/test_stop_api.py", text)
    out = broken(lint_tests(tree))
    assert "tests/stop/test_stop_api.py:" in out and says in out


def test_a_token_wrong_on_purpose_and_named_so_passes(tree):
    plant(tree, "tests/stop/test_stop_api.py", 'WRONG_TOKEN = "not-the-operator"\nWEAK_TOKEN = "abc"')
    result = lint_tests(tree)
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_app_fixture_copied_from_conftest_fails(tree):
    conftest = (tree / "tests/conftest.py").read_text()
    start = conftest.index("@pytest.fixture\ndef app(")
    fixture = conftest[start : conftest.index("\n\n\n", start)]
    # The same code with another docstring is still the same fixture.
    fixture = fixture.replace('"""', '"""Copied. ', 1)
    plant(tree, "tests/stop/test_stop_api.py", "import pytest\n\n\n" + fixture)
    out = broken(lint_tests(tree))
    assert "tests/stop/test_stop_api.py:" in out and "this app fixture is tests/conftest.py's" in out


def test_an_app_fixture_calling_create_app_fails(tree):
    fixture = (
        "import pytest\nfrom app import create_app\n\n\n@pytest.fixture\ndef app(run_dir):\n"
        '    app = create_app({"RUN_DIR": str(run_dir), "TESTING": True, "CHECKPOINT_SCAN_S": 0.2})\n'
        "    yield app\n"
    )
    plant(tree, "tests/checkpoints/test_ckptindex.py", fixture)
    out = broken(lint_tests(tree))
    assert "tests/checkpoints/test_ckptindex.py:" in out and "not create_app" in out


# --- the length rule: no module of app/ or trainer_bridge/ past 500 lines ---------------


@pytest.mark.parametrize("path", ["app/run/_planted.py", "trainer_bridge/rundir/_planted.py"])
def test_a_module_past_500_lines_fails(tree, path):
    plant(tree, path, "\n".join(f"X{i} = {i}" for i in range(500)))  # and a blank first line
    out = broken(lint_tests(tree))
    assert f"{path}:501: 501 lines, past 500: split it" in out


def test_a_module_of_500_lines_and_a_long_test_module_pass(tree):
    plant(tree, "app/run/_planted.py", "\n".join(f"X{i} = {i}" for i in range(499)))
    plant(tree, "tests/ranks/test_planted.py", "\n".join(f"X{i} = {i}" for i in range(600)))
    result = lint_tests(tree)
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr
