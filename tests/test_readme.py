"""The README cannot rot: every command it and the topic files under docs/ show is parsed by the real CLI parser
(or exists), and the README stays short enough to read in ten minutes."""
import importlib
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")))
README_MAX_LINES = 250  # issue 28: the anchors' READMEs are 163 (DiT), 234 (nanoGPT) and 258 (edm2) lines


def commands_of(doc):
    """Each shell command in a doc's ```bash blocks, continuation lines joined, comments dropped."""
    text = (ROOT / doc).read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def readme_commands():
    """The README's commands."""
    return commands_of("README.md")


def doc_commands():
    """(doc, command) for every command of the README and of docs/*.md."""
    return [(doc, command) for doc in DOCS for command in commands_of(doc)]


def parser_for(module, args):
    """The argparse parser behind `python -m module`, and the arguments it receives."""
    if module == "sample" and args[:1] == ["watch"]:
        return importlib.import_module("sample.__main__").watch_parser(), args[1:]
    if module == "sample" and args[:1] == ["export"]:
        return importlib.import_module("sample.__main__").export_parser(), args[1:]
    if module == "sample" and args[:1] == ["decode"]:
        return importlib.import_module("sample.__main__").decode_parser(), args[1:]
    if module == "sample":
        return importlib.import_module("sample.__main__").sample_parser(), args
    if module == "train":
        return importlib.import_module("train.config").build_parser(), args
    if module == "evaluate" and args[:1] == ["reference"]:
        return importlib.import_module("evaluate.reference").reference_parser(), args[1:]
    if module == "evaluate" and args[:1] == ["run"]:
        return importlib.import_module("evaluate.curve").run_parser(), args[1:]
    if module == "evaluate":
        return importlib.import_module("evaluate.__main__").eval_parser(), args
    return importlib.import_module(f"{module}.__main__" if "." not in module else module).build_parser(), args


def split_module(words):
    """('module', args) for `python -m M ...` or `accelerate launch [opts] -m M ...`, else None."""
    if words[:2] == ["python", "-m"] or words[:2] == ["accelerate", "launch"]:
        at = words.index("-m")
        return words[at + 1], words[at + 2:]
    return None


def test_readme_has_commands():
    commands = readme_commands()
    assert any(c.startswith("make demo") for c in commands)
    assert any(c.startswith("make test") for c in commands)
    assert sum(c.startswith("python -m") for c in commands) >= 8


@pytest.mark.parametrize("doc, command", doc_commands())
def test_doc_command_is_valid(doc, command):
    words = shlex.split(command)
    module_call = split_module(words)
    if module_call:
        parser, args = parser_for(*module_call)
        parser.parse_args(args)  # SystemExit (status 2) on any unknown or malformed flag
    elif words[0] == "make":
        assert re.search(rf"^{words[1]}:", (ROOT / "Makefile").read_text(), flags=re.M)
    elif words[0] == "python":
        assert (ROOT / words[1]).is_file(), f"{doc}: {words[1]}"
    else:
        pytest.fail(f"{doc}: command not understood by this test: {command}")


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert "make test" in (ROOT / "README.md").read_text()


def test_readme_stays_short():
    """Everything beyond what it is, the two commands, one run and the choices lives in docs/*.md."""
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into a docs/<topic>.md file"


def test_every_topic_file_shows_a_command():
    """The command check above reaches the topic files (so it cannot pass vacuously on docs/)."""
    docs_with_commands = {doc for doc, _ in doc_commands() if doc != "README.md"}
    assert len(docs_with_commands) >= 8
