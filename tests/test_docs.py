"""The docs describe the code as it is: every path, module, name and file they mention exists."""
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/ARCHITECTURE.md")
REPO_PATH = re.compile(r"^(shared|train|sample|extract|data|tests|docs|\.ci)/[\w./-]*$|^requirements[\w-]*\.txt$")
DOTTED = re.compile(r"^(shared|train|sample|extract|data)(\.\w+)+$")
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
    return "\n".join(p.read_text() for d in ("shared", "train", "sample", "extract", "data")
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
