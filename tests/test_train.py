"""The train stage end to end on tiny synthetic shards: loss, resume, precision, accumulation, processes, errors."""
import hashlib
import json
import os
import random
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from train.__main__ import main
from train.config import DEBUG_STEPS, TrainConfig, build_parser, grad_accum_steps
from train.checkpoint import capture_rng, restore_rng
from train.loop import weights_finite
from train.step import lr_at
from tests.helpers import (CPU_DIST, LAUNCHER, TORCHRUN, checkpoints, cli, expect_user_error, final_tensors, finish,
                           make_latents, metrics, run_inprocess, trace, train_args, wait_for)

ROOT = Path(__file__).resolve().parents[1]


def sha256_of(path: Path, run: Path) -> str:
    """The sha256 of a file's bytes, as `sha256sum` prints it, with the run folder's path written as RUN."""
    data = path.read_bytes()
    if path.suffix == ".json":
        data = data.replace(json.dumps(str(run)).encode(), b'"RUN"')
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------------------------
# Training behaviour (in process)
# ---------------------------------------------------------------------------------------------------------

def test_loss_falls_and_run_folder_layout(latents, tmp_path):
    run = run_inprocess(latents, tmp_path / "run", "--max-steps", "16", "--lr", "2e-3", "--ckpt-every", "8",
                        "--sample-every", "16", "--sample-steps", "4")
    losses = [m["loss"] for m in metrics(run)]
    assert len(losses) == 16
    assert np.mean(losses[-4:]) < 0.85 * np.mean(losses[:4]), losses
    assert checkpoints(run) == ["step-0000008", "step-0000016"]
    ckpt = run / "checkpoints" / "step-0000016"
    assert {p.name for p in ckpt.iterdir()} == {"model.safetensors", "ema.safetensors", "optimizer.pt", "scaler.pt",
                                                "rng-0.pt", "state.json"}
    state = json.loads((ckpt / "state.json").read_text())
    assert state["step"] == 16 and state["data_position"] == 16 * 8 and state["config"]["model"] == "DiT-T/2"
    assert json.loads((run / "config.json").read_text())["grad_accum_steps"] == 1
    from shared.weights.export import load_weights

    export = run / "exports" / "ema-step-0000016.safetensors"
    sd, model_config, _, step = load_weights(export)
    from shared.tokenizers.space import LatentSpace

    space = LatentSpace.read_file(export)
    assert os.path.samefile(export, ckpt / "ema.safetensors")  # the EMA is stored once: the export is a hard link
    assert step == 16 and model_config.input_size == 4 and space.norm.describe() == "scale x0.5"
    assert json.loads((run / "config.json").read_text())["data"]["latent_space"] == space.sha256
    sample = load_file(run / "samples" / "step-0000016.safetensors")
    assert sample["latents"].shape == (8, 4, 4, 4) and torch.isfinite(sample["latents"]).all()
    assert sample["labels"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert "step 0000016" in (run / "log.txt").read_text()


def test_accumulation_matches_one_big_batch(latents, tmp_path):
    flags = ["--max-steps", "2", "--class-dropout-prob", "0", "--lr", "1e-3"]
    accumulated = run_inprocess(latents, tmp_path / "acc", *flags, "--micro-batch-size", "2")
    assert json.loads((accumulated / "config.json").read_text())["grad_accum_steps"] == 4
    whole = run_inprocess(latents, tmp_path / "whole", *flags)
    a, b = final_tensors(accumulated), final_tensors(whole)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=2e-6, rtol=1e-5, msg=key)
    la, lb = metrics(accumulated)[-1]["loss"], metrics(whole)[-1]["loss"]
    assert abs(la - lb) < 1e-5


