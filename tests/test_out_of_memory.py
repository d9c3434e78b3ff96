"""Memory at the limit (issue 34.2): the planner's measurement leaves nothing behind, and running out of memory in
`python -m train.plan --verify`, in auto's confirmation or in `python -m train` ends in one paragraph or one step down.

The CUDA caching allocator is read through one seam, train.memory.allocator: here a CPU stand-in runs the trainer's
real step (train/step.py) on the CPU, and an out-of-memory is raised where CUDA would raise it.
"""
import contextlib
import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

from shared.network.models import ModelConfig
from tests.helpers import checkpoints, expect_user_error, run_inprocess, run_main, train_args
from train import autotune, loop, memory, plan
from train.autotune import DeviceInfo
from train.config import TrainConfig
from train.memory import PlanRow
from train.plan import main as plan_main
from train.step import accumulate_gradients, train_step
from train.units import GiB, MiB, format_size, parse_size

MODEL = ModelConfig(model="DiT-T/2", input_size=4, in_channels=4, num_classes=4)  # what the tiny latents give


def _record_builds(monkeypatch) -> list:
    """Weak references to every model ModelConfig.build makes on a real device, its parameters and buffers."""
    refs, build = [], ModelConfig.build

    def recording(self, *args, **kwargs):
        model = build(self, *args, **kwargs)
        if str(kwargs.get("device")) != "meta":
            refs.append(weakref.ref(model))
            refs.extend(weakref.ref(t) for t in [*model.parameters(), *model.buffers()])
        return model

    monkeypatch.setattr(ModelConfig, "build", recording)
    return refs


def _record_saved(monkeypatch) -> list:
    """Weak references to every tensor autograd saved for backward while the planner measured."""
    refs, pack = [], memory.SavedTensorLedger._pack

    def recording(self, tensor):
        refs.append(weakref.ref(tensor))
        return pack(self, tensor)

    monkeypatch.setattr(memory.SavedTensorLedger, "_pack", recording)
    return refs


def _alive(refs: list) -> int:
    gc.collect()
    return sum(ref() is not None for ref in refs)


def test_the_measurement_leaves_no_model_or_tensor_alive(monkeypatch):
    models, saved = _record_builds(monkeypatch), _record_saved(monkeypatch)
    memory.measure_profiles(MODEL, "fp16", (0, 1, 2), torch.device("cpu"))  # checkpointing off, every block, every 2nd
    assert len(models) > 2 and len(saved) > 100
    assert (_alive(models), _alive(saved)) == (0, 0)


# ---------------------------------------------------------------------------------------------------------
# A CPU stand-in for the CUDA allocator, and an out-of-memory where CUDA would raise it
# ---------------------------------------------------------------------------------------------------------

class CpuAllocator(memory.CudaAllocator):
    """train.memory's allocator seam on the CPU: real steps, the allocator's numbers made up, its cap recorded."""

    device = torch.device("cpu")

    def __init__(self, peak=MiB, reserved=0, total=64 * GiB):
        self.peak_bytes, self.reserved_bytes, self.total_bytes, self.caps = peak, reserved, total, []

    def available(self):
        return True

    def total(self):
        return self.total_bytes

    def release(self):
        gc.collect()

    def synchronize(self):
        pass

    def reset_peak(self):
        pass

    def peak(self):
        return self.peak_bytes

    def reserved(self):
        return self.reserved_bytes

    @contextlib.contextmanager
    def capped(self, limit):
        self.caps.append(["capped", limit])
        try:
            yield
        finally:
            self.caps[-1][0] = "restored"


def _use(monkeypatch, allocator: CpuAllocator) -> CpuAllocator:
    monkeypatch.setattr(memory, "allocator", lambda: allocator)
    return allocator


OOM = ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 23.56 GiB of which 8.0 MiB "
       "is free.")  # as torch words it


