"""The rules import-linter's contracts cannot say, checked by ``make lint``: ``python -m tests.lint [ROOT]``.

ROOT is the repository (by default the working directory).

- No import cycle in ``app/`` or ``trainer_bridge/``, imports inside
  functions counted (grimp's graph, the one import-linter builds): the
  layers contract orders the packages of ``app/``, this catches a cycle
  between modules of one layer too.

- One operator token. ``TOKEN`` is defined in ``tests/helpers/app.py`` alone, and
  every test and benchmark uses it (or ``AUTH``/``operator()``). Elsewhere, a
  string literal assigned to ``TOKEN`` or ``*_TOKEN``, or given as a dashboard's
  ``TOKEN``/``RANKWATCH_TOKEN`` setting, fails. A token that is wrong on purpose
  is named for it (``WRONG_TOKEN``, ``WEAK_TOKEN``, ...: ``DELIBERATE``).
- One ``app`` fixture. A test module's own ``app`` fixture may not repeat
  ``tests/conftest.py``'s, nor build the dashboard with ``create_app`` and a
  copied settings dict: ``make_app(run_dir, **overrides)`` is the way.
- No module of ``app/`` or ``trainer_bridge/`` past ``MAX_LINES`` lines: a
  longer one does more than one thing, and is split along a seam a
  newcomer would recognise (tests/ are not held to it).
- The import rule is import-linter's (the last contract in pyproject.toml): no
  module of tests/ imports a test module. Its wildcards stand for whole names,
  so it lists the test folders; this fails on a test module the list misses.

Prints one ``path:line: message`` per breach and exits 1 if there is any.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

TOKEN_HOME = "tests/helpers/app.py"
CONFTEST = "tests/conftest.py"
# Prefixes of a token variable that is not the operator's on purpose.
DELIBERATE = ("WRONG_", "WEAK_", "BAD_", "FORGED_", "STALE_")
# The setting names under which a dashboard takes its operator token.
TOKEN_SETTINGS = {"TOKEN", "RANKWATCH_TOKEN"}
IMPORT_CONTRACT = "No module of tests/ imports a test module"
MAX_LINES = 500
LENGTH_ROOTS = ("app", "trainer_bridge")


def _literal(node: ast.AST) -> bool:
    """A string written in the source: a literal, an f-string, or literals joined or repeated."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.JoinedStr):
        return True
    if isinstance(node, ast.BinOp):
        parts = (node.left, node.right)
        return any(_literal(p) for p in parts) and all(
            _literal(p) or (isinstance(p, ast.Constant) and isinstance(p.value, int)) for p in parts
        )
    return False


def _operator_token_name(name: str) -> bool:
    return (name == "TOKEN" or name.endswith("_TOKEN")) and not name.startswith(DELIBERATE)