def test_keep_last_retention_and_optional_features(latents, tmp_path):
    run = run_inprocess(latents, tmp_path / "run", "--max-steps", "4", "--ckpt-every", "1", "--keep-last", "2",
                        "--grad-checkpoint", "--max-grad-norm", "0.5", "--ema-device", "cpu",
                        "--lr-schedule", "cosine", "--warmup-steps", "2", "--lr", "1e-3")
    assert checkpoints(run) == ["step-0000003", "step-0000004"]
    assert [m["lr"] for m in metrics(run)] == pytest.approx([5e-4, 1e-3, 1e-3, 5e-4], abs=1e-12)  # warmup, then cosine
    assert sorted(p.name for p in (run / "exports").iterdir()) == [f"ema-step-000000{i}.safetensors" for i in (1, 2, 3, 4)]
    # Exports are hard links to their checkpoints' EMA: pruning a checkpoint leaves its export whole and alone.
    assert [os.stat(run / "exports" / f"ema-step-000000{i}.safetensors").st_nlink for i in (1, 2, 3, 4)] == [1, 1, 2, 2]
    assert load_file(run / "exports" / "ema-step-0000001.safetensors").keys() == load_file(
        run / "checkpoints" / "step-0000004" / "ema.safetensors").keys()


def test_previews_with_the_ema_on_the_cpu_follow_the_configured_guidance(latents, tmp_path):
    from shared.weights.export import load_weights
    from shared.generative.objectives import objective_of
    from train.preview import sample_preview

    flags = ["--max-steps", "2", "--sample-every", "2", "--sample-steps", "3", "--lr", "1e-2", "--ema-decay", "0"]
    runs = {choice: run_inprocess(latents, tmp_path / f"run-{choice}", *flags, "--ema-device", device,
                                  "--sample-guide-channels", choice)
            for choice, device in (("all", "cpu"), ("3", "gpu"))}
    previews = {c: load_file(r / "samples" / "step-0000002.safetensors")["latents"] for c, r in runs.items()}
    assert not torch.equal(previews["all"], previews["3"])  # the choice reaches the previews
    for choice, run in runs.items():  # and each preview is the export's EMA sampled with that choice
        state, config, _, _ = load_weights(run / "exports" / "ema-step-0000002.safetensors")
        model = config.build().eval()
        model.load_state_dict(state)
        latents_, _ = sample_preview(model, (4, 4, 4), 3, 4.0, choice, torch.device("cpu"),
                                     objective_of(config), config.sampling)
        torch.testing.assert_close(latents_, previews[choice], atol=1e-5, rtol=1e-5)
    same_ema = final_tensors(runs["all"]), final_tensors(runs["3"])  # EMA on the CPU or the device: same numbers
    assert all(torch.equal(same_ema[0][k], same_ema[1][k]) for k in same_ema[0])


@pytest.mark.slow
def test_compiled_training_matches_eager(latents, tmp_path):
    flags = ["--max-steps", "2", "--lr", "1e-3", "--class-dropout-prob", "0"]
    compiled = run_inprocess(latents, tmp_path / "compiled", *flags, "--compile")
    eager = run_inprocess(latents, tmp_path / "eager", *flags)
    a, b = final_tensors(compiled), final_tensors(eager)
    assert a.keys() == b.keys()
    for key in a:  # inductor fuses and reorders float math, so equal within float32 noise, not bitwise
        torch.testing.assert_close(a[key], b[key], atol=1e-4, rtol=1e-4, msg=key)


def test_bf16_path_runs(latents, tmp_path):
    run = run_inprocess(latents, tmp_path / "run", "--max-steps", "2", "--mixed-precision", "bf16",
                        "--attention", "math", "--grad-checkpoint", "2")
    assert all(np.isfinite(m["loss"]) for m in metrics(run))
    assert all(torch.isfinite(v).all() for v in final_tensors(run).values())


