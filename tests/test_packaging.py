"""requirements.txt and pyproject.toml declare the same packages, and every third-party import is declared."""
import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("shared", "extract", "train", "sample", "evaluate", "data")
# Import name -> distribution name where they differ.
DISTRIBUTION = {"sklearn": "scikit-learn", "PIL": "pillow", "huggingface_hub": "huggingface_hub"}
# Imported only behind a check that names the package (optional backends / trackers).
OPTIONAL = {"xformers", "wandb", "bitsandbytes"}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement.strip(), maxsplit=1)[0].lower().replace("-", "_")


def _requirements() -> set[str]:
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    return {line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_requirements_equal_pyproject_core_plus_demo_and_plots():
    project = _pyproject()
    extras = project["optional-dependencies"]
    assert _requirements() == set(project["dependencies"]) | set(extras["demo"]) | set(extras["plots"])


def test_every_third_party_import_of_the_product_is_declared():
    project = _pyproject()
    declared = {_name(r) for r in project["dependencies"]}
    declared |= {_name(r) for extra in project["optional-dependencies"].values() for r in extra}
    imported = set()
    for package in PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    imported |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    imported.add(node.module.split(".")[0])
    third_party = {m for m in imported if m not in sys.stdlib_module_names and m not in PRODUCT} - OPTIONAL
    missing = {m for m in third_party if _name(DISTRIBUTION.get(m, m)) not in declared}
    assert not missing, f"imported but not declared in pyproject.toml: {sorted(missing)}"
