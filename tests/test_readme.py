"""The README cannot rot: every command it shows is parsed by the real CLI parser (or exists)."""
import importlib
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_commands():
    """Each shell command in the README's ```bash blocks, continuation lines joined, comments dropped."""
    text = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


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


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_is_valid(command):
    words = shlex.split(command)
    module_call = split_module(words)
    if module_call:
        parser, args = parser_for(*module_call)
        parser.parse_args(args)  # SystemExit (status 2) on any unknown or malformed flag
    elif words[0] == "make":
        assert re.search(rf"^{words[1]}:", (ROOT / "Makefile").read_text(), flags=re.M)
    elif words[0] == "python":
        assert (ROOT / words[1]).is_file(), words[1]
    else:
        pytest.fail(f"README command not understood by this test: {command}")


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert "make test" in (ROOT / "README.md").read_text()