def test_fp16_scaler_skips_and_nonfinite_guard(latents, tmp_path, capsys):
    # A huge LR blows the weights up after the first real step; fp16 activations then overflow every step.
    run = tmp_path / "run"
    message = expect_user_error(capsys, train_args(latents, run, "--max-steps", "30", "--mixed-precision", "fp16",
                                                   "--lr", "1e4", "--max-nonfinite", "3", "--ckpt-every", "1"))
    assert "consecutive" in message and "bf16" in message and "last good checkpoint" in message
    logged = metrics(run)
    assert all("loss_scale" in m for m in logged)
    assert logged[-1]["skipped_total"] >= 2  # scaler skips are counted (the third one stopped the run)
    assert logged[-1]["loss_scale"] < 65536.0
    for name in checkpoints(run):  # every checkpoint that was written is finite
        for value in load_file(run / "checkpoints" / name / "model.safetensors").values():
            assert torch.isfinite(value).all(), name


def test_poisoned_latents_stop_fp32(tmp_path, capsys):
    bad = make_latents(tmp_path / "bad", n=16, poison=True)
    message = expect_user_error(capsys, train_args(bad, tmp_path / "run", "--max-steps", "10", "--max-nonfinite", "2"))
    assert "bad latents" in message and "step 2" in message


def test_weights_finite_detects_nan():
    model = torch.nn.Linear(2, 2)
    assert weights_finite(model)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    assert not weights_finite(model)


