"""The training step's speed changes, each exact against the eager step on the CPU (issue 34): regional compile,
selective checkpointing, a step without host syncs (fused AdamW's device-side skip, the masked EMA), and the SDPA
kernel chosen and pinned on CUDA (its probe mocked here)."""
import contextlib
import copy

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

import shared.network.attention as attention
import shared.network.blocks as blocks
import train.step as step
from shared.network.blocks import SELECTIVE
from shared.network.models import ModelConfig
from shared.runtime.errors import UserError
from train.memory import measured_config, synthetic_batch
from train.step import make_learner, train_step, update_ema

LATENT = (4, 8, 8)


class CountingBackend:
    """A torch.compile backend that counts the graphs dynamo hands it and runs them eagerly (no C++ build)."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def learner_for(model="DiT-T/2", compile=False, **settings):
    """A tiny learner (seeded the same every time) and its model config."""
    settings = {"global_batch_size": 4, "micro_batch_size": 2, "grad_accum_steps": 2, "class_dropout_prob": 0.1,
                "precision": "fp32", "grad_checkpoint": 0, **settings}
    cfg = measured_config(model, compile=compile, **settings)
    config = ModelConfig(model, LATENT[1], LATENT[0], num_classes=10, class_dropout_prob=0.1,
                         learn_sigma=cfg.objective == "ddpm" or not cfg.head_depth, objective=cfg.objective)
    return make_learner(cfg, config), config


def batches(learner, config, steps, accumulation=2, micro=2):
    """`steps` lists of `accumulation` synthetic micro-batches (seeded by position)."""
    return [[synthetic_batch(config, micro, 0.1, learner.objective, seed=100 * s + m, route=learner.route)
             for m in range(accumulation)] for s in range(steps)]


def trained_state(learner) -> dict:
    """The weights and the EMA after training, as plain tensors."""
    return {**{f"model.{k}": v.detach().clone() for k, v in learner.dit.state_dict().items()},
            **{f"ema.{k}": v.detach().clone() for k, v in learner.ema.state_dict().items()}}


def assert_states_equal(a: dict, b: dict, atol=0.0, rtol=0.0):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=rtol, msg=key)


@pytest.fixture
def counting(monkeypatch):
    """Dynamo reset, its counters cleared, and the regional compile routed through a counting backend."""
    torch._dynamo.reset()
    counters.clear()
    backend = CountingBackend()
    monkeypatch.setattr(step, "COMPILE_BACKEND", backend)
    yield backend
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------------------
# Regional compile
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("checkpointing, graphs", [(2, 2), (SELECTIVE, 1)])
def test_regional_compile_traces_one_block_once_and_matches_eager(counting, checkpointing, graphs):
    # every 2nd block checkpointed: two kinds of block (recomputed in full, or not), one graph each, each reused
    eager, config = learner_for(grad_checkpoint=checkpointing, precision="bf16")
    compiled, _ = learner_for(grad_checkpoint=checkpointing, precision="bf16", compile=True)
    data = batches(eager, config, steps=3)
    for i, step_batches in enumerate(data):
        train_step(eager, step_batches)
        train_step(compiled, step_batches)
        # 6 blocks, 2 micro-batches per step, 3 steps: traced on the first micro-batch, never again
        assert counting.graphs == graphs, f"step {i}"
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == graphs
    assert_states_equal(trained_state(compiled), trained_state(eager))  # the counting backend runs dynamo's graph


def test_regional_compile_of_a_ditdh_is_one_graph_per_block_width(counting):
    learner, config = learner_for("DiTDH-T", compile=True, objective="flow", grad_checkpoint=1)
    for step_batches in batches(learner, config, steps=2):
        train_step(learner, step_batches)
    assert counting.graphs == 2 and not counters["graph_break"]  # the body's blocks and the wider head's


def test_regional_compile_through_aot_autograd_matches_eager(monkeypatch):
    # aot_eager: dynamo + AOTAutograd's joint graph and partitioner (recomputation included), no C++ build;
    # inductor itself runs in tests/test_train.py::test_compiled_training_matches_eager
    torch._dynamo.reset()
    monkeypatch.setattr(step, "COMPILE_BACKEND", "aot_eager")
    try:
        eager, config = learner_for(grad_checkpoint=SELECTIVE)
        compiled, _ = learner_for(grad_checkpoint=SELECTIVE, compile=True)
        for step_batches in batches(eager, config, steps=2):
            train_step(eager, step_batches)
            train_step(compiled, step_batches)
        assert_states_equal(trained_state(compiled), trained_state(eager), atol=1e-6, rtol=1e-5)
    finally:
        torch._dynamo.reset()


def test_compile_refusals_are_one_paragraph(monkeypatch):
    cfg = measured_config("DiT-T/2", compile=True, attention="xformers")
    with pytest.raises(UserError, match="--attention xformers calls a kernel torch.compile cannot trace"):
        step.check_compile(cfg, "cuda")
    monkeypatch.setattr(step, "cpp_compiler", lambda: None)
    with pytest.raises(UserError, match="needs a C\\+\\+ compiler"):
        step.check_compile(measured_config("DiT-T/2", compile=True), "cpu")
    step.check_compile(measured_config("DiT-T/2", compile=True), "cuda")  # CUDA: triton, no host compiler


def test_train_compile_on_a_cpu_without_compiler_exits_2(monkeypatch, capsys, tmp_path):
    from tests.helpers import expect_user_error, make_latents, train_args

    monkeypatch.setattr(step, "cpp_compiler", lambda: None)
    latents = make_latents(tmp_path / "latents", n=8)
    message = expect_user_error(capsys, train_args(latents, tmp_path / "run", "--compile", "--max-steps", "1"))
    assert "C++ compiler" in message and not (tmp_path / "run" / "checkpoints").exists()


# ---------------------------------------------------------------------------------------------------------
# Selective activation checkpointing
# ---------------------------------------------------------------------------------------------------------

class MatmulCounter(TorchDispatchMode):
    """Counts the matmul calls dispatched while active."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in blocks.SAVED_OPS:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def gradients(every, precision_dtype=None, count=False):
    """(gradients of one forward + backward with checkpointing `every`, matmuls run in backward)."""
    torch.manual_seed(0)
    model = ModelConfig("DiT-T/2", 8, 4, num_classes=10).build(grad_checkpoint_every=every).train()
    g = torch.Generator().manual_seed(1)
    x, t, y = torch.randn(3, 4, 8, 8, generator=g), torch.randint(0, 1000, (3,), generator=g), torch.tensor([1, 2, 3])
    autocast = torch.autocast("cpu", dtype=precision_dtype) if precision_dtype else contextlib.nullcontext()
    with autocast:
        loss = model(x, t, y).float().square().mean()
    counter = MatmulCounter()
    with counter if count else contextlib.nullcontext():
        loss.backward()
    return [p.grad for p in model.parameters() if p.grad is not None], counter.calls


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_selective_checkpointing_gradients_equal_no_checkpointing(dtype):
    plain, _ = gradients(0, dtype)
    selective, _ = gradients(SELECTIVE, dtype)
    assert len(plain) == len(selective)
    for a, b in zip(plain, selective):
        assert torch.equal(a, b)


