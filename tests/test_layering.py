"""The import graph of the package: acyclic (counting imports inside functions, type-only ones and
importlib's), with the layer modules imported only by the catalog."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "rlscope"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module `name` refers to (`rlscope.spec.Metric` -> `rlscope.spec`)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.AST, here: str, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [n.name for n in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            package = here if modules[here].name == "__init__.py" else here.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}" if base else package
        return [f"{base}.{n.name}" if f"{base}.{n.name}" in modules else base for n in node.names]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "import_module"
        and node.args
        and isinstance(node.args[0], ast.JoinedStr)
        and node.args[0].values
        and isinstance(first := node.args[0].values[0], ast.Constant)
    ):
        prefix = str(first.value)  # f"rlscope.metrics.{name}": every module under the prefix
        return [m for m in modules if m.startswith(prefix) and m != prefix.rstrip(".")]
    return []


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            for target in _targets(node, name, modules):
                owner = _owner(target, modules) if target.startswith("rlscope") else None
                if owner and owner != name:
                    graph[name].add(owner)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "rlscope.metrics.stability" in graph["rlscope.catalog"]  # importlib seen
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_layer_modules_are_imported_by_the_catalog_only() -> None:
    graph = import_graph()
    layers = {m for m in graph if m.startswith(("rlscope.metrics.", "rlscope.rules."))}
    layers -= {"rlscope.metrics._common", "rlscope.rules.base"}
    importers = {
        m: sorted(graph[m] & layers)
        for m in graph
        if graph[m] & layers
        and m != "rlscope.catalog"
        and not m.startswith(("rlscope.metrics.", "rlscope.rules."))
    }
    assert importers == {}


def test_the_vocabulary_sits_below_the_engine_and_the_cli() -> None:
    graph = import_graph()
    upper = {"rlscope.engine", "rlscope.analysis", "rlscope.cli", "rlscope.catalog"}
    for module in ("rlscope.spec", "rlscope.report", "rlscope.windows", "rlscope.reader"):
        assert not graph[module] & upper, module


def test_spec_imports_nothing_of_rlscope() -> None:
    assert import_graph()["rlscope.spec"] == set()


def test_only_the_catalog_and_its_callers_name_the_default_catalog() -> None:
    """Renderers and the vocabulary read what results carry (layer, band, better), never the
    catalog: a report renders the same whatever catalog computed it."""
    graph = import_graph()
    for module in graph:
        if module.startswith(("rlscope.render", "rlscope.spec", "rlscope.report")):
            assert "rlscope.catalog" not in graph[module], module


def test_one_did_you_mean() -> None:
    from rlscope.errors import did_you_mean

    ids = ["behavior.entropy", "behavior.entropy_p80", "entropy-collapse", "mode-collapse"]
    assert did_you_mean("entropy-colapse", ids, "none").startswith("did you mean entropy-collapse")
    assert "behavior.entropy" in did_you_mean("behavior.entrpy", ids + ids, "none")
    assert did_you_mean("behavior.entrpy", ids + ids, "none").count("behavior.entropy,") == 1
    assert (
        did_you_mean("zzz", ids, "`rlscope metrics` lists them") == "`rlscope metrics` lists them"
    )
    # Every "did you mean" in the package comes from that one function.
    sources = "".join(p.read_text() for p in PACKAGE.rglob("*.py") if p.name != "errors.py")
    assert "did you mean" not in sources and "get_close_matches" not in sources


def test_no_global_registry() -> None:
    """Layer modules declare into their own `DECLARED`; nothing registers into module globals
    of another module (the catalog is built from the declarations, frozen)."""
    sources = "".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    assert "register_metric" not in sources and "rlscope.registry" not in sources


def test_rules_never_scan_the_run() -> None:
    """A rule reads computed results only (RuleContext has no run): what it needs, example
    rollouts included, is a metric or a component, computed in the one scan."""
    for path in (PACKAGE / "rules").glob("*.py"):
        text = path.read_text()
        for scan in (".scan(", "open_run", "ctx.run", "scan_parquet", "read_parquet"):
            assert scan not in text, f"{path.name}: {scan}"


def test_help_explain_and_formats_do_not_import_polars() -> None:
    """The quick commands stay quick: no Polars (~0.1 s of import) behind them."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from rlscope.cli import app\n"
        "for args in (['--help'], ['explain', 'kl-runaway'], ['metrics'], ['explain', 'x'],"
        " ['formats'], ['formats', 'trl']):\n"
        "    CliRunner().invoke(app, args)\n"
        "    assert 'polars' not in sys.modules, args\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
