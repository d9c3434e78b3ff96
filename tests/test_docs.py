"""The docs describe the code as it is: every path, module, name, signature and file they mention exists, every
link between them lands on a file and heading that exist, and the module lists (ARCHITECTURE's table of shared/,
each stage package's docstring) name every module. "The docs" are README.md and every docs/*.md."""
import ast
import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")))
STAGES = ("extract", "train", "sample", "evaluate", "data")
REPO_PATH = re.compile(r"^(shared|train|sample|extract|evaluate|data|tests|docs|\.ci)/[\w./-]*$|^requirements[\w-]*\.txt$")
DOTTED = re.compile(r"^(shared|train|sample|extract|evaluate|data)(\.\w+)+$")
FILE_NAME = re.compile(r"^(?!requirements)[a-z][\w-]*\.(json|jsonl|npz|safetensors|pt|txt)$")


def spans(doc: str) -> list[str]:
    """The text of every `code span` in a doc, and the first word of each ``` block line."""
    text = (ROOT / doc).read_text()
    found = re.findall(r"`([^`\n]+)`", text)
    for block in re.findall(r"```\w*\n(.*?)```", text, flags=re.S):
        found += block.split()
    return found


def mentions(pattern) -> list[tuple[str, str]]:
    """(doc, token) for every token of the docs that matches `pattern` (whole word in a span)."""
    out = set()
    for doc in DOCS:
        for span in spans(doc):
            for word in re.split(r"[\s(),:=]+", span):
                word = word.strip("'\"").rstrip(".")
                if pattern.match(word):
                    out.add((doc, word))
    return sorted(out)


def python_sources() -> str:
    """All project Python code (where the names of written files must appear)."""
    return "\n".join(p.read_text() for d in ("shared", *STAGES)
                     for p in (ROOT / d).rglob("*.py"))


@pytest.mark.parametrize("doc, path", mentions(REPO_PATH))
def test_every_repository_path_exists(doc, path):
    assert (ROOT / path).exists(), f"{doc} names {path}, which does not exist"


@pytest.mark.parametrize("doc, name", mentions(DOTTED))
def test_every_dotted_name_resolves(doc, name):
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
        module = ".".join(parts[:cut])
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a prefix that is a module, not a package
            found = False
        if found:
            obj = importlib.import_module(module)
            for attr in parts[cut:]:
                assert hasattr(obj, attr), f"{doc} names {name}: {module} has no {attr}"
                obj = getattr(obj, attr)
            return
    pytest.fail(f"{doc} names {name}, which is no module")


def test_every_python_m_module_exists():
    for doc in DOCS:
        for module in re.findall(r"python -m ([\w.]+)", (ROOT / doc).read_text()):
            if module in ("pytest", "venv", "pip"):
                continue
            assert importlib.util.find_spec(module) is not None, f"{doc}: python -m {module}"


@pytest.mark.parametrize("doc, name", mentions(FILE_NAME))
def test_every_file_the_docs_describe_is_written_by_the_code(doc, name):
    assert f'"{name}"' in python_sources(), f"{doc} describes {name}, but no code names that file"


# ---------------------------------------------------------------------------------------------------------
# Links: README.md and docs/*.md form one set of pages; every relative link lands on a file and a heading
# ---------------------------------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def without_code_blocks(text: str) -> str:
    """The text with ``` blocks removed (a shell comment inside one is no heading)."""
    return re.sub(r"```.*?```", "", text, flags=re.S)


def without_code(text: str) -> str:
    """The text with ``` blocks and `code spans` removed (links inside code are not links)."""
    return re.sub(r"`[^`\n]*`", "", without_code_blocks(text))


def heading_anchors(doc: str) -> set[str]:
    """The anchors GitHub makes for a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    anchors = set()
    for title in re.findall(r"^#{1,6} (.+)$", without_code_blocks((ROOT / doc).read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


def relative_links() -> list[tuple[str, str]]:
    """(doc, link) for every link of the docs that is not a URL."""
    out = []
    for doc in DOCS:
        for link in LINK.findall(without_code((ROOT / doc).read_text())):
            if not re.match(r"^[a-z]+:", link):
                out.append((doc, link))
    return sorted(set(out))


def test_the_docs_have_links():
    """The link check below sees the README's links to the topic files (so it cannot pass vacuously)."""
    assert ("README.md", "docs/ARCHITECTURE.md") in relative_links()
    assert len(relative_links()) >= 20


