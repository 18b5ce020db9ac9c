"""Every job started by the tests, the launch scripts and the Makefile runs the interpreter of the
environment it is in (``sys.executable``, ``$(PY)``, launch/python.sh's ``$PY``), never a bare
``python``/``python3``/``pip`` from PATH: on a machine whose packages live in ``.venv`` that one has no
torch, and a green run where it happens to have torch hides the bug.

Two guards: at run time conftest.py puts stubs of those names first on PATH (a bare call fails with one
clear line), and the checks below read the sources, so that a call in a test that is skipped here (the
GPU tests) or in a script no test runs is caught too."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import BARE_INTERPRETER_EXIT, BARE_INTERPRETER_MESSAGE

REPO = Path(__file__).resolve().parent.parent
BARE = ("python", "python3", "pip", "pip3")
PY_DIRS = ("ds_q8", "launch", "gpu_check", "studies", "tests")


def _python_files():
    for d in PY_DIRS:
        yield from sorted((REPO / d).rglob("*.py"))


def _first_word(node) -> str:
    """The command a subprocess argument starts: the first element of a list or tuple, or the first
    word of a command string."""
    if isinstance(node, (ast.List, ast.Tuple)) and node.elts:
        node = node.elts[0]
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        return ""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split(" ", 1)[0]
    return ""


#: calls that run a command string
RUNNERS = {"system", "popen", "run", "Popen", "call", "check_call", "check_output", "getoutput", "getstatusoutput"}


def _callee(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _only_names(node) -> bool:
    """A list of interpreter names (``("python", "pip")``) is not a command line."""
    return all(isinstance(e, ast.Constant) and e.value in BARE for e in node.elts)


def bare_calls_in_python(source: str, name: str = "<source>") -> list:
    """``file:line`` of every list/tuple literal that starts with a bare interpreter name, and of every
    command string starting with one that is passed to a call (``subprocess.run("python x.py",
    shell=True)``, ``os.system(...)``)."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, (ast.List, ast.Tuple)) and _first_word(node) in BARE and not _only_names(node):
            found.append(f"{name}:{node.lineno}")
        elif isinstance(node, ast.Call) and node.args and _callee(node) in RUNNERS:
            first = node.args[0]
            if isinstance(first, ast.Constant) and _first_word(first) in BARE:
                found.append(f"{name}:{node.lineno}")
    return sorted(set(found), key=lambda at: int(at.rsplit(":", 1)[1]))


# the word itself: not part of a path, a name or an option (python.sh, --python-version), nor a module
# run by an interpreter (``"$PY" -m pip``), nor looked up (``command -v python3``, launch/python.sh's
# last resort where no environment is set up)
_SHELL_WORD = re.compile(r"(?<!-m )(?<!command -v )(?<![\w/.$\"'{-])(python3?|pip3?)(?![\w/.-])")


def bare_calls_in_shell(text: str, name: str = "<script>") -> list:
    """``file:line`` of every command line that runs a bare interpreter. Comment lines and single-quoted
    strings (the Python programs that scripts pass to ``"$PY" -c '...'``) are not commands."""
    found = []
    # comments first (their apostrophes are not quotes), then single-quoted strings, keeping line numbers
    lines = ["" if line.lstrip().startswith("#") else re.sub(r"\s#.*", "", line) for line in text.splitlines()]
    commands = re.sub(r"'[^']*'", lambda m: "\n" * m.group(0).count("\n"), "\n".join(lines))
    for number, line in enumerate(commands.splitlines(), start=1):
        if _SHELL_WORD.search(line):
            found.append(f"{name}:{number}")
    return found


def _makefile_recipes() -> str:
    lines = (REPO / "Makefile").read_text().splitlines()
    return "\n".join(line[1:] if line.startswith("\t") else "" for line in lines)


def test_a_bare_interpreter_from_path_fails_with_a_clear_line():
    for name in BARE:
        proc = subprocess.run([name, "-c", "pass"], capture_output=True, text=True, timeout=30)
        assert proc.returncode == BARE_INTERPRETER_EXIT, (name, proc)
        assert BARE_INTERPRETER_MESSAGE in proc.stderr


def test_jobs_see_this_environment_first_on_path():
    proc = subprocess.run([sys.executable, "-c", "import shutil; print(shutil.which('ninja'))"],
                          capture_output=True, text=True, timeout=30)
    env_ninja = Path(sys.executable).parent / "ninja"
    if env_ninja.exists():
        assert proc.stdout.strip() == str(env_ninja)


@pytest.mark.parametrize("path", list(_python_files()), ids=lambda p: str(p.relative_to(REPO)))
def test_no_python_source_starts_a_bare_interpreter(path):
    assert bare_calls_in_python(path.read_text(), str(path.relative_to(REPO))) == []


def test_no_script_or_make_recipe_starts_a_bare_interpreter():
    found = []
    for script in (sorted((REPO / "launch").glob("*.sh")) + sorted((REPO / "gpu_check").glob("*.sh"))
                   + sorted((REPO / ".ci").glob("*"))):
        found += bare_calls_in_shell(script.read_text(), str(script.relative_to(REPO)))
    found += bare_calls_in_shell(_makefile_recipes(), "Makefile")
    assert found == []


def test_the_source_checks_find_what_they_are_for():
    bad_python = '''
import subprocess, os, sys
subprocess.run(["python", "studies/memory_plan.py"])
subprocess.Popen(("pip", "install", "x"))
os.system("python3 -m ds_q8.tools.bench")
'''
    assert bare_calls_in_python(bad_python) == ["<source>:3", "<source>:4", "<source>:5"]
    good_python = '''
import subprocess, sys
subprocess.run([sys.executable, "studies/memory_plan.py"])
print("python launch/compare.py")  # a usage line, not a command
'''
    assert bare_calls_in_python(good_python) == []
    bad_shell = 'NUM=$(python -c "print(1)")\nexec python launch/x.py\nmpiexec -n 2 python3 x.py\npip install -q y\n'
    assert bare_calls_in_shell(bad_shell) == ["<script>:1", "<script>:2", "<script>:3", "<script>:4"]
    good_shell = ('# python launch/compare.py in a comment\n"$PY" -c \'\nimport python_thing\nprint("python x")\n\'\n'
                  'exec "$PY" -m deepspeed.launcher.runner x.py  # then python\n')
    assert bare_calls_in_shell(good_shell) == []