def test_selective_checkpointing_recomputes_no_matmul():
    # full checkpointing runs every block's forward matmuls again in backward; selective keeps their outputs
    _, plain = gradients(0, count=True)
    _, selective = gradients(SELECTIVE, count=True)
    _, full = gradients(1, count=True)
    assert selective == plain < full


def test_selective_setting_reaches_every_block():
    model = ModelConfig("DiT-T/2", 8, 4, num_classes=10).build(grad_checkpoint_every=SELECTIVE)
    assert {b.recompute for b in model.blocks} == {SELECTIVE}
    model.set_grad_checkpointing(2)
    assert [b.recompute for b in model.blocks] == ["full", None] * 3
    with pytest.raises(UserError, match="'selective'"):
        model.set_grad_checkpointing("some")


# ---------------------------------------------------------------------------------------------------------
# No host synchronisation inside the step
# ---------------------------------------------------------------------------------------------------------

SYNCS = ("item", "__bool__", "__float__", "__int__", "__index__", "cpu", "tolist", "numpy")


@contextlib.contextmanager
def no_host_sync(monkeypatch):
    """Every way Python reads a tensor's value raises while active (a step must only queue device work)."""
    with monkeypatch.context() as patch:
        for name in SYNCS:
            def refuse(self, *args, _name=name, **kwargs):
                raise AssertionError(f"host sync inside the step: Tensor.{_name}")
            patch.setattr(torch.Tensor, name, refuse)
        yield


