"""Ctrl-C (issue 38): every command, at any point, its imports included, ends in one line with exit status 130.

Real processes in their own process group, sent SIGINT to the whole group as a terminal's Ctrl-C is (DataLoader
workers included): during the imports (once torch's library is loaded, seconds before any work) and during the
work. Nothing may be left half-written, and the rerun of the same command must finish. The extract and train
stages' mid-work interrupts are tested beside their SIGKILL tests (tests/test_extract.py, tests/test_train.py).
"""
import ast
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shared.network.models import ModelConfig
from shared.runtime.interrupt import EXIT_STATUS, MESSAGE
from tests.helpers import NUM_CLASSES, random_dit

ROOT = Path(__file__).resolve().parents[1]
ENV = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


class Command:
    """`python -m MODULE ARGS` as a real process leading its own process group, its output in files."""

    def __init__(self, folder: Path, module: str, *args, env=None):
        folder.mkdir(parents=True, exist_ok=True)
        self.stderr = folder / "stderr.txt"
        with open(folder / "stdout.txt", "w") as out, open(self.stderr, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", module, *map(str, args)], cwd=ROOT, stdout=out,
                                         stderr=err, start_new_session=True,
                                         env={**os.environ, "PYTHONPATH": str(ROOT), **ENV, **(env or {})})

    def wait_until(self, ready, timeout: float = 240.0) -> None:
        """Poll until ready() holds; fail if the process ends first or the time runs out."""
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.proc.poll() is None, f"ended before the interrupt: {self.stderr.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "timed out waiting for the moment to interrupt"
            time.sleep(0.02)

    def importing_torch(self) -> bool:
        """Whether torch's C++ library is mapped: the process is inside its imports (torch's take seconds)."""
        try:
            return "libtorch_cpu" in Path(f"/proc/{self.proc.pid}/maps").read_text()
        except OSError:
            return False

    def ctrl_c(self) -> None:
        """SIGINT to the whole process group, as a terminal's Ctrl-C."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def interrupted(self, prog: str) -> str:
        """Wait for the end; assert status 130, the one line last on stderr, no traceback; the stderr text."""
        rc = self.proc.wait(timeout=120)
        err = self.stderr.read_text()
        assert rc == EXIT_STATUS, f"exit status {rc}: {err[-3000:]}"
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
        assert err.count(MESSAGE) == 1, err[-3000:]
        assert err.rstrip("\n").splitlines()[-1].split("\r")[-1] == f"{prog}: {MESSAGE}", err[-3000:]
        return err


def temp_files(folder: Path) -> list[Path]:
    """Leftovers of unfinished writes anywhere under `folder` (shared/runtime/fsio.py's temp names)."""
    return [p for p in folder.rglob(".tmp-*")]


# ----------------------------------------------------------------------------------------------------------
# During the imports: before any try/except of main() exists
# ----------------------------------------------------------------------------------------------------------

# The commands whose imports load torch (seconds: a window the test can hit). `python -m train.plot` loads no torch
# (its imports take milliseconds); its guard is checked with every command's by the test after this one.
COMMANDS = ["extract", "train", "sample", "evaluate", "train.plan", "train.bench", "data.demo"]


@pytest.mark.parametrize("module", COMMANDS)
def test_ctrl_c_during_the_imports(tmp_path, module):
    # Flags a command would run with: were the interrupt to come after the imports, it would still be work.
    command = Command(tmp_path, module, "--help")
    command.wait_until(command.importing_torch)
    command.ctrl_c()
    err = command.interrupted(f"python -m {module}")
    assert err.strip() == f"python -m {module}: {MESSAGE}"  # nothing else: not even the help was printed
    assert not (tmp_path / "stdout.txt").read_text()


def _cli_modules() -> list[Path]:
    """Every module of the project that runs as a command (`if __name__ == "__main__"`), tests aside."""
    found = []
    for folder in ("extract", "train", "sample", "evaluate", "data"):
        found += [p for p in sorted((ROOT / folder).rglob("*.py")) if '__name__ == "__main__"' in p.read_text()]
    return found


@pytest.mark.parametrize("path", _cli_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_guards_its_imports_and_its_work(path):
    """The subprocess tests above cover the stages; this holds every other command to the same two lines."""
    tree = ast.parse(path.read_text())
    body = [node for node in tree.body if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
    imports = [i for i, node in enumerate(body) if isinstance(node, (ast.Import, ast.ImportFrom))
               and not (isinstance(node, ast.ImportFrom) and node.module in ("__future__", "shared.runtime.interrupt"))]
    guard = [i for i, node in enumerate(body) if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
             and getattr(node.value.func, "id", None) == "guard_imports"]
    assert guard and guard[0] < imports[0], f"{path.name}: guard_imports(__name__) must come before the imports"
    main = next(node for node in body if isinstance(node, ast.FunctionDef) and node.name == "main")
    assert any(getattr(getattr(d, "func", None), "id", None) == "interruptible" for d in main.decorator_list), (
        f"{path.name}: main() must run under @interruptible(PROG)")


# ----------------------------------------------------------------------------------------------------------
# During the work
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    """A random DiT-T/2 state dict in the official layout (16 px images through the tiny VAE)."""
    path = tmp_path_factory.mktemp("weights") / "DiT-T-2-16x16.pt"
    torch.save(random_dit(ModelConfig("DiT-T/2", input_size=8, in_channels=4, num_classes=NUM_CLASSES)).state_dict(),
               path)
    return path


@pytest.mark.slow
def test_ctrl_c_while_sampling_keeps_whole_images_and_resumes(tmp_path, weights, tiny_vae_dir):
    out = tmp_path / "out"
    args = ["--ckpt", weights, "--vae", tiny_vae_dir, "--out", out, "--num-samples", 12, "--batch-size", 2,
            "--num-sampling-steps", 4, "--cpu", "--npz"]
    command = Command(tmp_path / "first", "sample", *args)
    command.wait_until(lambda: len(list(out.glob("[0-9]*.png"))) >= 2)  # mid-run: some images drawn, most not
    command.ctrl_c()
    command.interrupted("python -m sample")
    kept = sorted(out.glob("[0-9]*.png"))
    assert 2 <= len(kept) < 12 and not (out / "samples.npz").exists()
    assert not temp_files(out)
    again = Command(tmp_path / "again", "sample", *args)
    assert again.proc.wait(timeout=300) == 0, again.stderr.read_text()[-3000:]
    assert len(list(out.glob("[0-9]*.png"))) == 12 and (out / "samples.npz").is_file()


@pytest.mark.slow
def test_ctrl_c_of_the_demo_stops_its_stage_and_says_one_line(tmp_path):
    out = tmp_path / "demo"
    command = Command(tmp_path / "first", "data.demo", "--quick", "--out", out)
    command.wait_until(lambda: (out / "latents").is_dir() and any((out / "latents").glob("*.json")))  # extracting
    command.ctrl_c()
    err = command.interrupted("python -m data.demo")  # the stage was told to stay silent: one line in all
    assert "python -m extract: interrupted" not in err
    assert not temp_files(out)
