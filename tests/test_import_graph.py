"""No module of ds_q8 imports itself back, however indirectly; no test imports another test module; no
script of launch/, gpu_check/ or studies/ imports anything from tests/; neither ds_q8 nor its tests
(tests/) import a study (studies/), and the scripts import each other without a cycle.

A cycle works only as long as every module on it imports the others lazily or after its own names
exist; moving one import to the top of a file then fails at import time, in an order that depends on
which module a user imports first. The graph is read from the source with ``ast``, so it also holds
the imports inside functions: those run later, but a cycle through them is still a cycle.

An edge ``a -> b`` means module ``a`` imports module ``b``: ``import b``, ``from b import name``, or
``from a_package import b`` where ``b`` is a submodule. A package's ``__init__`` is not counted when one
of its submodules is imported, or every module would be on a cycle through ``ds_q8/__init__.py``.
"""
from __future__ import annotations

import ast
from collections import deque
from pathlib import Path
from typing import Dict, List, Set

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "ds_q8"
TESTS = REPO / "tests"
STUDIES = REPO / "studies"
#: the folders of scripts run from a checkout (flat: each puts the folders it needs on sys.path)
SCRIPT_DIRS = ("launch", "gpu_check", "studies")
#: every folder of tests
TEST_DIRS = (TESTS, REPO / "gpu_check" / "tests", STUDIES / "tests")


def modules_of(root: Path) -> Dict[str, Path]:
    """Dotted name -> file of every module of the package at ``root`` (its ``__init__`` named as the package)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _known(name: str, modules: Dict[str, Path]) -> str:
    # "ds_q8.optim.base.get_map" -> "ds_q8.optim.base": the longest prefix that is a module
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def imports_of(module: str, path: Path, modules: Dict[str, Path]) -> Set[str]:
    """The package's modules that ``module`` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(_known(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                # level 1 is the module's own package: the module itself for an __init__, else its parent
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                full = ".".join(base + ([node.module] if node.module else []))
            else:
                full = node.module
            for alias in node.names:
                sub = f"{full}.{alias.name}"
                out.add(sub if sub in modules else _known(full, modules))
    out.discard("")  # imports of other packages
    out.discard(module)
    return out


def import_graph(root: Path) -> Dict[str, Set[str]]:
    modules = modules_of(root)
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def _components(graph: Dict[str, Set[str]]) -> List[Set[str]]:
    """Strongly connected components (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
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
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = set()
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.add(top)
                    if top == node:
                        break
                out.append(comp)
    return out


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """For every module on a cycle, the shortest cycle through it; each cycle once, starting at its
    smallest name, ending where it starts."""
    found = set()
    for comp in _components(graph):
        for start in sorted(comp):
            parent, queue = {start: None}, deque([start])
            while queue:
                node = queue.popleft()
                if start in graph[node]:
                    path = [node]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    path.reverse()
                    i = path.index(min(path))
                    found.add(tuple(path[i:] + path[:i]))
                    break
                for child in sorted(graph[node] & comp):
                    if child not in parent:
                        parent[child] = node
                        queue.append(child)
    return [list(c) + [c[0]] for c in sorted(found)]


def _short(name: str, package: str) -> str:
    return name[len(package) + 1:].replace(".", "/") if name != package else "__init__"


def test_ds_q8_has_no_import_cycle():
    found = cycles(import_graph(PACKAGE))
    text = "\n".join(" -> ".join(_short(m, "ds_q8") for m in c) for c in found)
    print(text)
    assert not found, f"{len(found)} import cycle(s) in ds_q8:\n{text}"


# ---------------------------------------------------------------------------- the checker itself
def _write(root: Path, files: Dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root / "pkg"


def test_checker_reports_a_planted_cycle(tmp_path):
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "from . import a\n",
        "pkg/a.py": "from . import b\n",
        "pkg/b.py": "def f():\n    from .sub.c import thing\n",  # lazy, and through a subpackage
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "import os\nfrom ..a import name\n",
        "pkg/d.py": "import pkg.b\n",  # on no cycle: reaches it, is not reached back
    })
    graph = import_graph(pkg)
    assert graph["pkg"] == {"pkg.a"} and graph["pkg.b"] == {"pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]


def test_checker_resolves_relative_imports_without_inventing_cycles(tmp_path):
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "from .sub import helper\nfrom . import sub\n",
        "pkg/sub/__init__.py": "from .helper import x\nfrom .. import top\n",
        "pkg/sub/helper.py": "from . import other\nfrom .other import y\nimport json\n",
        "pkg/sub/other.py": "from ..top import z\n",
        "pkg/top.py": "",
    })
    graph = import_graph(pkg)
    assert graph == {"pkg": {"pkg.sub.helper", "pkg.sub"}, "pkg.sub": {"pkg.sub.helper", "pkg.top"},
                     "pkg.sub.helper": {"pkg.sub.other"}, "pkg.sub.other": {"pkg.top"}, "pkg.top": set()}
    assert cycles(graph) == []
    graph["pkg.top"] = {"pkg.sub.helper"}  # a second cycle, and one through a package's __init__
    graph["pkg.sub.other"].add("pkg.sub")
    assert cycles(graph) == [["pkg.sub", "pkg.sub.helper", "pkg.sub.other", "pkg.sub"],
                             ["pkg.sub.helper", "pkg.sub.other", "pkg.top", "pkg.sub.helper"]]


# ---------------------------------------------------------------------------- tests/ and launch/
def imported_names(path: Path) -> Set[str]:
    """The absolute modules a file imports anywhere in its source (``from a.b import c``: ``a.b``), and
    the first argument of ``importlib.import_module`` / ``__import__`` calls given as a literal."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.add(node.module)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ast.unparse(node.func) in ("importlib.import_module", "import_module", "__import__")):
            out.add(node.args[0].value)
    return out


