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
    (tmp_path / "evaluate" / "ok.py").write_text("import numpy\nfrom shared.tokenizers.vae import VAE\nfrom evaluate import x\n")
    (tmp_path / "train" / "bad.py").write_text("def f():\n    from sample.decode import run_decode\n")
    (tmp_path / "shared" / "bad.py").write_text("import extract.folder\n")
    assert violations(tmp_path) == ["train/bad.py:2 imports sample", "shared/bad.py:1 imports extract"]