def test_rng_state_round_trip(tmp_path):
    state = capture_rng()
    torch.save(state, tmp_path / "rng.pt")
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    restore_rng(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


def test_lr_schedule():
    cfg = TrainConfig(latents="x", results_dir="y", lr=1.0, warmup_steps=4, lr_schedule="cosine", total_steps=14)
    assert [lr_at(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(9, cfg) == pytest.approx(0.5) and lr_at(14, cfg) == pytest.approx(0.0)


# ---------------------------------------------------------------------------------------------------------
# Flags, config and bad input
# ---------------------------------------------------------------------------------------------------------

def test_every_flag_has_help():
    for action in build_parser()._actions:
        assert action.help, action.option_strings


def test_dry_run_prints_resolved_config(latents, tmp_path, capsys):
    run = tmp_path / "run"
    main(train_args(latents, run, "--micro-batch-size", "2", "--epochs", "2", "--dry-run"))
    printed = json.loads(capsys.readouterr().out)
    assert printed["grad_accum_steps"] == 4 and printed["total_steps"] == 8  # 2 epochs x 32 samples / 8
    assert printed["data"]["latent_shape"] == [4, 4, 4] and not run.exists()
    assert printed["sample_cfg_scale"] == 4.0


def test_debug_runs_a_few_steps_and_writes_nothing(latents, tmp_path, capsys):
    run = tmp_path / "run"
    main(train_args(latents, run, "--debug", "--max-steps", "100", "--log-every", "50"))
    out = capsys.readouterr().out
    assert json.loads(out[: out.index("\n}") + 2])["debug"] is True  # the resolved config comes first
    assert [line.split()[1] for line in out.splitlines() if line.startswith("step ")] == [
        f"{s:07d}" for s in range(1, DEBUG_STEPS + 1)]  # per-step logs, then it stops
    assert not run.exists()


def test_accumulation_must_divide():
    assert grad_accum_steps(256, 32, 2) == (32, 4)
    assert grad_accum_steps(256, None, 4) == (64, 1)


def test_bad_inputs(latents, tmp_path, capsys):
    run = tmp_path / "run"
    msg = expect_user_error(capsys, train_args(tmp_path / "nowhere", run))
    assert "does not exist" in msg
    half = tmp_path / "half"
    half.mkdir()
    (half / "shard-000000.tar").write_bytes(b"\0" * 1024)
    assert "extraction did not finish" in expect_user_error(capsys, train_args(half, run))
    msg = expect_user_error(capsys, ["--model", "DiT-Q/2"] + train_args(latents, run)[2:])
    assert "DiT-XL/2" in msg and "DiT-T/2" in msg
    msg = expect_user_error(capsys, train_args(latents, run, "--micro-batch-size", "3"))
    assert "does not divide" in msg and "--micro-batch-size" in msg
    msg = expect_user_error(capsys, ["--model", "DiT-S/8"] + train_args(latents, run)[2:])
    assert "patch size 8" in msg
    msg = expect_user_error(capsys, train_args(latents, run, "--optimizer", "adamw8bit"))
    assert "--optimizer adamw" in msg
    msg = expect_user_error(capsys, train_args(latents, run, "--class-dropout-prob", "0", "--sample-cfg-scale", "4"))
    assert "null class" in msg
    msg = expect_user_error(capsys, train_args(latents, run, "--attention", "xformers"))
    assert "xformers" in msg and "sdpa" in msg
    assert not run.exists()  # nothing was written for any of these


def test_resume_refuses_other_experiment(latents, tmp_path, capsys):
    run = run_inprocess(latents, tmp_path / "run", "--max-steps", "1")
    msg = expect_user_error(capsys, train_args(latents, run, "--max-steps", "2", "--global-batch-size", "4"))
    assert "global_batch_size" in msg and "new --results-dir" in msg
    other_vae = make_latents(tmp_path / "other", scaling_factor=0.25)
    msg = expect_user_error(capsys, train_args(other_vae, run, "--max-steps", "2"))
    assert "another VAE or image size" in msg
    bigger = make_latents(tmp_path / "bigger", shape=(4, 8, 8), image_size=16)
    assert "another VAE or image size" in expect_user_error(capsys, train_args(bigger, run, "--max-steps", "2"))
    msg = expect_user_error(capsys, train_args(latents, run, "--max-steps", "2", "--resume", "none"))
    assert "already holds checkpoints" in msg
    # Allowed changes (longer run, other LR) resume and are logged.
    run_inprocess(latents, run, "--max-steps", "2", "--lr", "5e-5")
    assert checkpoints(run) == ["step-0000001", "step-0000002"]
    assert "changed on resume: lr" in (run / "log.txt").read_text()
    # --resume PATH continues from a given checkpoint into another run folder.
    branch = run_inprocess(latents, tmp_path / "branch", "--max-steps", "2", "--lr", "5e-5",
                           "--resume", str(run / "checkpoints" / "step-0000001"))
    assert checkpoints(branch) == ["step-0000002"]
    assert "resumed from" in (branch / "log.txt").read_text()
    mine, theirs = final_tensors(branch), final_tensors(run)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)  # the same two steps as the run itself


# ---------------------------------------------------------------------------------------------------------
# Real processes: kill-and-resume, two processes, no diffusers
# ---------------------------------------------------------------------------------------------------------

KILL_FLAGS = ["--max-steps", "6", "--ckpt-every", "2", "--keep-last", "1", "--num-workers", "1"]


@pytest.fixture(scope="module")
def reference(latents, tmp_path_factory):
    """An uninterrupted run with the kill tests' flags, through the test-side launcher with a trace."""
    root = tmp_path_factory.mktemp("reference")
    finish(cli(LAUNCHER + train_args(latents, root / "run", *KILL_FLAGS), {"TRACE_DIR": str(root / "trace")}))
    return root


@pytest.mark.slow
def test_training_process_never_imports_diffusers(reference):
    record = trace(reference / "trace")
    assert record["step"] == 6 and record["diffusers_imported"] is False


@pytest.mark.slow
@pytest.mark.parametrize("pause_at, resumes_from, left_behind", [
    ("checkpoint:2", "step-0000002", None),  # after the first checkpoint is complete
    ("export:4", "step-0000004", "exports/ema-step-0000004.safetensors"),  # published, export not yet written
    ("prune:4", "step-0000004", "checkpoints/.tmp-del-step-0000002"),  # killed in the middle of a prune
])
def test_killed_run_resumes_bitwise(latents, tmp_path, reference, pause_at, resumes_from, left_behind):
    run, pauses = tmp_path / "run", tmp_path / "pause"
    victim = cli(LAUNCHER + train_args(latents, run, *KILL_FLAGS), {"TRACE_DIR": str(pauses), "PAUSE_AT": pause_at})
    wait_for(pauses / "paused", victim)
    victim.kill()
    victim.communicate(timeout=60)
    assert victim.returncode == -9
    assert (run / "checkpoints" / resumes_from / "state.json").is_file()
    assert not (run / "checkpoints" / "step-0000006").exists()  # really interrupted mid-run
    if pause_at.startswith("export"):
        assert not (run / left_behind).exists()  # the kill fell between the checkpoint and its export
    elif left_behind:
        assert (run / left_behind).exists()  # the half-deleted checkpoint is still there

    finish(cli(train_args(latents, run, *KILL_FLAGS)))
    log = (run / "log.txt").read_text()
    assert f"resumed from {run / 'checkpoints' / resumes_from} at step {int(resumes_from[5:])}" in log
    ref, resumed = final_tensors(reference / "run"), final_tensors(run)
    assert ref.keys() == resumed.keys()
    for key in ref:
        assert torch.equal(ref[key], resumed[key]), f"{key} differs after a kill at {pause_at}"
    assert not list((run / "checkpoints").glob(".tmp-*"))
    assert checkpoints(run) == ["step-0000006"]
    assert [m["step"] for m in metrics(run)] == list(range(1, 7))  # no duplicated lines after the resume
    assert [m["data_position"] for m in metrics(run)] == [8 * s for s in range(1, 7)]
    exports = sorted(p.name for p in (run / "exports").iterdir())
    assert exports == ["ema-step-0000002.safetensors", "ema-step-0000004.safetensors", "ema-step-0000006.safetensors"]
    if pause_at.startswith("export"):  # the repaired export holds checkpoint 4's EMA
        assert "wrote the missing EMA export of step 4" in log
        repaired = load_file(run / left_behind)
        expected = load_file(reference / "run" / left_behind)
        assert all(torch.equal(repaired[k], expected[k]) for k in expected)
    assert_same_bytes(run, reference / "run", f"a kill at {pause_at}")


def assert_same_bytes(run: Path, reference: Path, after: str) -> None:
    """Issue 38: equal tensors are not enough; `sha256sum` must agree on every export, every file of the final
    checkpoint (weights, optimizer, scaler, RNG), and on its state.json and config.json once the one thing that
    legitimately differs, the run folder's own path (results_dir), is written alike."""
    final = f"checkpoints/{checkpoints(run)[-1]}"
    files = [f"exports/{p.name}" for p in sorted((run / "exports").iterdir())] + ["config.json"]
    files += [f"{final}/{p.name}" for p in sorted((run / final).iterdir())]
    assert {f"{final}/ema.safetensors", f"{final}/optimizer.pt", f"{final}/state.json"} <= set(files)
    assert sorted((reference / "exports").iterdir()) and checkpoints(reference)[-1] == checkpoints(run)[-1]
    differ = [name for name in files if sha256_of(run / name, run) != sha256_of(reference / name, reference)]
    assert not differ, f"not byte-identical after {after}: {differ}"


@pytest.mark.slow
def test_ctrl_c_mid_checkpoint_leaves_no_staging_and_resumes_bitwise(latents, tmp_path, reference):
    """Issue 38: SIGINT to the process group (the data loader's worker too, as from a terminal) while checkpoint 4
    is half-written: the one line, exit 130, its staging folder removed; the rerun equals an uninterrupted run
    byte for byte."""
    from shared.runtime.interrupt import EXIT_STATUS, MESSAGE

    run, pauses = tmp_path / "run", tmp_path / "pause"
    victim = cli(LAUNCHER + train_args(latents, run, *KILL_FLAGS),
                 {"TRACE_DIR": str(pauses), "PAUSE_AT": "staging:4"}, start_new_session=True)
    wait_for(pauses / "paused", victim)
    assert (run / "checkpoints" / ".tmp-step-0000004" / "model.safetensors").is_file()  # half-written now
    os.killpg(victim.pid, signal.SIGINT)
    _, err = victim.communicate(timeout=120)
    assert victim.returncode == EXIT_STATUS, err
    assert "Traceback" not in err and err.count(MESSAGE) == 1
    assert err.rstrip().splitlines()[-1] == f"python -m train: {MESSAGE}"
    assert not (run / "checkpoints" / "step-0000006").exists()  # really interrupted mid-run
    assert not list(run.rglob(".tmp-*"))  # no staging folder, no half-written file
    finish(cli(train_args(latents, run, *KILL_FLAGS)))
    assert "resumed from" in (run / "log.txt").read_text()
    assert_same_bytes(run, reference / "run", "a Ctrl-C")


@pytest.mark.slow
def test_two_processes_match_one(latents, tmp_path):
    flags = ["--max-steps", "3", "--micro-batch-size", "2", "--lr", "1e-3"]
    traces = tmp_path / "trace"
    finish(cli(TORCHRUN + train_args(latents, tmp_path / "two", *flags), {"TRACE_DIR": str(traces), **CPU_DIST}))
    ranks = [trace(traces, r) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    positions = [set(r["positions"]) for r in ranks]
    assert not positions[0] & positions[1] and positions[0] | positions[1] == set(range(3 * 8))
    assert all(p % 2 == r for r in (0, 1) for p in positions[r])
    assert ranks[0]["weights_sha256"] == ranks[1]["weights_sha256"]
    for r in ranks:  # accumulation 2: micro-step 1 of each step all-reduces nothing (no_sync), micro-step 2 does
        calls = r["allreduce_calls"]
        assert len(calls) == 6 and calls[0::2] == [0, 0, 0] and min(calls[1::2]) > 0, calls
    assert not any(r["diffusers_imported"] for r in ranks)
    assert json.loads((tmp_path / "two" / "config.json").read_text())["grad_accum_steps"] == 2

    one = run_inprocess(latents, tmp_path / "one", *flags)
    a, b = final_tensors(tmp_path / "two"), final_tensors(one)
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=2e-6, rtol=1e-5, msg=key)


@pytest.mark.slow
def test_resume_on_another_number_of_processes(latents, tmp_path):
    flags = ["--ckpt-every", "2", "--lr", "1e-3"]
    straight = run_inprocess(latents, tmp_path / "straight", "--max-steps", "4", *flags)
    run = run_inprocess(latents, tmp_path / "run", "--max-steps", "2", *flags)
    finish(cli(TORCHRUN + train_args(latents, run, "--max-steps", "4", *flags), CPU_DIST))
    log = (run / "log.txt").read_text()
    assert "resumed from" in log and "2 process(es)" in log and "world_size: 1 -> 2" in log
    a, b = final_tensors(straight), final_tensors(run)
    for key in a:  # the same samples and draws (keyed by stream position); only float summation order differs
        torch.testing.assert_close(a[key], b[key], atol=2e-6, rtol=1e-5, msg=key)


@pytest.mark.slow
def test_ranks_out_of_sync_stop_before_the_checkpoint(latents, tmp_path):
    run = tmp_path / "run"
    proc = cli(TORCHRUN + train_args(latents, run, "--max-steps", "2", "--ckpt-every", "2"),
               {"PERTURB_RANK": "1", **CPU_DIST})
    _, err = proc.communicate(timeout=600)
    assert proc.returncode != 0
    assert "process(es) [1] differ from process 0" in " ".join(err.split()), err[-3000:]
    # torchrun reports the failed children with a traceback of its own; none comes from our code.
    assert f'File "{ROOT / "train"}' not in err and f'File "{ROOT / "shared"}' not in err
    assert not (run / "checkpoints" / "step-0000002").exists()