def imports_of_test_modules(path: Path) -> List[str]:
    """The ``test_*`` modules ``path`` imports: shared code belongs in tests/helpers/."""
    return sorted(m for m in imported_names(path) if m.split(".")[-1].startswith("test_")
                  or m.split(".")[0].startswith("test_"))


def imports_from(path: Path, names: Set[str], folder: str) -> List[str]:
    """What ``path`` imports of ``names`` (top-level modules) or of a package named ``folder``, and a
    ``folder`` it puts on sys.path."""
    found = sorted(m for m in imported_names(path) if m.split(".")[0] in names | {folder})
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("sys.path.insert", "sys.path.append"):
            if any(isinstance(n, ast.Constant) and n.value == folder for n in ast.walk(node)):
                found.append(f"sys.path: {ast.unparse(node)}")
    return found


def launch_imports_from_tests(path: Path) -> List[str]:
    """What a script imports from tests/ (its top-level modules and packages, and the suite's conftest),
    and a ``tests`` folder it puts on sys.path."""
    local = {p.stem for p in TESTS.glob("*.py")} | {p.name for p in TESTS.iterdir() if (p / "__init__.py").exists()}
    return imports_from(path, local | {"conftest"}, "tests")


def test_no_test_imports_a_test_module():
    found = {str(p.relative_to(REPO)): imports_of_test_modules(p) for d in TEST_DIRS for p in sorted(d.rglob("*.py"))}
    found = {k: v for k, v in found.items() if v}
    assert not found, f"move what these import into tests/helpers/: {found}"


def test_launch_scripts_import_nothing_from_tests():
    found = {str(p.relative_to(REPO)): launch_imports_from_tests(p)
             for d in SCRIPT_DIRS for p in sorted((REPO / d).glob("*.py"))}
    found = {k: v for k, v in found.items() if v}
    assert not found, f"{', '.join(SCRIPT_DIRS)} must run without tests/: {found}"


def study_imports(path: Path) -> List[str]:
    """What a file imports from studies/ (its scripts by name), and a ``studies`` folder it puts on sys.path."""
    return imports_from(path, {p.stem for p in STUDIES.glob("*.py")}, "studies")


def test_neither_the_library_nor_its_tests_import_a_study():
    files = sorted(PACKAGE.rglob("*.py")) + sorted(TESTS.rglob("*.py")) + [REPO / "conftest.py"]
    found = {str(p.relative_to(REPO)): study_imports(p) for p in files}
    found = {k: v for k, v in found.items() if v}
    assert not found, f"a study's test belongs in studies/tests/: {found}"


def test_the_scripts_import_each_other_without_a_cycle():
    """launch/, gpu_check/ and studies/ import each other by bare names (each puts the folders it needs on
    sys.path): the graph over those names has no cycle."""
    paths = {p.stem: p for d in SCRIPT_DIRS for p in sorted((REPO / d).glob("*.py"))}
    graph = {name: {m.split(".")[0] for m in imported_names(p)} & set(paths) - {name} for name, p in paths.items()}
    found = cycles(graph)
    assert not found, f"import cycle(s) among the scripts: {found}"


def test_test_import_checks_catch_planted_imports(tmp_path):
    bad = tmp_path / "test_bad.py"
    bad.write_text("import test_kernels\nfrom test_layout import partitions\nfrom helpers.layout import KW\n"
                   "def f():\n    import importlib\n    importlib.import_module('test_muon')\n")
    assert imports_of_test_modules(bad) == ["test_kernels", "test_layout", "test_muon"]
    script = tmp_path / "script.py"
    script.write_text("import os, sys\nsys.path.insert(0, os.path.join(ROOT, 'tests'))\n"
                      "from helpers.optimizer_cases import kernel_cases\nimport conftest\nimport torch\n")
    found = launch_imports_from_tests(script)
    assert found[:2] == ["conftest", "helpers.optimizer_cases"] and found[2].startswith("sys.path: sys.path.insert")
    assert len(found) == 3
    product = tmp_path / "test_product.py"
    product.write_text("import os, sys\nsys.path.insert(0, os.path.join(REPO, 'studies'))\nimport fidelity\n"
                       "def f():\n    from lowbit_sim import parse\n")
    found = study_imports(product)
    assert found[:2] == ["fidelity", "lowbit_sim"] and found[2].startswith("sys.path: sys.path.insert")
