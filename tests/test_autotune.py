"""`auto` micro-batch, precision and checkpointing (train/autotune.py), and the accelerate config (train/launcher.py).

The GPU is described through train.autotune.probe_device (the one seam: free memory, bf16 support), so
the planner runs for real on the CPU, as `python -m train.plan` does without a GPU. The real-step
confirmation needs CUDA; its step-down logic is driven here by a measurement function.
"""
import json
import re
import sys

import pytest

from shared.network.models import ModelConfig
from train import autotune, memory
from train.autotune import DeviceInfo
from train.config import TrainConfig
from train.units import parse_size
from tests.helpers import cli, expect_user_error, finish, run_inprocess, train_args

PER_PROCESS = 8  # train_args' global batch, one process
MODEL = ModelConfig(model="DiT-T/2", input_size=4, in_channels=4, num_classes=4)  # what the tiny latents give


def _planner(precision: str, budget: int) -> dict:
    """train.memory's rows (as python -m train.plan's) for auto's checkpointing choices at this budget: {interval: PlanRow}."""
    profiles, n_params, n_trainable = memory.measure_profiles(MODEL, precision, autotune.CHECKPOINT_ORDER,
                                                              memory.measure_device("cpu"))
    fixed = memory.fixed_state(n_params, n_trainable, "adamw", "gpu")
    return {p.every: memory.plan_row(p, fixed.total, budget, PER_PROCESS) for p in profiles}


def _tight_gpu(precision="bf16") -> tuple[DeviceInfo, dict]:
    """A fake GPU whose free memory fits the whole batch of 8 only with some checkpointing."""
    margin = parse_size(memory.DEFAULT_MARGIN)
    rows = _planner(precision, budget=10**15)
    off, every = rows[0].profile, rows[1].profile
    fixed = rows[0].peak - off.peak(PER_PROCESS)
    budget = fixed + every.peak(PER_PROCESS)  # every block checkpointed: exactly 8 fits
    assert fixed + off.peak(PER_PROCESS) > budget, "no checkpointing must not fit 8 at this budget"
    info = DeviceInfo(type="cuda", name="fake GPU", free_memory=budget + margin, total_memory=2 * budget, bf16=True)
    return info, _planner(precision, budget)


def _config(run) -> dict:
    return json.loads((run / "config.json").read_text())


def test_auto_resolves_to_the_planners_answer_and_the_run_config_records_it(latents, tmp_path, monkeypatch):
    info, rows = _tight_gpu()
    # The spec: the least recomputation (0, every 4th, 2nd, every block) that runs the whole batch of 8.
    expected = next(k for k in autotune.CHECKPOINT_ORDER if k in rows and rows[k].micro == PER_PROCESS)
    assert expected != 0 and rows[0].micro < PER_PROCESS
    monkeypatch.setattr(autotune, "probe_device", lambda device: info)
    run = run_inprocess(latents, tmp_path / "run", "--max-steps", "1")
    cfg = _config(run)
    assert (cfg["micro_batch_size"], cfg["grad_checkpoint"], cfg["precision"]) == (PER_PROCESS, expected, "bf16")
    record = cfg["autotune"]
    assert record["requested"] == {"micro_batch_size": "auto", "precision": "auto", "grad_checkpoint": "auto"}
    assert record["device"]["free_memory"] == info.free_memory
    assert record["predicted_peak"] == rows[expected].peak <= record["budget"]
    assert {r["grad_checkpoint"]: r["micro"] for r in record["plan"]} == {k: r.micro for k, r in rows.items()}
    assert f"auto (fake GPU, " in (run / "log.txt").read_text()


