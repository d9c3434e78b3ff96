"""tests/bench/gpu_check.sh without a GPU: its dry run runs every part's command at a tiny size on the CPU, its budget
table adds up, a part that cannot finish in what is left is skipped, and gpu_fixtures.py's missing-package line."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "bench" / "gpu_check.sh"
PARTS = ["gpu-info", "step-changes", "fixtures-latents", "train-3090", "plan-verify-3090", "plan-verify-ditdh-xl",
         "fixtures-weights", "sample-dpm1", "sample-dpm2", "sample-ddpm", "bench-sample"]


def dry_run(out: Path, **env) -> subprocess.CompletedProcess:
    """GPU_CHECK_DRY=1 bash tests/bench/gpu_check.sh OUT with this interpreter."""
    return subprocess.run(["bash", str(SCRIPT), str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "GPU_CHECK_DRY": "1", "PYTHON": sys.executable, **env})


def test_the_budget_table_is_the_parts_limits_in_order_and_fits_480_s():
    text = SCRIPT.read_text()
    table = re.findall(r"^#   ([a-z0-9-]+) +(\d+) +(\d+) ", text, re.M)
    called = re.findall(r"^ *part ([a-z0-9-]+) (\d+) ", text, re.M)
    assert [(name, int(limit)) for name, limit, _ in table] == [(name, int(limit)) for name, limit in called]
    assert [name for name, _ in called] == PARTS
    running = 0
    for _, limit, total in table:
        running += int(limit)
        assert int(total) == running
    assert running <= 480


def test_a_part_that_cannot_finish_in_what_is_left_is_not_started(tmp_path):
    proc = dry_run(tmp_path / "out", GPU_CHECK_BUDGET="15")  # x3 in the dry run: 45 s, gpu-info's 30 s fits
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "== gpu-info: exit 0" in proc.stdout and "torch" in (tmp_path / "out" / "gpu-info.txt").read_text()
    for name in ("step-changes", "fixtures-latents", "train-3090", "plan-verify-3090", "bench-sample"):
        assert re.search(rf"== {name}: skipped, its \d+ s limit does not fit the \d+ s left", proc.stdout), name
    assert "== sampling: skipped" in proc.stdout and not (tmp_path / "out" / "run-3090").exists()


@pytest.mark.slow
def test_the_dry_run_runs_every_part(tmp_path):
    out = tmp_path / "out"
    proc = dry_run(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in PARTS:
        assert f"== {name}: exit 0 after" in proc.stdout, (name, (out / f"{name}.txt").read_text()[-2000:])
    rows = json.loads((out / "step-changes.json").read_text())["results"]
    assert len(rows) == 7 and all(r["error"] is None for r in rows)
    assert "micro-batch 256: the preset's" in (out / "step-changes.txt").read_text()
    assert len((out / "run-3090" / "metrics.jsonl").read_text().splitlines()) == 2
    assert "3090 setting:" in (out / "train-3090.txt").read_text()
    for name in ("plan-verify-3090", "plan-verify-ditdh-xl"):
        assert "--micro-batch-size" in (out / f"{name}.txt").read_text()
    assert [len(list((out / s).glob("0*.png"))) for s in ("s-dpm1", "s-dpm2", "s-ddpm")] == [2, 4, 2]
    assert "images/s" in (out / "sample.txt").read_text()
    assert json.loads((out / "bench-sample.json").read_text())


def test_a_missing_package_of_the_fixtures_is_one_line_naming_the_wheels(tmp_path):
    block = ("import runpy, sys; sys.modules['diffusers'] = None; sys.argv = sys.argv[1:]; "
             "runpy.run_path(sys.argv[0], run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", block, "tests/bench/gpu_fixtures.py", str(tmp_path), "--what", "vae"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs diffusers" in lines[0] and "diffusers-0.42.1-py3-none-any.whl" in lines[0]
    assert not list(tmp_path.iterdir())  # refused before writing anything
