"""The documentation points at things that exist.

README.md and docs/*.md are read as text (nothing is imported or run): the README must stay within
``README_MAX_LINES`` lines; every relative link must reach a file of this checkout, and a link with
``#anchor`` a heading of its target (GitHub's anchors); every
``python -m MODULE`` must name a module of this project (or one of the few outside tools in
``EXTERNAL_MODULES``); every ``launch/...``, ``gpu_check/...``, ``studies/...``, ``ds_configs/...``, ``tests/...`` and
``ds_q8/...`` path must exist. A failure names the file, the line and what is missing.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))

#: modules run with ``python -m`` that are not this project's
EXTERNAL_MODULES = {"pytest", "pip", "venv", "deepspeed", "torch", "torch.distributed.run", "mpi4py"}

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"(?<!\!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_MODULE = re.compile(r"\bpython3?\s+-m\s+([A-Za-z_][\w.]*)")
_PATH = re.compile(r"(?<![\w./$<>-])((?:launch|gpu_check|studies|ds_configs|tests|ds_q8|docs)/[\w./-]*)")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def _lines(path: Path):
    """``(line number, text, inside a fenced code block)`` for every line of a Markdown file."""
    fenced = False
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            yield no, line, True
            continue
        yield no, line, fenced


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lowercased, every character that is not a letter,
    digit, space, hyphen or underscore dropped, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays, its target goes
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set:
    """Every anchor a Markdown file defines: one per heading (repeats get -1, -2, ... as on GitHub),
    and explicit ``<a name="...">`` / ``id="..."`` ones."""
    found, seen = set(), {}
    for _, line, fenced in _lines(path):
        if fenced:
            continue
        m = _HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
        found.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", line))
    return found


def links(path: Path):
    """``(line, target)`` of every link and image outside code: inline ones and reference definitions."""
    for no, line, fenced in _lines(path):
        if fenced:
            continue
        prose = _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)
        for pattern in (_LINK, _IMAGE, _REF_DEF):
            for target in pattern.findall(prose):
                yield no, target


def _rel(path: Path, root: Path) -> str:
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def broken_links(path: Path, root: Path = REPO) -> list:
    problems = []
    for no, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
            continue  # http:, https:, mailto:, ...: not this checkout's
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else (path.parent / file_part).resolve()
        where = f"{_rel(path, root)}:{no}: {target}"
        if not dest.exists():
            problems.append(f"{where}: no such file {_rel(dest, root)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading with anchor #{anchor} in {_rel(dest, root)}")
    return problems


def module_exists(name: str, root: Path = REPO) -> bool:
    base = root.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file() or (base / "__main__.py").is_file()


def missing_names(path: Path, root: Path = REPO) -> list:
    """Modules run with ``python -m`` and repository paths that the file names but that do not exist."""
    problems = []
    for no, line, _ in _lines(path):
        where = f"{_rel(path, root)}:{no}"
        for module in _MODULE.findall(line):
            module = module.rstrip(".")
            if module in EXTERNAL_MODULES or module.split(".")[0] in EXTERNAL_MODULES:
                continue
            if not module_exists(module, root):
                problems.append(f"{where}: python -m {module}: no module {module} in this checkout")
        for name in _PATH.findall(line):
            name = name.rstrip(".")
            if not (root / name).exists():
                problems.append(f"{where}: {name} does not exist")
    return problems


def test_the_docs_are_there():
    names = {p.name for p in DOCS}
    assert "README.md" in names and len(DOCS) > 1, "README.md and the pages under docs/ are expected"


#: the README says what ds_q8 is, how to run it and its current figures; the rest belongs in docs/
README_MAX_LINES = 200


def test_the_readme_stays_short():
    lines = len((REPO / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines, more than {README_MAX_LINES}: "
                                       "move detail and history into docs/")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(path):
    problems = broken_links(path)
    assert not problems, "broken links:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_module_and_path_named_exists(path):
    problems = missing_names(path)
    assert not problems, "named but missing:\n" + "\n".join(problems)


def test_the_checks_find_what_they_are_for(tmp_path):
    """The checks above fail on a missing file, a wrong anchor, a missing module and a missing path,
    and pass what exists, web links and links inside code blocks."""
    (tmp_path / "docs").mkdir()
    good = tmp_path / "docs" / "good.md"
    good.write_text("# Checkpoints and world size\n\n## Under ZeRO: what does *not* change\n\n## `impl` and A_B\n"
                    "\n## Speed\n\n## Speed\n")
    assert anchors(good) == {"checkpoints-and-world-size", "under-zero-what-does-not-change", "impl-and-a_b",
                             "speed", "speed-1"}
    page = tmp_path / "docs" / "page.md"
    page.write_text("[ok](good.md#under-zero-what-does-not-change) [self](#top) [gone](missing.md)\n"
                    "[bad anchor](good.md#under-zero) [web](https://example.com/x.md) `[code](nowhere.md)`\n"
                    "```\n[not a link](nowhere.md)\n```\n# Top\n")
    problems = broken_links(page, tmp_path)
    assert len(problems) == 2, problems
    assert "no such file docs/missing.md" in problems[0] and "#under-zero in docs/good.md" in problems[1]

    (tmp_path / "ds_q8").mkdir()
    (tmp_path / "ds_q8" / "__init__.py").write_text("")
    (tmp_path / "ds_q8" / "bench.py").write_text("")
    (tmp_path / "launch").mkdir()
    (tmp_path / "launch" / "compare.py").write_text("")
    probe = tmp_path / "probe.md"
    probe.write_text("python -m ds_q8.bench --n 4\npython -m ds_q8.no_such_module\npython -m pytest -q tests\n"
                     "`launch/compare.py` and `launch/no_such_script.py`.\n")
    problems = missing_names(probe, tmp_path)
    assert len(problems) == 2, problems
    assert "no module ds_q8.no_such_module" in problems[0] and "launch/no_such_script.py does not" in problems[1]
