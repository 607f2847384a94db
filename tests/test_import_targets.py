"""Every `megatron_zero` import written in the repository's scripts (bench/, scripts/, tools/, examples/, tests/,
pretrain_gpt.py) names a module that exists and, for `from M import name`, a submodule of M or a name M binds at its
top level (a definition, an assignment, an import, or a lazy export: a string of the table a package gives `lazy_exports`). Imports
under an `except` clause (a baseline tree's older layout, tried where today's failed) are not checked.

Checked from the source, nothing imported: a bench that runs only on a quiet machine, or a tool that runs only on a
GPU, would otherwise find a moved module on the day it is next run.
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT_DIRS = ("bench", "bench/peers", "scripts", "tools", "examples", "tests")


def _scripts():
    paths = [os.path.join(ROOT, "pretrain_gpt.py")]
    for d in SCRIPT_DIRS:
        where = os.path.join(ROOT, d)
        if os.path.isdir(where):
            paths += sorted(os.path.join(where, f) for f in os.listdir(where) if f.endswith(".py"))
    return [p for p in paths if os.path.exists(p)]


def _module_file(dotted: str):
    """(source path, is a package) of a megatron_zero module, or None."""
    base = os.path.join(ROOT, *dotted.split("."))
    if os.path.isfile(os.path.join(base, "__init__.py")):
        return os.path.join(base, "__init__.py"), True
    if os.path.isfile(base + ".py"):
        return base + ".py", False
    return None


def _bound_names(path: str) -> set:
    """The names a module binds at its top level, with the string keys of its lazy exports."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try)):
            names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    if any(isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_exports" for node in ast.walk(tree)):
        # the exports' table is built from literals (a dict, a list spread into it): its strings
        names |= {n.value for node in tree.body if isinstance(node, ast.Assign) for n in ast.walk(node.value)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return names


def unresolved(path: str):
    """[(line, what)] of the megatron_zero imports in `path` that name nothing."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    fallbacks = {id(n) for handler in ast.walk(tree) if isinstance(handler, ast.ExceptHandler)
                 for n in ast.walk(handler)}  # an older tree's layout, tried where today's import failed
    out = []
    for node in ast.walk(tree):
        if id(node) in fallbacks:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names
                    if a.name.split(".")[0] == "megatron_zero" and _module_file(a.name) is None]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "megatron_zero":
            found = _module_file(node.module)
            if found is None:
                out.append((node.lineno, node.module))
                continue
            bound = None
            for alias in node.names:
                if alias.name == "*" or _module_file(f"{node.module}.{alias.name}") is not None:
                    continue
                bound = _bound_names(found[0]) if bound is None else bound
                if alias.name not in bound:
                    out.append((node.lineno, f"{node.module}.{alias.name}"))
    return out


def test_the_checker_finds_a_moved_module(tmp_path):
    script = tmp_path / "bench_x.py"
    script.write_text("from megatron_zero import shm_comm\nfrom megatron_zero.distributed import shm_comm\n"
                      "from megatron_zero.zero.partition import no_such_name, partition_group\n"
                      "import megatron_zero.no_such_module\n")
    assert unresolved(str(script)) == [(1, "megatron_zero.shm_comm"), (3, "megatron_zero.zero.partition.no_such_name"),
                                       (4, "megatron_zero.no_such_module")]


def test_script_imports_resolve():
    missing = [f"{os.path.relpath(path, ROOT)} line {line} imports {what}, which does not exist"
               for path in _scripts() for line, what in unresolved(path)]
    assert not missing, "\n".join(missing)