@pytest.mark.parametrize("settings", [dict(precision="fp32"), dict(precision="fp16"),
                                      dict(precision="bf16", max_grad_norm=0.5, grad_checkpoint=SELECTIVE)])
def test_the_step_never_syncs_with_the_host(monkeypatch, settings):
    from train.logger import Meter
    from train.loop import track_nonfinite

    learner, config = learner_for(**settings)
    data = batches(learner, config, steps=2)
    run = type("FakeRun", (), {})()  # what track_nonfinite reads and writes
    run.cfg, run.step, run.nonfinite_streak, run.nonfinite_at = learner.cfg, 0, 0, None
    meter = Meter()
    for step_batches in data:
        with no_host_sync(monkeypatch):
            result = train_step(learner, step_batches)
            meter.add(result)
            run.step = learner.step
            track_nonfinite(run, result)
    window = meter.window()  # the log point reads the window in one transfer
    assert len(window["loss"]) == 2 and all(v == v for v in window["loss"]) and window["skipped"] == [0.0] * 2
    assert int(run.nonfinite_at) == -1 and learner.skipped_steps == 0


def poison_gradients(learner, config):
    """One micro-batch whose latents hold an inf, so the step's gradients are non-finite."""
    batch = synthetic_batch(config, 2, 0.1, learner.objective, seed=7)
    batch["x0"][0, 0, 0, 0] = float("inf")
    return [batch, batch]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_nonfinite_step_is_skipped_on_the_device(monkeypatch, precision):
    learner, config = learner_for(precision=precision)
    train_step(learner, batches(learner, config, 1)[0])  # the optimizer state exists
    before = trained_state(learner)
    moments = copy.deepcopy(learner.optimizer.state_dict()["state"])
    with no_host_sync(monkeypatch):
        result = train_step(learner, poison_gradients(learner, config))
    assert bool(result["skipped"]) and learner.skipped_steps == 1
    assert_states_equal(trained_state(learner), before)  # weights and EMA untouched
    after = learner.optimizer.state_dict()["state"]
    for index, state in moments.items():
        for name, value in state.items():
            assert torch.equal(after[index][name], value), (index, name)  # moments and step count too


def test_fused_adamw_matches_todays_foreach_adamw():
    fused, config = learner_for()
    foreach, _ = learner_for()
    assert fused.optimizer.defaults["fused"]
    foreach.optimizer = torch.optim.AdamW(foreach.trained_parameters(), lr=foreach.cfg.lr,
                                          betas=tuple(foreach.cfg.adam_betas), weight_decay=foreach.cfg.weight_decay,
                                          foreach=True)
    for step_batches in batches(fused, config, steps=2):
        train_step(fused, step_batches)
        train_step(foreach, step_batches)
    # the fused kernel rounds its update differently: equal to float32 noise, not bitwise
    assert_states_equal(trained_state(fused), trained_state(foreach), atol=1e-6, rtol=1e-5)


def test_masked_ema_is_todays_ema_bitwise_and_a_skip_leaves_it():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    today, masked = copy.deepcopy(model), copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    for _ in range(3):
        update_ema(today, model, 0.9999)  # today's two foreach kernels
        update_ema(masked, model, 0.9999, skipped=torch.tensor(False))
    for a, b in zip(today.parameters(), masked.parameters()):
        assert torch.equal(a, b)
    kept = [p.clone() for p in masked.parameters()]
    update_ema(masked, model, 0.9999, skipped=torch.tensor(True))
    assert all(torch.equal(a, b) for a, b in zip(kept, masked.parameters()))