@pytest.mark.parametrize("doc, link", relative_links())
def test_every_link_lands(doc, link):
    """The file exists (relative to the linking page) and so does the heading its #anchor names."""
    path, _, anchor = link.partition("#")
    target = (ROOT / doc).parent / path if path else ROOT / doc
    assert target.exists(), f"{doc} links to {link}: no file {path}"
    if anchor:
        page = target.resolve().relative_to(ROOT).as_posix()
        assert anchor in heading_anchors(page), f"{doc} links to {link}: {page} has no heading #{anchor}"


def test_every_topic_file_is_linked_from_the_readme():
    """A newcomer finds every docs/*.md from the README."""
    linked = {link.partition("#")[0] for doc, link in relative_links() if doc == "README.md"}
    for doc in DOCS[1:]:
        assert doc in linked, f"README.md does not link to {doc}"


# ---------------------------------------------------------------------------------------------------------
# The walk of one image (ARCHITECTURE): its steps name real files and functions, and its counts are its own
# ---------------------------------------------------------------------------------------------------------

def walk_steps() -> list[tuple[list[str], list[str]]]:
    """(files, dotted names) named by each numbered step of ARCHITECTURE's walk of one image, in order."""
    text = (ROOT / "docs/ARCHITECTURE.md").read_text()
    section = re.search(r"^## The walk of one image\n(.*?)(?=^## )", text, flags=re.S | re.M).group(1)
    steps = re.findall(r"^\d+\. (.*?)(?=^\d+\. |^\*\*|^The walk opens|\Z)", section, flags=re.S | re.M)
    out = []
    for step in steps:
        words = re.findall(r"`([^`\n]+)`", step)
        out.append(([w for w in words if REPO_PATH.match(w) and w.endswith(".py")],
                    [w for w in words if DOTTED.match(w)]))
    return out


