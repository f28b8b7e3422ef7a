"""The layout of the tree, checked (issue #38): the product apart from the lab.

Read from the source with `ast`, nothing imported. Where today's tree still breaks a rule, the
offenders are listed below as known exceptions, each with why; the lists may only shrink: a new
offender fails, and so does a listed one that has been fixed (delete it from the list).
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.python_source import parse

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 80
MAX_BENCH_MODULES = 12

# Modules (paths from the root) that may import vLLM: the version-pinned adapter and the two
# modules that own the engine.
VLLM_ALLOWED = (
    "retention/vllm_adapter/",
    "realtime/engine.py",
    "realtime/engine_session.py",
    # The self-check drives the engine itself: sessions, preemption, its own sampling params.
    "realtime/selfcheck.py",
)
# Known exceptions to VLLM_ALLOWED. The benchmarks build engines and requests of their own
# (scheduler_cls, SamplingParams, executors) until they drive only the production classes
# (#38's one-scheduler step); training/vlm_accuracy asks a built model through vLLM directly.
VLLM_KNOWN = {
    "bench/driver.py",
    "bench/engine_timing.py",
    "bench/run.py",
    "bench/tail_latency.py",
    "training/vlm_accuracy.py",
}
# Known functions over MAX_FUNCTION_LINES, "path:qualname" -> lines today: none left (#38 named
# the steps of after_fold, cli.main, http_router and build_smollm2). Only shrinks.
LONG_KNOWN: dict[str, int] = {}


def _modules(*folders: str) -> Iterator[tuple[str, ast.Module]]:
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), parse(path)


SOURCE_ROOTS = ("protocol/", "clients/python/")
"""Distribution folders whose packages are imported by their names inside them."""


def _module_path(rel: str) -> str:
    """`rel` as its package sees it: protocol/vllm_realtime_protocol/x.py -> vllm_realtime_protocol/x.py."""
    for root in SOURCE_ROOTS:
        rel = rel.removeprefix(root)
    return rel


def _package(rel: str) -> list[str]:
    return _module_path(rel).removesuffix(".py").split("/")[:-1]


def _imports(rel: str, tree: ast.Module) -> set[str]:
    """Absolute names of everything the module imports, at any depth (lazy imports included)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = _package(rel)[: len(_package(rel)) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def _under(name: str, top: str) -> bool:
    return name == top or name.startswith(top + ".")


def _long_functions(*folders: str) -> dict[str, int]:
    found: dict[str, int] = {}

    def visit(rel: str, node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(rel, child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found[f"{rel}:{prefix}{child.name}"] = lines
                visit(rel, child, f"{prefix}{child.name}.")

    for rel, tree in _modules(*folders):
        visit(rel, tree, "")
    return found


def test_the_server_imports_no_training_code() -> None:
    bad = {
        rel: sorted(
            n for n in _imports(rel, tree) if _under(n, "training") or _under(n, "torch.optim")
        )
        for rel, tree in _modules("realtime")
    }
    assert {rel: names for rel, names in bad.items() if names} == {}


def test_training_is_not_in_the_wheel() -> None:
    # Read as text: tomllib is 3.11+, and the project supports 3.10.
    text = (ROOT / "pyproject.toml").read_text()
    find = text.split("[tool.setuptools.packages.find]", 1)[1].split("\n[", 1)[0]
    include = [line for line in find.splitlines() if line.startswith("include = ")]
    # The protocol is not in it either: it is its own distribution, a dependency (below).
    assert include == ['include = ["retention*", "realtime*"]']


def _requirements(pyproject: Path) -> list[str]:
    """The names in [project] dependencies (read as text: tomllib is 3.11+)."""
    block = pyproject.read_text().split("\ndependencies = [", 1)[1].split("\n]", 1)[0]
    lines = [line.split("#", 1)[0].strip().strip(",").strip('"') for line in block.splitlines()]
    return [re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0] for line in lines if line]


def test_the_protocol_is_one_distribution_that_the_server_and_the_sdk_depend_on() -> None:
    """protocol/ is the protocol's own project (pydantic only), its one package
    `vllm_realtime_protocol`; the server and the SDK require it by name, and no distribution
    here ships a generic top-level `protocol` package."""
    project = ROOT / "protocol" / "pyproject.toml"
    text = project.read_text()
    assert 'name = "vllm-realtime-protocol"' in text
    assert 'packages = ["vllm_realtime_protocol"]' in text
    assert _requirements(project) == ["pydantic"]
    for dependent in (ROOT / "pyproject.toml", ROOT / "clients" / "python" / "pyproject.toml"):
        assert "vllm-realtime-protocol" in _requirements(dependent), dependent
    assert (
        'packages = ["vllm_realtime_client"]'
        in (ROOT / "clients/python/pyproject.toml").read_text()
    )
    assert (ROOT / "protocol" / "vllm_realtime_protocol" / "__init__.py").is_file()
    assert not (ROOT / "vllm_realtime_protocol").exists()  # one copy, in its project's folder
    assert not (ROOT / "protocol" / "__init__.py").exists()  # a project folder, not a package
    assert not (ROOT / "clients/python/protocol").exists()
    # Pure: its modules import the standard library, pydantic and themselves only.
    allowed = sys.stdlib_module_names | {
        "__future__",
        "pydantic",
        "pydantic_core",
        "vllm_realtime_protocol",
    }
    outside = {
        rel: sorted(n for n in _imports(rel, tree) if n.split(".")[0] not in allowed)
        for rel, tree in _modules("protocol/vllm_realtime_protocol")
    }
    assert {rel: names for rel, names in outside.items() if names} == {}


def test_training_modules_import_each_other_without_a_cycle() -> None:
    """vision_train -> vision_codes -> synth_frames, one way (lazy imports count too)."""
    graph = {
        rel.removesuffix(".py").replace("/", "."): {
            n for n in _imports(rel, tree) if _under(n, "training") and n.count(".") == 1
        }
        for rel, tree in _modules("training")
    }
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, " -> ".join([*path, module])
        if module in done:
            return
        for dep in sorted(graph.get(module, ())):
            if dep in graph and dep != module:
                visit(dep, (*path, module))
        done.add(module)

    for module in graph:
        visit(module, ())


def test_bench_is_small_and_imports_nothing_from_tests() -> None:
    modules = dict(_modules("bench"))
    assert len(modules) <= MAX_BENCH_MODULES, sorted(modules)
    bad = {rel: [n for n in _imports(rel, t) if _under(n, "tests")] for rel, t in modules.items()}
    assert {rel: names for rel, names in bad.items() if names} == {}


def test_the_retention_policy_imports_only_the_standard_library_and_retention() -> None:
    tree = parse(ROOT / "retention" / "policy.py")
    outside = {
        name
        for name in _imports("retention/policy.py", tree)
        if name.split(".")[0] not in sys.stdlib_module_names | {"__future__", "retention"}
    }
    assert outside == set()


def test_only_the_adapter_and_the_engine_modules_import_vllm() -> None:
    importers = {
        rel
        for rel, tree in _modules(
            "protocol/vllm_realtime_protocol", "realtime", "retention", "bench", "training"
        )
        if any(_under(name, "vllm") for name in _imports(rel, tree))
    }
    outside = {rel for rel in importers if not rel.startswith(VLLM_ALLOWED)}
    assert outside - VLLM_KNOWN == set(), "a new module imports vLLM"
    assert VLLM_KNOWN - outside == set(), "no longer imports vLLM: drop it from VLLM_KNOWN"


def test_no_function_is_over_80_lines() -> None:
    found = _long_functions("realtime", "retention", "bench")
    assert {k: n for k, n in found.items() if k.startswith("bench/")} == {}
    new = {k: n for k, n in found.items() if k not in LONG_KNOWN and not k.startswith("bench/")}
    assert new == {}, "a new function over 80 lines"
    grown = {k: (n, found[k]) for k, n in LONG_KNOWN.items() if k in found and found[k] > n}
    assert grown == {}, "a known long function grew"
    fixed = sorted(k for k in LONG_KNOWN if k not in found)
    assert fixed == [], "now within 80 lines: drop it from LONG_KNOWN"


_PRODUCT_TOPS = ("vllm_realtime_protocol", "retention", "realtime", "vllm_realtime_client")


def _without_type_checking(tree: ast.Module) -> ast.Module:
    """The module less its `if TYPE_CHECKING:` blocks: an import only annotations read never
    runs, and a mixin's annotations name the class that mixes it in (the SDK's forms and
    recovery name RealtimeSession), which is a dependency of names, not of loading."""
    import copy

    pruned = copy.deepcopy(tree)
    for node in ast.walk(pruned):
        for field in ("body", "orelse"):
            block = getattr(node, field, None)
            if isinstance(block, list):
                block[:] = [
                    child
                    for child in block
                    if not (
                        isinstance(child, ast.If)
                        and isinstance(child.test, ast.Name)
                        and child.test.id == "TYPE_CHECKING"
                    )
                ]
    return pruned


def _module_graph() -> dict[str, set[str]]:
    """Module -> the product modules it imports (function-level imports included)."""
    folders = ("protocol/vllm_realtime_protocol", "retention", "realtime", "clients/python")
    files = [(rel, tree) for rel, tree in _modules(*folders)]
    names = {}
    for rel, _ in files:
        name = _module_path(rel).removesuffix(".py").replace("/", ".")
        names[rel] = name.removesuffix(".__init__")
    known = set(names.values())
    graph: dict[str, set[str]] = {}
    for rel, tree in files:
        deps: set[str] = set()
        for imported in _imports(rel, _without_type_checking(tree)):
            # `from a.b import c` names a.b.c: the module a.b.c if there is one, else a.b.
            while imported and imported not in known:
                imported = imported.rpartition(".")[0]
            if imported and imported != names[rel] and imported.split(".")[0] in _PRODUCT_TOPS:
                deps.add(imported)
        graph[names[rel]] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph.get(node, ())):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_product_packages_import_each_other_without_a_cycle() -> None:
    """vllm_realtime_protocol, retention, realtime and the Python SDK: no module reaches itself
    through imports, lazy (function-level) ones included, annotation-only ones not. A package's __init__ counts as a
    module, so `from pkg import x` inside pkg's own submodule is a cycle too."""
    assert _cycles(_module_graph()) == []


def test_the_adapters_errors_have_one_root() -> None:
    """Every exception class retention/vllm_adapter defines on a builtin exception also derives
    from VLLMAdapterError (errors.py); a subclass of one of its own errors inherits it.
    `_SessionOver` is control flow inside streaming.py, never raised to a caller."""
    builtin = {"Exception", "RuntimeError", "ValueError", "TypeError", "KeyError", "LookupError"}
    unrooted = []
    for rel, tree in _modules("retention/vllm_adapter"):
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef) or node.name in {
                "VLLMAdapterError",
                "_SessionOver",
            }:
                continue
            bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
            if bases & builtin and "VLLMAdapterError" not in bases:
                unrooted.append(f"{rel}:{node.name}")
    assert unrooted == []


def _is_test_module(name: str) -> bool:
    return _under(name, "tests") and name.rpartition(".")[2].startswith("test_")


def test_no_test_module_imports_another() -> None:
    """What tests share lives in a conftest.py or a helper module (not test_*.py): a test
    module imported by another would run its tests' module-level setup there, and pytest
    would see its fixtures twice. Lazy imports count too."""
    found = {
        rel: sorted(n for n in _imports(rel, tree) if _is_test_module(n))
        for rel, tree in _modules("tests")
    }
    assert {rel: names for rel, names in found.items() if names} == {}