def _oom_in_step(monkeypatch, micro: int, failed: list):
    """memory.train_step, but the measured step (the second) at `micro` runs out of memory after its backward,
    so the model, its gradients and the optimizer state exist; weak references to them go into `failed`."""
    calls = []

    def step(learner, batches):
        calls.append(len(batches[0]["x0"]))
        if calls.count(micro) == 2 and calls[-1] == micro:
            accumulate_gradients(learner, batches)
            state = [t for s in learner.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
            grads = [p.grad for p in learner.dit.parameters() if p.grad is not None]
            assert state and grads
            failed.extend(weakref.ref(t) for t in [learner.model, learner.ema, *learner.dit.parameters(), *grads,
                                                   *state])
            raise torch.OutOfMemoryError(OOM)
        return train_step(learner, batches)

    monkeypatch.setattr(memory, "train_step", step)
    return calls


def _dead_before_each_learner(monkeypatch, *ref_lists) -> list:
    """memory.make_learner, asserting first that nothing in `ref_lists` is alive (after gc); returns the checks made."""
    checks, make = [], memory.make_learner

    def checking(*args, **kwargs):
        checks.append([_alive(refs) for refs in ref_lists])
        return make(*args, **kwargs)

    monkeypatch.setattr(memory, "make_learner", checking)
    return checks


# ---------------------------------------------------------------------------------------------------------
# python -m train.plan --verify
# ---------------------------------------------------------------------------------------------------------

PLAN = ["--model", "DiT-T/2", "--image-size", "32", "--num-classes", "4", "--global-batch-size", "8",
        "--gpu-memory", "200MiB", "--margin", "50MiB", "--measure-device", "cpu", "--verify"]
BUDGET = 150 * MiB


@pytest.fixture(autouse=True)
def _one_timed_step(monkeypatch):
    monkeypatch.setattr(plan, "VERIFY_TIMED_STEPS", 1)  # --verify's timing is not what these tests check


def test_verify_sees_only_the_trainers_step_under_the_budget_cap(monkeypatch, capsys):
    models, saved = _record_builds(monkeypatch), _record_saved(monkeypatch)
    checks = _dead_before_each_learner(monkeypatch, models, saved)
    cuda = _use(monkeypatch, CpuAllocator(peak=100 * MiB))
    code, out, err = run_main(plan_main, PLAN, capsys)
    assert code == 0, err
    assert len(models) > 2 and len(saved) > 100
    assert checks == [[0, 0]]  # the verify step's learner was built with nothing of the measurement alive
    assert cuda.caps == [["restored", BUDGET]]  # it ran capped at the budget; the cap was lifted after
    assert "measured max_memory_allocated 100.00 MiB" in out


def test_verify_out_of_memory_is_one_paragraph(monkeypatch, capsys):
    cuda = _use(monkeypatch, CpuAllocator(reserved=BUDGET - 5 * MiB))  # + the 20 MiB it tried: 165 MiB
    failed, alive_at_paragraph, paragraph = [], [], plan.over_budget_text
    _oom_in_step(monkeypatch, micro=8, failed=failed)

    def checking(*args):
        alive_at_paragraph.append(_alive(failed))
        return paragraph(*args)

    monkeypatch.setattr(plan, "over_budget_text", checking)
    code, out, err = run_main(plan_main, PLAN, capsys)
    assert code == 2 and "Traceback" not in err and out == ""
    assert alive_at_paragraph == [0]  # the failed step's model, gradients and optimizer state were gone by then
    message = err[err.index("python -m train.plan: error:"):]  # after the measurement's progress bar
    assert message.startswith("python -m train.plan: error: --verify: measured 165.00 MiB > budget 150.00 MiB at "
                              "micro-batch 8 "), message
    assert "Try --margin 126MiB" in err and "training with --micro-batch-size 4 --grad-checkpoint 0" in err
    assert cuda.caps == [["restored", BUDGET]]


def test_a_card_smaller_than_the_budget_is_named_as_the_limit():
    args = SimpleNamespace(margin=50 * MiB, precision="bf16")
    row = PlanRow(SimpleNamespace(every=1), micro=8, accumulation=1, peak=140 * MiB)
    text = plan.over_budget_text(memory.StepOutOfMemory(8, 110 * MiB, 100 * MiB), row, args, BUDGET, 8)
    assert text.startswith("--verify: measured 110.00 MiB > card (smaller than the budget) 100.00 MiB at micro-batch 8 ")
    assert "Try --gpu-memory 100MiB (this card), or training with --micro-batch-size 4 --grad-checkpoint 1;" in text


# ---------------------------------------------------------------------------------------------------------
# auto's confirmation in python -m train
# ---------------------------------------------------------------------------------------------------------

def test_auto_steps_down_a_micro_batch_that_runs_out_of_memory_and_says_so(monkeypatch, capsys):
    free = 64 * GiB  # the planner's answer is the whole batch of 8 at once, without checkpointing
    info = DeviceInfo("cuda", "fake GPU", free, free, True)
    cuda = _use(monkeypatch, CpuAllocator(peak=3 * MiB))
    failed = []
    calls = _oom_in_step(monkeypatch, micro=8, failed=failed)
    checks = _dead_before_each_learner(monkeypatch, failed)
    cfg = TrainConfig(latents="x", results_dir="y", model="DiT-T/2", global_batch_size=8)
    record = autotune.resolve_auto(cfg, MODEL, info, 1, autotune.measure_peak)  # as python -m train on a GPU
    budget = free - parse_size(memory.DEFAULT_MARGIN)
    assert calls == [8, 8, 4, 4]  # micro-batch 8 ran out of memory in its measured step; 4 fitted
    assert checks == [[0], [0]]  # each learner was built with nothing of the failed try alive
    assert cuda.caps == [["restored", budget], ["restored", budget]]
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("auto:")]
    assert notices == [f"auto: micro-batch 8 ran out of memory in a real step under the {format_size(budget)} "
                       "budget; trying micro-batch 4"]
    assert (cfg.micro_batch_size, cfg.grad_checkpoint) == (4, 0)
    assert record["confirmed"] == [{"micro": 8, "peak": autotune.OUT_OF_MEMORY}, {"micro": 4, "peak": 3 * MiB}]
    assert "stepped down from micro-batch 8: 8: out of memory" in autotune.describe(record)  # run's log.txt line


