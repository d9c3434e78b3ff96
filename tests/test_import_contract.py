"""The stages stand on shared/ only: no stage imports another (the orchestrators named below excepted).

extract -> latents -> train -> run folder -> sample -> images -> evaluate. What several stages need (the
model, diffusion maths, the VAE and its compatibility checks, shard format, pixel ranges, image-file rules,
the digits dataset) lives in shared/, which imports no stage. Every module is parsed with ast, so an import
inside a function counts as much as one at the top.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("extract", "train", "sample", "evaluate", "data")
COMMON = "shared"
# Modules that chain stages on purpose, and the stages each may import.
ORCHESTRATORS = {
    "data/demo.py": {"evaluate"},  # the demo runs the stages as commands and reads the curve's rows
}


def imported_packages(path: Path) -> set[tuple[str, int]]:
    """(top-level package, line) of every absolute import in a module, wherever it sits."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {(alias.name.split(".")[0], node.lineno) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add((node.module.split(".")[0], node.lineno))
    return found


def violations(root: Path = ROOT) -> list[str]:
    """'path:line imports stage' for each import that crosses from one stage (or shared/) into another stage."""
    found = []
    for package in (*STAGES, COMMON):
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            allowed = {package} | ORCHESTRATORS.get(rel, set())
            found += [f"{rel}:{line} imports {top}" for top, line in sorted(imported_packages(path))
                      if top in STAGES and top not in allowed]
    return found


def test_no_stage_imports_another_stage():
    assert violations() == []


def test_orchestrators_still_need_their_exceptions():
    """An exception nobody uses any more is removed, so the list only ever shrinks."""
    for rel, stages in ORCHESTRATORS.items():
        used = {top for top, _ in imported_packages(ROOT / rel)}
        assert stages <= used, f"{rel} no longer imports {stages - used}; drop it from ORCHESTRATORS"


def test_the_contract_catches_a_crossing(tmp_path):
    """The scan sees imports at the top and inside functions, `import x.y` and `from x.y import z` alike."""
    for package in (*STAGES, COMMON):
        (tmp_path / package).mkdir()
    (tmp_path / "evaluate" / "ok.py").write_text("import numpy\nfrom shared.tokenizers.tokenizer import VAE\nfrom evaluate import x\n")
    (tmp_path / "train" / "bad.py").write_text("def f():\n    from sample.decode import run_decode\n")
    (tmp_path / "shared" / "bad.py").write_text("import extract.folder\n")
    assert violations(tmp_path) == ["train/bad.py:2 imports sample", "shared/bad.py:1 imports extract"]


# ---------------------------------------------------------------------------------------------------------
# shared/runtime/ is plumbing (flags, errors, files, locks, processes): it imports no domain package of shared/
# ---------------------------------------------------------------------------------------------------------

PLUMBING = "shared/runtime"
DOMAIN = ("shared.generative", "shared.network", "shared.tokenizers", "shared.datasets", "shared.weights",
          "shared.sampling")
# Plumbing modules that still import domain code, each with what it imports; the list only ever shrinks.
PLUMBING_EXCEPTIONS: dict[str, set[str]] = {}


def imported_modules(path: Path) -> set[tuple[str, int]]:
    """(dotted module, line) of every absolute import in a module, wherever it sits."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {(alias.name, node.lineno) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add((node.module, node.lineno))
    return found


def domain_of(module: str) -> str | None:
    """The domain package a dotted module lies in, or None."""
    return next((d for d in DOMAIN if module == d or module.startswith(d + ".")), None)


def plumbing_violations(root: Path = ROOT) -> list[str]:
    """'path:line imports module' for each import of domain code by a shared/runtime/ module (exceptions aside)."""
    found = []
    for path in sorted((root / PLUMBING).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        allowed = PLUMBING_EXCEPTIONS.get(rel, set())
        found += [f"{rel}:{line} imports {module}" for module, line in sorted(imported_modules(path), key=lambda m: m[::-1])
                  if domain_of(module) and domain_of(module) not in allowed]
    return found


def test_runtime_imports_no_domain_code():
    assert plumbing_violations() == []


def test_plumbing_exceptions_are_still_needed():
    for rel, domains in PLUMBING_EXCEPTIONS.items():
        used = {domain_of(m) for m, _ in imported_modules(ROOT / rel)}
        assert domains <= used, f"{rel} no longer imports {domains - used}; drop it from PLUMBING_EXCEPTIONS"


def test_the_plumbing_contract_catches_a_domain_import(tmp_path):
    """Imports at the top and inside functions, `import x.y` and `from x.y import z`, are all seen."""
    (tmp_path / PLUMBING).mkdir(parents=True)
    (tmp_path / PLUMBING / "ok.py").write_text("import json\nfrom shared.runtime.cli import Flag\n")
    (tmp_path / PLUMBING / "flags.py").write_text(
        "from shared.generative.samplers import SAMPLERS\ndef f():\n    from shared.generative.objectives import x\n")
    (tmp_path / PLUMBING / "nested").mkdir()
    (tmp_path / PLUMBING / "nested" / "bad.py").write_text("import shared.tokenizers.tokenizer\n")
    assert plumbing_violations(tmp_path) == [
        "shared/runtime/flags.py:1 imports shared.generative.samplers",
        "shared/runtime/flags.py:3 imports shared.generative.objectives",
        "shared/runtime/nested/bad.py:1 imports shared.tokenizers.tokenizer"]
