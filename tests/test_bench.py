"""The speed benchmark: matrix construction, error rows, MFU arithmetic and the real CLI."""
import json
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from shared.network.blocks import SELECTIVE
from shared.network.models import ModelConfig
from shared.runtime.errors import UserError
from tests.helpers import run_main
from train import bench
from train.memory import forward_macs

ROOT = Path(__file__).resolve().parents[1]


def parse(*flags):
    args = bench.build_parser().parse_args(list(flags))
    bench.resolve_defaults(args)
    return args


def test_flag_matrix_is_the_cartesian_product():
    configs = bench.resolve_matrix(parse("--precisions", "fp32,bf16", "--checkpointing", "0,2",
                                         "--attention", "sdpa,math", "--compile", "off,on", "--micro-batch-sizes", "2,4"))
    assert len(configs) == 32 and len(set(configs)) == 32
    assert configs[0] == bench.BenchConfig("fp32", 0, "sdpa", False, 2)


@pytest.mark.parametrize("flag, value, says", [("--steps", "0", "at least 1"), ("--warmup", "-1", "at least 0"),
                                               ("--threads", "0", "at least 1")])
def test_run_length_flags_are_refused_by_their_declared_bounds(flag, value, says):
    with pytest.raises(UserError, match=f"{flag} must be {says}; got {value}"):
        parse(flag, value)


def test_cpu_preset_puts_our_step_first_then_one_change_each():
    rows = bench.preset_matrix("cpu")
    ours = rows[0]
    assert ours.note == "ours" and ours.checkpoint == 1 and ours.precision == "bf16"
    changes = {r.note: r for r in rows[1:]}
    assert changes["checkpointing off"].checkpoint == 0
    assert changes["math attention"].attention == "math"
    assert changes["torch.compile"].compile
    assert {r.micro_batch for r in rows if r.note == "micro-batch sweep"} == {4, 16}


@pytest.mark.parametrize("preset", ["changes-cpu", "changes-gpu"])
def test_changes_presets_put_the_step_before_issue_34_beside_each_change(preset):
    rows = bench.preset_matrix(preset)
    before, now = rows[0], rows[1]
    assert before.host_sync and not before.compile and before.checkpoint == 0 and not now.host_sync
    assert now.adamw == "fused" and before.adamw == ("foreach" if preset == "changes-cpu" else "fused")
    changes = {r.note: r for r in rows[2:]}
    assert changes["foreach AdamW instead of fused"].adamw == "foreach"
    assert changes["regional compile"].compile and changes["selective checkpointing"].checkpoint == SELECTIVE
    together = changes["all: compile + selective"]
    assert together.compile and together.checkpoint == SELECTIVE and not together.host_sync


def test_a_sync_row_reads_the_step_and_a_foreach_row_swaps_the_optimizer(monkeypatch):
    reads, optimizers = [], []

    def spy(learner, batches):
        optimizers.append(type(learner.optimizer).__name__ + str(learner.optimizer.defaults["fused"]))
        result = real(learner, batches)
        return {k: Watched(v) for k, v in result.items()}

    class Watched:
        def __init__(self, value):
            self.value = value

        def __float__(self):
            reads.append("float")
            return float(self.value)

        def __bool__(self):
            reads.append("bool")
            return bool(self.value)

    real = bench.train_step
    monkeypatch.setattr(bench, "train_step", spy)
    args = parse("--model", "DiT-T/2", "--image-size", "32", "--steps", "1", "--warmup", "0")
    before = bench.BenchConfig("fp32", 0, "sdpa", False, 2, host_sync=True, adamw="foreach")
    assert bench.run_config(before, args, torch.device("cpu"), 1, None).error is None
    assert reads == ["float", "float", "bool"] and optimizers == ["AdamWNone"]
    reads.clear(), optimizers.clear()
    assert bench.run_config(bench.BenchConfig("fp32", SELECTIVE, "sdpa", False, 2), args, torch.device("cpu"), 1,
                            None).error is None
    assert reads == [] and optimizers == ["AdamWTrue"]


def test_preset_and_matrix_flags_together_are_refused():
    with pytest.raises(UserError, match="--precisions"):
        bench.resolve_matrix(parse("--preset", "cpu", "--precisions", "fp32"))
    with pytest.raises(UserError, match="fp8"):
        bench.resolve_matrix(parse("--precisions", "fp8"))