def test_a_smaller_gpu_gets_a_smaller_micro_batch_and_the_same_global_batch(latents, tmp_path, monkeypatch):
    info, rows = _tight_gpu()
    info.free_memory -= 1  # one byte less: every block checkpointed no longer runs 8 at once
    rows = _planner("bf16", info.free_memory - parse_size(memory.DEFAULT_MARGIN))
    best = max(r.micro for r in rows.values() if r.micro)
    assert best < PER_PROCESS
    monkeypatch.setattr(autotune, "probe_device", lambda device: info)
    cfg = _config(run_inprocess(latents, tmp_path / "run", "--max-steps", "1"))
    assert cfg["micro_batch_size"] == best and cfg["grad_accum_steps"] == PER_PROCESS // best
    assert cfg["global_batch_size"] == PER_PROCESS


def test_the_real_step_steps_the_micro_batch_down_when_it_does_not_fit():
    info, rows = _tight_gpu()
    cfg = TrainConfig(latents="x", results_dir="y", model="DiT-T/2", global_batch_size=PER_PROCESS)
    budget = info.free_memory - parse_size(memory.DEFAULT_MARGIN)
    seen = []

    def measure(cfg, model_config, micro, every, accumulation, cap):  # as train.memory.verify would report on CUDA
        seen.append((micro, every, accumulation))
        assert cap == budget
        return budget + 1 if micro > 2 else budget - 1  # the allocator needs more than planned above 2

    autotune.resolve_auto(cfg, MODEL, info, 1, measure)
    assert seen == [(8, 1, 1), (4, 1, 2), (2, 1, 4)]  # 8 and 4 did not fit; 2 did
    assert cfg.micro_batch_size == 2 and cfg.autotune["confirmed"][-1] == {"micro": 2, "peak": budget - 1}


def test_nothing_fits_is_one_paragraph(latents, capsys, monkeypatch, tmp_path):
    free = parse_size(memory.DEFAULT_MARGIN) + parse_size("10MiB")  # DiT-T/2's fixed state alone is ~80 MiB
    monkeypatch.setattr(autotune, "probe_device", lambda d: DeviceInfo("cuda", "tiny GPU", free, 2**31, True))
    message = expect_user_error(capsys, train_args(latents, tmp_path / "run", "--max-steps", "1"))
    assert "DiT-T/2 does not fit on tiny GPU" in message and "--optimizer adamw8bit" in message
    assert not (tmp_path / "run").exists()


def test_explicit_flags_win_and_the_cpu_gets_fp32_whole_batch(latents, tmp_path, monkeypatch):
    cfg = _config(run_inprocess(latents, tmp_path / "cpu", "--max-steps", "1"))
    assert (cfg["micro_batch_size"], cfg["grad_checkpoint"], cfg["precision"]) == (PER_PROCESS, 0, "fp32")
    assert cfg["autotune"]["device"]["type"] == "cpu"
    info, _ = _tight_gpu()
    monkeypatch.setattr(autotune, "probe_device", lambda device: info)
    cfg = _config(run_inprocess(latents, tmp_path / "explicit", "--max-steps", "1", "--precision", "fp32",
                                "--micro-batch-size", "2", "--grad-checkpoint", "0"))
    assert (cfg["micro_batch_size"], cfg["grad_checkpoint"], cfg["precision"]) == (2, 0, "fp32")
    assert cfg["autotune"] == {}  # nothing was auto


def test_older_gpus_get_fp16():
    assert autotune.auto_precision(DeviceInfo("cuda", bf16=False)) == "fp16"
    assert autotune.auto_precision(DeviceInfo("cuda", bf16=True)) == "bf16"
    assert autotune.auto_precision(DeviceInfo("cpu")) == "fp32"


# ---------------------------------------------------------------------------------------------------------
# The accelerate config: respected (precision) or refused (sharding), through the real launcher
# ---------------------------------------------------------------------------------------------------------

ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]


def _yaml(path, distributed="'NO'", precision="'no'", cpu="true", extra=""):
    path.write_text(f"compute_environment: LOCAL_MACHINE\ndistributed_type: {distributed}\nnum_processes: 1\n"
                    f"num_machines: 1\nmachine_rank: 0\nmixed_precision: {precision}\nuse_cpu: {cpu}\n{extra}")
    return path