# ---------------------------------------------------------------------------------------------------------
# python -m train
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_out_of_memory_in_training_is_one_paragraph_and_keeps_the_last_checkpoint(latents, tmp_path, monkeypatch,
                                                                                   capsys):
    run = tmp_path / "run"
    flags = ("--max-steps", "4", "--ckpt-every", "2", "--micro-batch-size", "2")  # 4 micro-batches a step

    def failing(batches):
        """The step's micro-batches, running out of memory at the third (two forward/backward passes done)."""
        for i, batch in enumerate(batches):
            if i == 2:
                raise torch.OutOfMemoryError(OOM)
            yield batch

    def step(learner, batches):
        return train_step(learner, failing(batches) if learner.step == 2 else batches)

    monkeypatch.setattr(loop, "train_step", step)
    message = expect_user_error(capsys, train_args(latents, run, *flags))
    last = run / "checkpoints" / "step-0000002"
    assert message.startswith("python -m train: error: ran out of GPU memory after 2 completed step(s), at "
                              "micro-batch 2 x 4 accumulation, checkpointing off, fp32 (CUDA out of memory, tried to "
                              "allocate 20.00 MiB)."), message
    assert f"The last checkpoint {last} is intact" in message
    assert "Rerun the same command with --micro-batch-size 1 (gradient accumulation keeps the global batch of 8)" \
        in message
    assert checkpoints(run) == ["step-0000002"]  # nothing half-written beside it
    # The planner's command it names runs as printed.
    command = message.split("`")[1].split()
    assert command[:3] == ["python", "-m", "train.plan"] and "--grad-checkpoint" in command
    code, out, err = run_main(plan_main, command[3:] + ["--measure-device", "cpu"], capsys)
    assert code == 0 and "--micro-batch-size" in out, err
    # Following the advice resumes from the intact checkpoint and finishes.
    monkeypatch.undo()
    run_inprocess(latents, run, *flags[:-1], "1")
    assert f"resumed from {last} at step 2" in (run / "log.txt").read_text()
    assert checkpoints(run)[-1] == "step-0000004"
