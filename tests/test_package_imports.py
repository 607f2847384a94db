"""The package's modules import each other without a cycle.

An edge is every import of a megatron_zero module written anywhere in a module's source: at the top
level, under `if`/`try`, and inside functions. A function-level import that only defers a cycle to
call time is still a cycle in the layering (the two modules depend on each other), so it counts; the
package has no import that needs an exception. `from X import name` is an edge to X.name where that is
a module, else to X; a package's `__init__` is a module like the others. Importing a submodule also
runs its parent package's `__init__`, but that is not counted: Python completes a package partly
initialised, and counting it would make every `__init__` that re-exports its submodules a cycle.
"""
import ast
import os

import megatron_zero

PACKAGE_DIR = os.path.dirname(os.path.abspath(megatron_zero.__file__))


def _modules():
    """{dotted name: source path} of every module in the package."""
    found = {}
    for directory, _, files in os.walk(PACKAGE_DIR):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                rel = os.path.relpath(path, os.path.dirname(PACKAGE_DIR))[:-3].replace(os.sep, ".")
                found[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return found


def _target(modules, dotted):
    """The module `dotted` names, or its nearest enclosing one (an attribute of a module)."""
    while dotted not in modules and "." in dotted:
        dotted = dotted.rsplit(".", 1)[0]
    return dotted if dotted in modules else None


def import_graph():
    """{module: {imported module: first line importing it}} over the package's own modules."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        is_package = path.endswith("__init__.py")
        edges = graph.setdefault(module, {})
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = module.split(".") if is_package else module.split(".")[:-1]
                    base = ".".join(parts[:len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
                else:
                    base = node.module
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            for name in names:
                target = _target(modules, name) if name.split(".")[0] == "megatron_zero" else None
                if target is not None and target != module:
                    edges.setdefault(target, node.lineno)
    return graph


def find_cycle(graph):
    """One import cycle as [a, b, ..., a], or None."""
    state, stack = {}, []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph.get(module, {})):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        stack.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def test_the_walker_sees_top_level_relative_and_function_level_imports():
    graph = import_graph()
    assert "megatron_zero.checkpoint.load" in graph["megatron_zero.checkpoint.resume"]  # from .load import
    assert "megatron_zero.checkpoint.format" in graph["megatron_zero.checkpoint.reshape.universal_load"]  # ..format
    assert "megatron_zero.zero.stage3" in graph["megatron_zero.zero.optimizer"]  # inside a function only
    assert find_cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == ["a", "b", "c", "a"]


def test_the_package_imports_have_no_cycle():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(
        f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def package_graph(graph):
    """The module graph folded onto the package's parts: each subpackage (model, moe, zero, checkpoint, ...)
    one node, each top-level module (training, topology, ...) its own."""
    def part(module):
        return ".".join(module.split(".")[:2])

    folded = {}
    for module, edges in graph.items():
        for target, line in edges.items():
            if part(target) != part(module):
                folded.setdefault(part(module), {}).setdefault(part(target), (module, target, line))
    return folded


def test_the_packages_import_each_other_without_a_cycle():
    """A subpackage may use another only where that one does not use it back, function-level imports counted
    (model uses moe and not the reverse; checkpoint uses zero and not the reverse)."""
    folded = package_graph(import_graph())
    two_parts = {"megatron_zero.a.x": {"megatron_zero.b.y": 1}, "megatron_zero.b.y": {"megatron_zero.a.z": 1}}
    assert find_cycle(package_graph(two_parts)) == ["megatron_zero.a", "megatron_zero.b", "megatron_zero.a"]
    assert "megatron_zero.moe" in folded["megatron_zero.model"]
    cycle = find_cycle(folded)
    assert cycle is None, "package import cycle: " + " -> ".join(
        "{1} ({0}, line {2})".format(*folded[a][b]) for a, b in zip(cycle, cycle[1:]))
