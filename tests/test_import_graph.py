"""The import graph of the tokenmill package: no cycles, and core/ stays free of torch.

Edges come from every `import` statement in a module, at module level or inside a function, class or
`if __name__ == "__main__":` block alike (a function-level import still ties the two modules together,
it only defers the cost). Imports under `if TYPE_CHECKING:` never run and are left out. The graph is
checked at two grains: between modules, and between tokenmill's top-level packages (tokenmill.engine,
tokenmill.entrypoints, ...), where a cycle means two layers depend on each other.
"""
from __future__ import annotations

import ast
from pathlib import Path

import tokenmill

PACKAGE_DIR = Path(tokenmill.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, skipping the bodies of `if TYPE_CHECKING:` blocks."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, modules: set[str]) -> set[str]:
    """The tokenmill modules one import statement loads (by its own words, not parent packages)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            anchor = importer.split(".") if is_package else importer.split(".")[:-1]
            anchor = anchor[:len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        # `from pkg import name`: the submodule pkg.name when there is one, else pkg itself.
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    return {name for name in names if name in modules}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges: set[str] = set()
        for node in _imports(tree):
            edges |= _targets(node, name, path.name == "__init__.py", set(modules))
        edges.discard(name)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:  # the graph has a few hundred nodes: recursion depth is fine
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def _package_of(module: str) -> str:
    """tokenmill.engine.llm_engine -> tokenmill.engine; top-level modules stand for themselves."""
    parts = module.split(".")
    return ".".join(parts[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        # The root package's lazy re-exports (tokenmill.LLM ...) are a facade for users, not a layer.
        if module == "tokenmill":
            continue
        edges = packages.setdefault(_package_of(module), set())
        edges |= {_package_of(t) for t in targets if t != "tokenmill"} - {_package_of(module)}
    return packages


def _describe(cycles: list[list[str]], graph: dict[str, set[str]]) -> str:
    lines = []
    for members in cycles:
        inside = set(members)
        edges = [f"{a} -> {b}" for a in members for b in sorted(graph.get(a, ())) if b in inside]
        lines.append("cycle among " + ", ".join(members) + ":\n    " + "\n    ".join(edges))
    return "\n".join(lines)


def test_graph_sees_imports_at_every_level():
    graph = import_graph()
    # A module-level import, a function-level one, and a function-level `from pkg import module`.
    assert "tokenmill.errors" in graph["tokenmill.entrypoints.bench_cli"]
    assert "tokenmill.bench.serve" in graph["tokenmill.entrypoints.bench_cli"]
    assert "tokenmill.model.gguf_loader" in graph["tokenmill.planning.planner"]
    # Imports that only type checkers run are no edges; the else branch of such a block runs.
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\n"
              "def f():\n    import c\n")
    assert sorted(n.names[0].name for n in _imports(ast.parse(source)) if isinstance(n, ast.Import)) == ["b", "c"]


def test_no_import_cycles_between_modules():
    graph = import_graph()
    cycles = _cycles(graph)
    assert not cycles, "import cycles between tokenmill modules:\n" + _describe(cycles, graph)


def test_no_import_cycles_between_packages():
    graph = package_graph(import_graph())
    cycles = _cycles(graph)
    assert not cycles, "import cycles between tokenmill packages:\n" + _describe(cycles, graph)


def test_core_never_imports_torch():
    for name, path in _modules().items():
        if name != "tokenmill.core" and not name.startswith("tokenmill.core."):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _imports(tree):
            roots = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""])
            assert not any(r == "torch" or r.startswith("torch.") for r in roots), f"{name} imports torch"


def test_the_api_process_modules_import_no_torch():
    # The server's API process stays light (DESIGN.md): what it imports to serve HTTP, the AsyncLLM frontend,
    # the tokenizer handover, tool-call parsing and the grammar checks must not pull torch in.
    import subprocess
    import sys

    modules = ["tokenmill.entrypoints.cli", "tokenmill.entrypoints.openai.api_server", "tokenmill.engine.async_llm",
               "tokenmill.engine.tokenizer_handover", "tokenmill.entrypoints.openai.tool_calls",
               "tokenmill.structured.llguidance_backend", "tokenmill.metrics.prometheus"]
    script = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
              + "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", "the API process's modules import torch"


# What each package may import (docs/architecture.md, "What each package may import"): one way, from the
# entrypoints down to the leaves. An entry `package: names` limits an edge to those modules of the package.
LEAVES = {"tokenmill.errors", "tokenmill.outputs", "tokenmill.metrics", "tokenmill.web", "tokenmill.child_process",
          "tokenmill.distributed"}
MAY_IMPORT: dict[str, set[str]] = {
    **{leaf: set() for leaf in LEAVES},
    "tokenmill.config": {"tokenmill.errors"},
    "tokenmill.sampling_params": {"tokenmill.errors"},
    "tokenmill.lora_request": {"tokenmill.errors"},
    "tokenmill.structured": {"tokenmill.errors", "tokenmill.sampling_params"},
    "tokenmill.sample": {"tokenmill.outputs", "tokenmill.sampling_params", "tokenmill.structured"},
    "tokenmill.spec_decode": {"tokenmill.config"},
    "tokenmill.model": {"tokenmill.config", "tokenmill.distributed", "tokenmill.errors", "tokenmill.lora_request"},
    "tokenmill.core": {"tokenmill.config", "tokenmill.lora_request", "tokenmill.outputs", "tokenmill.sampling_params"},
    "tokenmill.runner": {"tokenmill.child_process", "tokenmill.config", "tokenmill.core", "tokenmill.distributed",
                         "tokenmill.errors", "tokenmill.lora_request", "tokenmill.model", "tokenmill.sample",
                         "tokenmill.sampling_params"},
    "tokenmill.engine": {"tokenmill.child_process", "tokenmill.config", "tokenmill.core", "tokenmill.distributed",
                         "tokenmill.errors", "tokenmill.lora_request", "tokenmill.metrics", "tokenmill.model",
                         "tokenmill.outputs",
                         "tokenmill.runner", "tokenmill.sampling_params", "tokenmill.spec_decode",
                         "tokenmill.structured"},
    "tokenmill.beam_search": {"tokenmill.engine", "tokenmill.errors", "tokenmill.outputs", "tokenmill.sampling_params"},
    "tokenmill.bench": {"tokenmill.errors", "tokenmill.model"},
    "tokenmill.planning": {"tokenmill.core", "tokenmill.errors", "tokenmill.model"},
    "tokenmill.entrypoints": {"tokenmill.beam_search", "tokenmill.bench", "tokenmill.config", "tokenmill.engine",
                              "tokenmill.errors", "tokenmill.lora_request", "tokenmill.metrics", "tokenmill.outputs",
                              "tokenmill.planning",
                              "tokenmill.runner", "tokenmill.sampling_params"},
    "tokenmill.serve": {"tokenmill.engine", "tokenmill.entrypoints", "tokenmill.model", "tokenmill.config"},
}
# Edges into a package above the importer, allowed only to these modules: the scheduler's output types (the
# message the runner receives) and the KV cache group plan (the planner counts blocks by it too); the one
# message type beam search reads; the process-memory helper the API processes call once at start-up.
ONLY_MODULES = {
    ("tokenmill.runner", "tokenmill.core"): {"tokenmill.core.sched_output", "tokenmill.core.kv_cache_groups"},
    ("tokenmill.planning", "tokenmill.core"): {"tokenmill.core.kv_cache_groups"},
    ("tokenmill.beam_search", "tokenmill.engine"): {"tokenmill.engine.messages"},
    ("tokenmill.entrypoints", "tokenmill.runner"): {"tokenmill.runner.host_memory"},
}


def test_every_package_imports_only_what_its_layer_may():
    graph = import_graph()
    wrong = []
    for module, targets in sorted(graph.items()):
        if module == "tokenmill":
            continue
        package = _package_of(module)
        assert package in MAY_IMPORT, f"{package} is missing from MAY_IMPORT (and docs/architecture.md)"
        for target in sorted(targets):
            target_package = _package_of(target)
            if target_package == package or target == "tokenmill":
                continue
            only = ONLY_MODULES.get((package, target_package))
            if target_package not in MAY_IMPORT[package] or (only is not None and target not in only):
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports against the layering:\n    " + "\n    ".join(wrong)


def test_the_config_is_a_leaf_and_attention_backends_do_not_import_each_other():
    graph = import_graph()
    assert graph["tokenmill.config"] <= {"tokenmill.errors"}
    backends = {f"tokenmill.model.layers.attention.{name}"
                for name in ("torch_backend", "cpu_backend", "triton_backend")}
    for backend in backends:
        assert backend in graph, backend
        # The C++ backend reuses the torch backend's paths for long float32 chunks; nothing else crosses.
        allowed = {"tokenmill.model.layers.attention.torch_backend"} if backend.endswith("cpu_backend") else set()
        assert graph[backend] & backends <= allowed, f"{backend} imports {graph[backend] & backends}"