# ---------------------------------------------------------------------------------------------------------
# The SDPA kernel on CUDA (probe mocked)
# ---------------------------------------------------------------------------------------------------------

@pytest.fixture
def fresh_choices(monkeypatch):
    monkeypatch.setattr(attention, "_sdpa_choices", {})
    monkeypatch.setattr(attention, "device_name", lambda device: "a test GPU")


def test_the_first_fused_kernel_that_runs_is_chosen_once(monkeypatch, fresh_choices):
    tried, said = [], []

    def probe(kernel, device, dtype, head_dim):
        tried.append(kernel)
        return kernel == "FLASH_ATTENTION"

    monkeypatch.setattr(attention, "probe_sdpa_kernel", probe)
    assert attention.choose_sdpa_kernel("cuda", torch.bfloat16, 72, say=said.append) == "FLASH_ATTENTION"
    assert attention.choose_sdpa_kernel("cuda", torch.bfloat16, 72, say=said.append) == "FLASH_ATTENTION"
    assert tried == ["CUDNN_ATTENTION", "FLASH_ATTENTION"]  # probed once, cuDNN first
    assert said == ["attention: SDPA's flash kernel at head size 72 in bfloat16 on a test GPU"]


def test_no_fused_kernel_falls_back_to_math_with_a_notice(monkeypatch, fresh_choices):
    said = []
    monkeypatch.setattr(attention, "probe_sdpa_kernel", lambda *args: False)
    assert attention.choose_sdpa_kernel("cuda", torch.float16, 72, say=said.append) == "MATH"
    assert len(said) == 1 and said[0].startswith("attention: notice:") and "math kernel" in said[0]


def test_prepare_attention_pins_every_sdpa_block_on_cuda_only():
    model = ModelConfig("DiT-T/2", 8, 4, num_classes=10).build()
    attention.prepare_attention(model, "cpu", torch.bfloat16, choose=lambda *a: "FLASH_ATTENTION")
    assert {b.attn.sdpa_kernel for b in model.blocks} == {None}  # the CPU: torch's own choice
    seen = []
    attention.prepare_attention(model, "cuda", torch.bfloat16, choose=lambda d, dt, h: seen.append(h) or "CUDNN_ATTENTION")
    assert {b.attn.sdpa_kernel for b in model.blocks} == {"CUDNN_ATTENTION"} and set(seen) == {64}


def test_a_pinned_kernel_runs_that_kernel_or_raises():
    torch.manual_seed(0)
    model = ModelConfig("DiT-T/2", 8, 4, num_classes=10).build().eval()
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([3, 500]), torch.tensor([1, 2])
    with torch.no_grad():
        free = model(x, t, y)
        for block in model.blocks:
            block.attn.sdpa_kernel = "FLASH_ATTENTION"  # the CPU's flash kernel: torch's own choice here
        torch.testing.assert_close(model(x, t, y), free, atol=0, rtol=0)
        for block in model.blocks:
            block.attn.sdpa_kernel = "CUDNN_ATTENTION"  # no such kernel on the CPU: an error, never the math kernel
        with pytest.raises(RuntimeError):
            model(x, t, y)


def test_the_planner_lists_selective_between_off_and_every_block():
    from shared.generative.diffusion import DDPMObjective
    from train.memory import measure_block_fit, measure_profile
    from train.plan import checkpoint_choices, choice_label

    assert checkpoint_choices(SELECTIVE, 6) == [0, SELECTIVE, 1, 2] == checkpoint_choices(0, 6)
    assert checkpoint_choices(3, 6) == [0, SELECTIVE, 1, 2, 3] and choice_label(SELECTIVE) == "selective"
    model = ModelConfig("DiT-T/2", 8, 4, num_classes=10).build(device="cpu", init=False)
    block = measure_block_fit(model, "bf16")
    off, selective, every = (measure_profile(model, k, "bf16", block, DDPMObjective()) for k in (0, SELECTIVE, 1))
    assert every.saved.per_sample < selective.saved.per_sample < off.saved.per_sample
    assert selective.recompute == every.recompute == block