def token_breaches(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and _operator_token_name(target.id) and _literal(node.value):
                    found.append((node.lineno, f"{target.id} = a string: import TOKEN from {TOKEN_HOME}"))
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value in TOKEN_SETTINGS and _literal(value):
                    found.append((key.lineno, f'"{key.value}": a string: use TOKEN from {TOKEN_HOME}'))
        elif isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg in TOKEN_SETTINGS and _literal(kw.value):
                    found.append((kw.value.lineno, f"{kw.arg}= a string: use TOKEN from {TOKEN_HOME}"))
    return found


def _is_fixture(func: ast.FunctionDef) -> bool:
    for dec in func.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if isinstance(target, ast.Attribute) and target.attr == "fixture":
            return True
        if isinstance(target, ast.Name) and target.id == "fixture":
            return True
    return False


def _app_fixtures(tree: ast.AST) -> list[ast.FunctionDef]:
    return [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "app" and _is_fixture(n)]


def _code(func: ast.FunctionDef) -> str:
    """The fixture's parameters and body, without its docstring: what it does, not what it says."""
    body = func.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return ast.dump(func.args) + "".join(ast.dump(stmt) for stmt in body)


def app_fixture_breaches(tree: ast.AST, shared: str | None) -> list[tuple[int, str]]:
    found = []
    for func in _app_fixtures(tree):
        if shared is not None and _code(func) == shared:
            found.append((func.lineno, f"this app fixture is {CONFTEST}'s: delete it"))
        calls = [n for n in ast.walk(func) if isinstance(n, ast.Call)]
        if any(isinstance(c.func, ast.Name) and c.func.id == "create_app" for c in calls):
            found.append(
                (
                    func.lineno,
                    "an app fixture builds the dashboard with make_app(run_dir, **overrides), not create_app",
                )
            )
    return found


def _matches(module: str, expression: str) -> bool:
    """import-linter's module expressions: ``*`` is one whole name, ``**`` one or more."""
    names, parts = module.split("."), expression.split(".")

    def match(i: int, j: int) -> bool:
        if j == len(parts):
            return i == len(names)
        if i == len(names):
            return False
        if parts[j] == "**":
            return any(match(k, j + 1) for k in range(i + 1, len(names) + 1))
        return (parts[j] in ("*", names[i])) and match(i + 1, j + 1)

    return match(0, 0)


def contract_breaches(root: Path, modules: list[str]) -> list[tuple[str, int, str]]:
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["importlinter"]
    contracts = [c for c in config.get("contracts", []) if c["name"].startswith(IMPORT_CONTRACT)]
    if "tests" not in config.get("root_packages", []) or not contracts:
        return [
            (
                "pyproject.toml",
                1,
                f"no import-linter contract {IMPORT_CONTRACT!r} over a `tests` root package",
            )
        ]
    forbidden = contracts[0]["forbidden_modules"]
    return [
        (path, 1, "a test module the import contract does not list: add its folder to forbidden_modules")
        for path, module in modules
        if not any(_matches(module, expression) for expression in forbidden)
    ]


def import_cycles(root: Path) -> list[list[str]]:
    """Each set of modules of ``app`` and ``trainer_bridge`` that import each other in a ring (Tarjan)."""
    import grimp

    sys.path.insert(0, str(root))
    try:
        graph = grimp.build_graph("app", "trainer_bridge", include_external_packages=False, cache_dir=None)
    finally:
        sys.path.remove(str(root))
    adjacent = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    rings: list[list[str]] = []
    for start in adjacent:
        if start in index:
            continue
        # Iterative: a deep chain of imports must not hit the recursion limit.
        work = [(start, iter(adjacent[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(adjacent.get(child, ()))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                ring = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    ring.append(member)
                    if member == node:
                        break
                if len(ring) > 1:
                    rings.append(sorted(ring))
    return rings


def length_breaches(root: Path) -> list[tuple[str, int, str]]:
    """The modules of ``LENGTH_ROOTS`` longer than ``MAX_LINES``."""
    found = []
    for package in LENGTH_ROOTS:
        for p in sorted((root / package).rglob("*.py")):
            if "__pycache__" in p.parts:
                continue
            path = p.relative_to(root).as_posix()
            lines = len(p.read_bytes().splitlines())
            if lines > MAX_LINES:
                message = f"{lines} lines, past {MAX_LINES}: split it along a seam a newcomer would name"
                found.append((path, MAX_LINES + 1, message))
    return found


def check(root: Path) -> list[str]:
    root = root.resolve()
    files = sorted(p for p in (root / "tests").rglob("*.py") if "__pycache__" not in p.parts)
    trees = {p.relative_to(root).as_posix(): ast.parse(p.read_text(), str(p)) for p in files}
    shared = next((_code(f) for f in _app_fixtures(trees[CONFTEST])), None) if CONFTEST in trees else None
    breaches: list[tuple[str, int, str]] = []
    for path, tree in trees.items():
        if path != TOKEN_HOME:
            breaches += [(path, line, msg) for line, msg in token_breaches(tree)]
        if path != CONFTEST:
            breaches += [(path, line, msg) for line, msg in app_fixture_breaches(tree, shared)]
    test_modules = [
        (path, path.removesuffix(".py").replace("/", "."))
        for path in trees
        if path.rsplit("/", 1)[-1].startswith("test_")
    ]
    breaches += contract_breaches(root, test_modules)
    breaches += length_breaches(root)
    for ring in import_cycles(root):
        breaches.append((ring[0].replace(".", "/") + ".py", 1, f"an import cycle: {' <-> '.join(ring)}"))
    return [f"{path}:{line}: {msg}" for path, line, msg in sorted(breaches)]


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path.cwd()
    breaches = check(root)
    for line in breaches:
        print(line)
    if breaches:
        print(f"tests.lint: {len(breaches)} breach(es) of the rules in tests/lint.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