def module_file(name: str) -> str:
    """The repository path of the file that defines what a dotted name names (not one that only imports it)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            spec = importlib.util.find_spec(".".join(parts[:cut]))
        except ModuleNotFoundError:
            spec = None
        if spec is not None and spec.origin:
            obj = importlib.import_module(".".join(parts[:cut]))
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
            defined_in = getattr(obj, "__module__", None) if cut < len(parts) else None
            origin = importlib.util.find_spec(defined_in).origin if defined_in else spec.origin
            return Path(origin).resolve().relative_to(ROOT).as_posix()
    raise AssertionError(f"{name} is no module")


def walk_counts() -> tuple[int, int]:
    """(files the walk opens, files it comes back to after a step that does not name them)."""
    seen, back, previous = set(), set(), set()
    for files, _ in walk_steps():
        back |= {f for f in files if f in seen and f not in previous}
        seen |= set(files)
        previous = set(files)
    return len(seen), len(back)


def test_walk_names_the_file_of_every_function():
    """Each step names the file of every function it names, so the file count is the files a reader opens."""
    steps = walk_steps()
    assert len(steps) >= 20
    for files, names in steps:
        assert files and names
        for name in names:
            assert module_file(name) in files, f"the walk names {name} without its file {module_file(name)}"


def test_walk_states_its_own_counts():
    text = (ROOT / "docs/ARCHITECTURE.md").read_text()
    stated = re.search(r"The walk opens \*\*(\d+) files\*\* and comes back to \*\*(\d+) of them\*\*", text)
    assert stated, "docs/ARCHITECTURE.md states no file count for the walk of one image"
    assert tuple(map(int, stated.groups())) == walk_counts()


# ---------------------------------------------------------------------------------------------------------
# Signatures: every `def` in a ```python block under a "## pkg/module.py" heading is the code's signature
# ---------------------------------------------------------------------------------------------------------

def documented_signatures() -> list[tuple[str, str | None, str, str]]:
    """(module, class or None, function name, parameter text) of each def in ARCHITECTURE's python blocks."""
    text = (ROOT / "docs/ARCHITECTURE.md").read_text()
    found = []
    for section in re.finditer(r"^## (\w+(?:/\w+)+)\.py[^\n]*\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M):
        module = section.group(1).replace("/", ".")
        for block in re.findall(r"```python\n(.*?)```", section.group(2), flags=re.S):
            owner, lines = None, [line.split("  #")[0].rstrip() for line in block.splitlines()]
            for i, code in enumerate(lines):
                if re.match(r"^class (\w+)", code):
                    owner = re.match(r"^class (\w+)", code).group(1)
                elif re.match(r"^\s*def \w+\(", code):
                    while code.count("(") > code.count(")"):  # a signature over several lines
                        i += 1
                        code += " " + lines[i].strip()
                    indent, name = re.match(r"^(\s*)def (\w+)\(", code).groups()
                    found.append((module, owner if indent else None, name, _inside_parentheses(code)))
                elif code and not code.startswith((" ", "@")):
                    owner = None
    return found


def _inside_parentheses(code: str) -> str:
    """The text between a def's opening parenthesis and the one that closes it."""
    start = code.index("(")
    depth = 0
    for i in range(start, len(code)):
        depth += {"(": 1, ")": -1}.get(code[i], 0)
        if depth == 0:
            return code[start + 1:i]
    raise AssertionError(f"unbalanced signature in docs/ARCHITECTURE.md: {code}")


def test_the_docs_show_signatures():
    """The parser of the check finds the signatures the doc shows (so the next test cannot pass vacuously)."""
    names = {(m, o, n) for m, o, n, _ in documented_signatures()}
    assert ("shared.datasets.shards", "LatentDataset", "__init__") in names and ("shared.datasets.shards", None, "draw_latents") in names
    assert len(names) >= 20


@pytest.mark.parametrize("module, owner, name, params", documented_signatures())
def test_documented_signature_is_the_code(module, owner, name, params):
    """Same parameters in the same order, and the same defaults, as the function the doc names."""
    mod = importlib.import_module(module)
    target = getattr(getattr(mod, owner), name) if owner else getattr(mod, name)
    doc = ast.parse(f"def f({params}): pass").body[0].args
    positional = doc.posonlyargs + doc.args
    shown = [a.arg for a in positional + doc.kwonlyargs if a.arg not in ("self", "cls")]
    defaults = {a.arg: d for a, d in zip(positional[::-1], doc.defaults[::-1])}
    defaults.update({a.arg: d for a, d in zip(doc.kwonlyargs, doc.kw_defaults) if d is not None})
    real = inspect.signature(target).parameters
    named = [p for p in real if p not in ("self", "cls")
             and real[p].kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    where = f"docs/ARCHITECTURE.md shows {module}.{owner + '.' if owner else ''}{name}({params})"
    assert shown == named, f"{where}; the code takes {named}"
    for arg, expr in defaults.items():
        value = eval(ast.unparse(expr), vars(mod))  # names such as torch.float32 resolve in the module
        assert real[arg].default == value, f"{where}; the code's default of {arg} is {real[arg].default!r}"


# ---------------------------------------------------------------------------------------------------------
# Module lists
# ---------------------------------------------------------------------------------------------------------

def modules_of(package: str) -> set[str]:
    """The module files of a package, without __init__ and __main__."""
    return {p.stem for p in (ROOT / package).glob("*.py")} - {"__init__", "__main__"}


def shared_modules() -> set[str]:
    """Every module file under shared/'s subpackages, as a repository path."""
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / "shared").rglob("*.py") if p.stem != "__init__"}


def test_architecture_table_names_every_shared_module():
    """Each shared/ module has its row in ARCHITECTURE's table of owners, and each stage package its own."""
    rows = re.findall(r"^\| `([\w/.]+)` \|", (ROOT / "docs/ARCHITECTURE.md").read_text(), flags=re.M)
    assert shared_modules() <= set(rows)
    assert {f"{stage}/" for stage in STAGES} <= set(rows)


@pytest.mark.parametrize("package", STAGES)
def test_package_docstring_lists_every_module(package):
    """A stage's package docstring lists its modules: all of them, and none that is gone."""
    doc = importlib.import_module(package).__doc__ or ""
    listed = set(re.findall(r"\b(\w+)\.py\b", doc.split("Modules:", 1)[-1]))
    assert listed == modules_of(package), f"{package}/__init__.py lists {sorted(listed)}"
