"""The grader's modules import each other without a circle: each may be read, and tested, knowing only
the modules below it. Every import counts, at the top of a module or inside a function."""
import ast

from conftest import REPO

PACKAGE = "grader"


def imported_modules(path) -> set[str]:
    """The modules of the grader package that the file at `path` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module == PACKAGE:
            found |= {f"{PACKAGE}.{alias.name}" for alias in node.names}  # from grader import report
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return {name for name in found if name.startswith(PACKAGE + ".")}


def import_graph() -> dict[str, set[str]]:
    modules = {f"{PACKAGE}.{path.stem}": path for path in (REPO / PACKAGE).glob("*.py") if path.stem != "__init__"}
    return {name: imported_modules(path) & set(modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports in `graph` ([a, b, a]), or None (a depth-first search)."""
    done, path = set(), []

    def visit(module):
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return None
        path.append(module)
        cycle = next(filter(None, map(visit, sorted(graph[module]))), None)
        path.pop()
        done.add(module)
        return cycle

    return next(filter(None, map(visit, sorted(graph))), None)


def test_the_grader_imports_no_module_that_imports_it_back():
    graph = import_graph()
    assert len(graph) > 10 and graph["grader.run"], graph  # the modules were found and read
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_a_cycle_is_found_wherever_it_closes():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