def test_a_failing_compile_becomes_an_error_row(monkeypatch):
    def broken_compile(model, **kwargs):
        raise RuntimeError("no C++ compiler here\nsecond line")

    monkeypatch.setattr(torch, "compile", broken_compile)
    args = parse("--model", "DiT-T/2", "--image-size", "32", "--steps", "1", "--warmup", "0")
    config = bench.BenchConfig("fp32", 0, "sdpa", True, 2)
    result = bench.run_config(config, args, torch.device("cpu"), 1, None)
    assert result.error == "RuntimeError: no C++ compiler here" and result.images_s is None
    assert "error: RuntimeError: no C++ compiler here" in bench.table([result])


def test_bench_times_the_trainers_own_step(monkeypatch, tmp_path):
    """Each timed step is train.step.train_step on a learner and micro-batch shaped as python -m train builds them."""
    from tests.helpers import make_latents
    from shared.datasets.shards import LatentDataset
    from train.loop import TrainingDraws

    seen = []

    def spy(learner, batches):
        batches = list(batches)
        seen.append((learner, batches))
        return real(learner, batches)

    real = bench.train_step
    monkeypatch.setattr(bench, "train_step", spy)
    args = parse("--model", "DiT-T/2", "--image-size", "32", "--steps", "2", "--warmup", "1")
    model = ModelConfig("DiT-T/2", 4).build(device="meta")
    flops = 6 * forward_macs(model)["total"]
    result = bench.run_config(bench.BenchConfig("bf16", 1, "math", False, 2), args, torch.device("cpu"), flops, 1.0)
    assert result.error is None and len(seen) == 3  # warm-up + timed steps, each one trainer step
    learner, batches = seen[-1]
    assert learner.step == 3 and learner.dit.training and learner.cfg.precision == "bf16"
    assert learner.cfg.grad_checkpoint == 1 and learner.cfg.attention == "math"
    assert not torch.equal(next(learner.ema.parameters()), next(learner.dit.parameters()))  # the EMA moved
    loader_batch = TrainingDraws(LatentDataset(make_latents(tmp_path / "lat")),
                                 0, 0.1, learner.objective).__getitems__([(0, 0), (1, 1)])
    assert len(batches) == 1 and batches[0].keys() == loader_batch.keys()
    assert all(batches[0][k].dtype == loader_batch[k].dtype for k in loader_batch)
    assert result.mfu == pytest.approx(flops * result.images_s / 1e12)


