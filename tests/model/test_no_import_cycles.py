"""No import cycles between tpuserve's own modules, read from the source (nothing is imported).

An edge is an `import` / `from ... import` of a tpuserve.* module that runs when its module is imported: at the
top level, or inside `if`/`try`/`with` blocks and class bodies there; not in `if TYPE_CHECKING:` blocks, which
never run. Imports inside functions are not edges there; a second test adds them, so that no cycle hides behind
a lazy import, and the tokenizer modules are held to no lazy imports of each other at all (their readers return
TokenizerParts, so none needs the Tokenizer class)."""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("model", "sampler", "grpc_service", "http_gateway", "cli", "proto")  # tpuserve.<name> is <name>/
TOKENIZER_MODULES = (
    "tpuserve.model.tokenizer",
    "tpuserve.model.tokenizer_gguf",
    "tpuserve.model.tokenizer_hf",
    "tpuserve.model.tokenizer_parts",
)


def module_files() -> dict[str, pathlib.Path]:
    """Every product module by dotted name (a package by its own name, for its __init__.py)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = ["tpuserve", *path.relative_to(REPO).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement loads: `from a import b` loads `a.b` when that is a module."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the module's package, one level up per extra dot
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def is_type_checking(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`): a block only type checkers read."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def run_time_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Import statements that run on import: everywhere except inside function bodies and TYPE_CHECKING blocks."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if is_type_checking(node):
            assert isinstance(node, ast.If)
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def function_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Import statements inside function bodies."""
    found: list[ast.Import | ast.ImportFrom] = []
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            found += [n for n in ast.walk(fn) if isinstance(n, ast.Import | ast.ImportFrom)]
    return found


def edges(modules: dict[str, pathlib.Path], statements) -> dict[str, set[str]]:
    """Module -> the product modules its chosen import statements load (a module's parent packages included:
    importing tpuserve.a.b runs tpuserve/a/__init__.py first)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in statements(tree):
            for name in imported_names(node, module, path.name == "__init__.py"):
                parts = name.split(".")
                for k in range(2, len(parts) + 1):
                    target = ".".join(parts[:k])
                    if target in modules and target != module and not module.startswith(target + "."):
                        graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_module_graph_is_found() -> None:
    modules = module_files()
    graph = edges(modules, run_time_imports)
    assert "tpuserve.http_gateway.app" in modules and "tpuserve.model.tokenizer" in modules
    assert "tpuserve.model.tokenizer_parts" in graph["tpuserve.model.tokenizer_gguf"]
    assert "tpuserve.proto.tpuserve.v1.tpuserve_pb2" in graph["tpuserve.proto.tpuserve.v1.tpuserve_pb2_grpc"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    source = (
        "if TYPE_CHECKING:\n    import t.a\nelse:\n    import t.b\n"
        "class C:\n    import t.c\n"
        "def f():\n    import t.d\n"
    )
    tree = ast.parse(source)
    assert sorted(n.names[0].name for n in run_time_imports(tree)) == ["t.b", "t.c"]
    assert [n.names[0].name for n in function_imports(tree)] == ["t.d"]


def test_no_import_cycle_between_product_modules() -> None:
    found = cycles(edges(module_files(), run_time_imports))
    assert found == [], f"modules that import each other (directly or round a loop): {found}"


def test_no_cycle_hidden_by_imports_inside_functions() -> None:
    """A lazy import may defer loading a heavy package, never close a loop between our modules."""
    modules = module_files()
    top, inside = edges(modules, run_time_imports), edges(modules, function_imports)
    found = cycles({m: top[m] | inside[m] for m in modules})
    assert found == [], f"modules that import each other once functions run: {found}"


def test_the_tokenizer_modules_import_each_other_only_at_the_top() -> None:
    """Their only edges are top-level ones, so the acyclic graph above is the whole story for them."""
    modules = module_files()
    hidden = edges(modules, function_imports)
    inside = {m: sorted(hidden[m] & set(TOKENIZER_MODULES)) for m in TOKENIZER_MODULES}
    assert all(m in modules for m in TOKENIZER_MODULES)
    assert inside == {m: [] for m in TOKENIZER_MODULES}
