"""Issue 34, item 3: the compiled sampling network (`--compile`), exact against eager on the CPU.

Inductor is CUDA's backend and too slow to build on this CPU, so the compiled paths run here under aot_eager
(dynamo's trace and AOTAutograd's graph, the same ones inductor receives), counted by dynamo's compile counter.
"""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from shared.generative.guidance import GuidedModelFn
from shared.generative.diffusion import DDPMObjective
from shared.sampling.compiled import COMPILE_MODES, GraphedModel, check_compile, compile_for_sampling
from shared.runtime.errors import ChoiceError, SettingError
from tests.helpers import inputs, randomize, run_sample, tiny


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test counts its own compiles (dynamo caches compiled code by code object, across models)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model(depth=2):
    return randomize(tiny(depth=depth), scale=0.1).eval().requires_grad_(False)


def _draw(model, steps=3, interval=None, sampler="ddim", n=4):
    """Latents of a guided DDPM-objective sampling loop over `model` (cfg 1.5), drawn as Drawer.draw does (the
    noise made under inference mode too)."""
    objective = DDPMObjective()
    fn = GuidedModelFn(model, 1.5, None, "fp32", interval, objective.noise_level)
    with torch.inference_mode():
        noise = torch.randn(n, 4, 8, 8, generator=torch.Generator().manual_seed(0))
        labels = torch.arange(n) % 5
        return objective.sample(sampler, fn, noise, steps, {}, model_kwargs={"y": labels},
                                generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("depth", [2, 4])
def test_blocks_compile_once_for_every_block_and_step_and_match_eager(depth):
    eager = _model(depth)
    expected = _draw(eager)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = compile_for_sampling(_model(depth), "blocks", backend=counter)
    got = _draw(compiled, steps=3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # One graph serves every block and every step: compile time does not grow with depth, nothing recompiles.
    assert counter.frame_count == 1
    _draw(compiled, steps=5)
    assert counter.frame_count == 1


def test_whole_network_compiles_once_per_shape_and_matches_eager():
    x, t, y = inputs()
    model = _model()
    counter = CompileCounterWithBackend("aot_eager")
    graphed = compile_for_sampling(_model(), "graphs", backend=counter)
    assert isinstance(graphed, GraphedModel) and graphed.null_label == model.null_label  # reads through
    with torch.inference_mode():
        torch.testing.assert_close(graphed(x, t, y), model(x, t, y), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    graphed = compile_for_sampling(_model(), "graphs", backend=counter)
    torch.testing.assert_close(_draw(graphed, steps=4), _draw(model, steps=4), rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1  # one shape (the guided 2N batch) over every step
    # A guidance interval alternates 2N guided and N conditional calls: one graph each, none more.
    _draw(graphed, steps=6, interval=(0.0, 500.0))
    assert counter.frame_count == 2


def test_graphs_under_ddpm_with_noise_match_eager():
    """DDPM draws fresh noise each step from the generators; the compiled network sees only the network call."""
    model, counter = _model(), CompileCounterWithBackend("aot_eager")
    graphed = compile_for_sampling(_model(), "graphs", backend=counter)
    torch.testing.assert_close(_draw(graphed, sampler="ddpm", steps=4), _draw(model, sampler="ddpm", steps=4),
                               rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1


def test_off_is_the_model_itself_and_unknown_modes_are_refused():
    model = _model()
    assert compile_for_sampling(model, "off") is model
    with pytest.raises(ChoiceError):
        compile_for_sampling(model, "everything")
    with pytest.raises(ChoiceError):
        check_compile("everything", "cuda")
    check_compile("off", "cpu")
    for mode in COMPILE_MODES[1:]:
        check_compile(mode, "cuda")  # allowed where it builds
        with pytest.raises(SettingError):
            check_compile(mode, "cpu")


def test_sample_compile_on_the_cpu_is_one_paragraph_before_anything_is_read(tmp_path, capsys):
    out = tmp_path / "out"
    code, err = run_sample(["--ckpt", tmp_path / "missing-run", "--out", out, "--cpu", "--compile", "blocks"], capsys)
    assert code == 2
    assert "--compile blocks compiles the network for a CUDA GPU" in err and "Traceback" not in err
    assert "missing-run" not in err  # refused before the weights are looked for
    assert not out.exists()


def test_guidance_at_every_level_never_reads_a_tensor_on_the_host(monkeypatch):
    """No bool()/item() per step when guidance covers every level: on CUDA each would wait for the GPU."""
    model = _model()
    x, t, y = inputs()
    fn = GuidedModelFn(model, 1.5)
    with torch.inference_mode():
        expected = fn(x, t, y)

        def refuse(self):
            raise AssertionError("a tensor was read on the host")

        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "__bool__", refuse)
            patch.setattr(torch.Tensor, "item", refuse)
            got = fn(x, t, y)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_per_row_noise_is_each_rows_generator_draw_in_one_batch():
    """randn_rows stacks the rows' draws before one copy to the batch's device: the values are each row's own."""
    from shared.generative.diffusion import randn_rows

    like = torch.zeros(3, 4, 2, 2, dtype=torch.float64)
    got = randn_rows(like, [torch.Generator().manual_seed(s) for s in range(3)])
    expected = torch.stack([torch.randn(4, 2, 2, generator=torch.Generator().manual_seed(s)) for s in range(3)])
    assert torch.equal(got, expected) and got.device == like.device


def test_evaluate_run_compile_on_the_cpu_is_refused_before_any_sampling(tmp_path, tiny_vae_dir, capsys, monkeypatch):
    import evaluate.evaluation
    from evaluate.__main__ import main
    from shared.runtime import rundir
    from shared.tokenizers.locate import load_tokenizer
    from tests.helpers import run_main
    from tests.test_evaluate_run import FLAGS, export

    built = []
    monkeypatch.setattr(evaluate.evaluation, "build_features", lambda *args: built.append(args))
    run = tmp_path / "run"
    export(run, 100, load_tokenizer(tiny_vae_dir), seed=0)
    code, _, err = run_main(main, ["run", run, "--vae", tiny_vae_dir, *FLAGS, "--compile", "graphs"], capsys)
    assert code == 2 and "--compile graphs compiles the network for a CUDA GPU" in err
    assert not built  # refused before the feature network (Inception's weights) is loaded
    assert not rundir.eval_path(run).exists() and not (run / rundir.EVAL_SAMPLES).exists()


@pytest.mark.parametrize("config, graphs", [
    (dict(model="DiT-T/2", input_size=8, num_classes=5, norm="rmsnorm", mlp="swiglu", rope=True, qk_norm=True), 1),
    (dict(model="DiTDH-T", input_size=4, in_channels=16, num_classes=5, learn_sigma=False), 2)])
def test_blocks_compile_lightnings_block_and_the_dit_dh_head_without_a_graph_break(config, graphs):
    """RoPE and QK-norm inside the block, and DiT^DH's wider head blocks (their own graph), compile whole."""
    from shared.network.models import ModelConfig

    cfg = ModelConfig(**config)
    model = randomize(cfg.build(), scale=0.1).eval().requires_grad_(False)
    x, t, y = inputs(c=cfg.in_channels, size=cfg.input_size)
    with torch.inference_mode():
        expected = model(x, t, y)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = compile_for_sampling(model, "blocks", backend=counter)
    with torch.inference_mode():
        x, t, y = (v.clone() for v in (x, t, y))  # inference tensors, as in Drawer.draw
        torch.testing.assert_close(compiled(x, t, y), expected, rtol=1e-5, atol=1e-5)
        compiled(x, t, y)
    assert counter.frame_count == graphs


def test_compile_changes_no_recorded_identity_so_a_rerun_resumes(tmp_path, tiny_vae_dir):
    """settings.json's identity (what a resume compares) is the same with and without --compile."""
    from shared.sampling.plan import SampleOptions, make_plan
    from shared.tokenizers.locate import load_tokenizer
    from tests.test_evaluate_run import export

    run = tmp_path / "run"
    export(run, 100, load_tokenizer(tiny_vae_dir), seed=0)
    jobs = [make_plan(SampleOptions(ckpt=str(run), vae=str(tiny_vae_dir), out=str(tmp_path / "out"), compile=mode))
            for mode in ("off", "graphs")]
    assert jobs[0].settings["identity"] == jobs[1].settings["identity"]
    assert [job.settings["run"]["compile"] for job in jobs] == ["off", "graphs"]