@pytest.mark.slow
def test_bench_cli_tiny(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "train.bench", "--model", "DiT-T/2", "--image-size", "32", "--precisions", "fp32,bf16",
         "--checkpointing", "0,1", "--attention", "sdpa,math,xformers", "--micro-batch-sizes", "2", "--steps", "1",
         "--warmup", "1", "--threads", "1", "--peak-tflops", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any("steps/s" in l and "images/s" in l and "MFU" in l and "vs baseline" in l for l in lines)
    for precision in ("fp32", "bf16"):
        for ckpt in (0, 1):
            for attention in ("sdpa", "math"):
                row = next(l for l in lines if l.startswith(f"{precision} ckpt={ckpt} {attention} mb=2"))
                assert "error" not in row and re.search(r"\d\.\d\dx +- +-$", row.rstrip()) and "%" in row
            # xformers cannot run on the CPU: the row says why, the run goes on
            row = next(l for l in lines if l.startswith(f"{precision} ckpt={ckpt} xformers mb=2"))
            assert "error: SettingError" in row and "xformers" in row
    assert " 1.00x " in next(l for l in lines if l.startswith("fp32 ckpt=0 sdpa"))
    payload = json.loads(out.read_text())
    assert len(payload["results"]) == 12
    ok = [r for r in payload["results"] if r["error"] is None]
    assert len(ok) == 8 and all(r["images_s"] > 0 for r in ok)


def test_bench_cli_refuses_bad_input(capsys):
    # main() in-process: the refusal's exit status and paragraph are cli_errors' (test_bench_cli_tiny runs the
    # real process); a process of its own would only add an interpreter.
    code, _, err = run_main(bench.main, ["--preset", "cpu", "--attention", "math"], capsys)
    assert code == 2 and "--attention" in err and "Traceback" not in err


def test_parser_flags_all_have_help():
    for action in bench.build_parser()._actions:
        assert action.help, action.dest


@pytest.mark.slow
def test_sigterm_keeps_the_rows_measured_so_far(tmp_path):
    """A time limit's SIGTERM after the first row: that row is printed and in the JSON, one line says it was cut."""
    out = tmp_path / "bench.json"
    # the second row (micro-batch 512, 50 steps) takes far longer than the first: the signal lands inside it
    proc = subprocess.Popen(
        [sys.executable, "-m", "train.bench", "--model", "DiT-T/2", "--image-size", "32", "--precisions", "fp32",
         "--checkpointing", "0", "--micro-batch-sizes", "2,512", "--steps", "50", "--warmup", "0", "--threads", "1",
         "--json", str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not out.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert out.exists() and proc.poll() is None, "no first row before the run ended or the deadline"
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    rows = json.loads(out.read_text())["results"]
    assert [r["micro_batch"] for r in rows] == [2] and rows[0]["images_s"] > 0
    assert any(l.startswith("fp32 ckpt=0 sdpa mb=2 ") for l in stdout.splitlines())
    assert "mb=512" not in stdout
    cut = [l for l in stderr.splitlines() if "cut by SIGTERM" in l]
    assert len(cut) == 1 and "after 1 of 2 rows" in cut[0] and str(out) in cut[0]
    assert "Traceback" not in stderr


def changes_args(*flags):
    return parse("--preset", "changes-gpu", "--model", "DiT-T/2", "--image-size", "64", *flags)


def test_changes_gpu_fits_its_micro_batch_to_the_free_memory():
    """The planner's largest divisor of 256 that fits the (faked) free memory, for every row, said in one line."""
    args, device = changes_args("--memory-cap-gib", "0"), torch.device("cpu")
    rows = bench.resolve_matrix(args)
    cfg = bench.bench_train_config(rows[0], args)
    model_cfg = bench.model_config_for(cfg, bench.latent_shape(64), 1000)
    (profile,), n_params, n_trainable = bench.measure_profiles(model_cfg, "bf16", [0], device)
    fixed = bench.fixed_state(n_params, n_trainable, "adamw", "gpu").total
    free = fixed + profile.peak(64) + (bench.parse_size(bench.DEFAULT_MARGIN) + 4 * n_trainable)  # 64 fits, 128 not
    planned, why = bench.plan_changes_micro(args, rows, device, free)
    assert {r.micro_batch for r in planned} == {64} and len(planned) == len(rows)
    assert [replace(r, micro_batch=256) for r in planned] == rows  # nothing else changed
    assert why.startswith("micro-batch 64: the largest divisor of 256") and bench.format_size(free) in why
    with pytest.raises(UserError, match="does not fit even at micro-batch 1"):  # a 1 MiB cap: nothing fits
        bench.plan_changes_micro(changes_args("--memory-cap-gib", "0.001"), rows, device, free)


def test_changes_gpu_off_cuda_keeps_the_presets_micro_batch_and_says_so():
    args = changes_args()
    rows = bench.resolve_matrix(args)
    planned, why = bench.plan_changes_micro(args, rows, torch.device("cpu"), bench.free_memory(torch.device("cpu")))
    assert planned == rows and {r.micro_batch for r in rows} == {256} and "no free CUDA memory" in why


def test_a_compile_row_reports_its_compile_seconds_and_recompiles_apart_from_its_step(monkeypatch):
    from train import step

    monkeypatch.setattr(step, "COMPILE_BACKEND", "eager")  # dynamo traces as under inductor, without building kernels
    args = parse("--model", "DiT-T/2", "--image-size", "32", "--steps", "2", "--warmup", "1")
    compiled = bench.run_config(bench.BenchConfig("fp32", 0, "sdpa", True, 2), args, torch.device("cpu"), 1, None)
    eager = bench.run_config(bench.BenchConfig("fp32", 0, "sdpa", False, 2), args, torch.device("cpu"), 1, None)
    assert compiled.error is None and compiled.compile_s > 0 and compiled.recompiles == 0
    assert eager.compile_s is None and eager.recompiles is None
    line = bench.table([compiled, eager]).splitlines()[2]
    assert re.search(rf" {compiled.compile_s:.1f} +0$", line)