def _refused(proc) -> str:
    """The paragraph of a `python -m train` that exited 2 under `accelerate launch`.

    accelerate's simple launcher reports any failed child with its own traceback (CalledProcessError,
    exit 1); what matters is the training process: one paragraph, exit status 2, no traceback of ours.
    """
    _, err = proc.communicate(timeout=300)
    err = " ".join(err.split())
    assert proc.returncode != 0 and "python -m train: error:" in err, err[-2000:]
    ours = err.split("python -m train: error:", 1)[1].split("Traceback", 1)[0]
    assert re.search(r"returned non-zero exit status 2|exitcode: 2", err) and 'File "' not in ours, err[-2000:]
    return "python -m train: error:" + ours


@pytest.mark.slow
def test_a_bf16_accelerate_config_is_followed_or_a_contradiction_refused(latents, tmp_path):
    config = _yaml(tmp_path / "bf16.yaml", precision="bf16")
    run = tmp_path / "run"
    finish(cli(ACCELERATE + ["--config_file", str(config), "-m", "train",
                             *train_args(latents, run, "--max-steps", "1")], {"OMP_NUM_THREADS": "1"}))
    assert _config(run)["precision"] == "bf16"
    other = tmp_path / "other"
    proc = cli(ACCELERATE + ["--config_file", str(config), "-m", "train",
                             *train_args(latents, other, "--max-steps", "1", "--precision", "fp32")])
    err = _refused(proc)
    assert "--precision fp32, but the accelerate config asks for mixed_precision bf16" in err
    assert "--mixed_precision no" in err and not other.exists()


@pytest.mark.slow
def test_fsdp_accelerate_config_is_refused_before_anything_is_written(latents, tmp_path):
    config = _yaml(tmp_path / "fsdp.yaml", distributed="FSDP", cpu="false",
                   extra="fsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n")
    run = tmp_path / "run"
    proc = cli(ACCELERATE + ["--config_file", str(config), "-m", "train",
                             *train_args(latents, run, "--max-steps", "1")], {"OMP_NUM_THREADS": "1"})
    err = _refused(proc)
    assert "python -m train: error: the accelerate config asks for FSDP, which this trainer does not support" in err
    assert not run.exists()


@pytest.mark.parametrize("variable, name", [("ACCELERATE_USE_DEEPSPEED", "DeepSpeed"),
                                             ("ACCELERATE_USE_MEGATRON_LM", "Megatron-LM")])
def test_deepspeed_and_megatron_environments_are_refused(latents, tmp_path, capsys, monkeypatch, variable, name):
    # DeepSpeed is not installed here, so `accelerate launch` itself stops first; this is what it sets. The
    # variable is read by train() in-process as in a launched process (the FSDP test above launches for real).
    run = tmp_path / "run"
    monkeypatch.setenv(variable, "true")
    message = expect_user_error(capsys, train_args(latents, run, "--max-steps", "1"))
    assert f"the accelerate config asks for {name}" in message
    assert not run.exists()


def test_the_confirming_step_trains_the_runs_block():
    """autotune's real-step confirmation (CUDA only) builds its TrainConfig from the run's settings and model
    config: the block options come from the ModelConfig, so a lightning run is confirmed on a lightning step."""
    from types import SimpleNamespace

    from shared.network.models import BLOCKS

    config = ModelConfig(model="DiT-T/2", input_size=4, in_channels=4, num_classes=4, **BLOCKS["lightning"])
    args = SimpleNamespace(model="DiT-T/2", precision="bf16", optimizer="adamw", ema_device="cpu")  # as measure_peak
    row = SimpleNamespace(micro=4, accumulation=3, profile=SimpleNamespace(every=1))
    cfg = memory.verify_config(config, args, row)
    assert {k: getattr(cfg, k) for k in BLOCKS["lightning"]} == BLOCKS["lightning"]
    assert (cfg.micro_batch_size, cfg.grad_accum_steps, cfg.global_batch_size, cfg.grad_checkpoint) == (4, 2, 8, 1)
    assert (cfg.precision, cfg.ema_device) == ("bf16", "cpu")
