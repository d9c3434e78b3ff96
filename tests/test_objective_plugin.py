"""A third objective from outside the package: x-prediction flow matching, registered by this module alone.

The class below is all a researcher writes (no file of the package is edited for it). `--plugin
tests.test_objective_plugin` makes python -m train, python -m sample and python -m evaluate run import this
module, so the objective, its training flag (--loss-space) and its recorded field exist in every process; the
model config records the objective, its recorded fields and the module, so sampling asks for the module by name.
"""
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from shared.generative.diffusion import mean_flat
from shared.generative.flow import FlowPath
from shared.generative.flow_objectives import FlowObjective
from shared.generative.objectives import OBJECTIVES, make_objective, objective_of, register_objective, run_sampler
from shared.runtime.cli import option
from shared.runtime.errors import ChoiceError, SettingError
from tests.conftest import ROOT

PLUGIN = __name__  # "tests.test_objective_plugin": importable from the repository root


@dataclass(frozen=True)
class XPredictionPath(FlowPath):
    """The linear path with a network that predicts the clean latent x1 (JiT-style) instead of the velocity."""

    clamp: float = 0.05  # floor of 1 - tau in v = (x1_hat - x_tau) / (1 - tau): finite at tau = 1

    def field(self, model_fn, x, model_t, model_kwargs):
        """SiT's velocity at x from the predicted x1 (N,C,h,w): v = (x1_hat - x) / (1 - tau)."""
        x1_hat = model_fn(x, model_t, **(model_kwargs or {}))[:, :x.shape[1]].float()
        gap = (1 - self.tau_of(model_t)).clamp_min(self.clamp).view(-1, *([1] * (x.ndim - 1)))  # (N, 1, 1, 1)
        return ((x1_hat - x) / gap).float()

    def losses(self, model_fn, x1, tau, noise, model_kwargs, space: str) -> dict:
        """MSE on x1 itself (space "x") or on the velocity it implies (space "v"), each (N,)."""
        t = tau.view(-1, *([1] * (x1.ndim - 1))).to(x1.dtype)  # (N, 1, 1, 1)
        xt = t * x1 + (1 - t) * noise  # (N, C, h, w)
        if space == "x":
            x1_hat = model_fn(xt, self.model_time(tau), **(model_kwargs or {}))[:, :x1.shape[1]].float()
            mse = mean_flat((x1_hat - x1) ** 2)
        else:
            mse = mean_flat((self.call(model_fn, xt, tau, model_kwargs) - (x1 - noise)) ** 2)
        return {"loss": mse, "mse": mse}


@register_objective
@dataclass
class XFlowObjective(FlowObjective):
    """Flow matching on the linear path whose network predicts x1; SiT's samplers walk the velocity it implies."""

    clamp: float = 0.05  # recorded: sampling converts with the same floor
    loss_space: str = option("x", "x: MSE on the predicted clean latent (JiT); v: MSE on the velocity it implies",
                             choices=("x", "v"))

    name: ClassVar[str] = "xflow"
    help: ClassVar[str] = "flow matching, x-prediction (a test plugin)"

    def make_path(self) -> XPredictionPath:
        return XPredictionPath(self.convention, self.clamp)

    def training_losses(self, model_fn, x0, t, noise, model_kwargs=None) -> dict:
        return self.path.losses(model_fn, x0, t, noise, model_kwargs, self.loss_space)


# ----------------------------------------------------------------------------------------------------------
# The registry, in-process
# ----------------------------------------------------------------------------------------------------------

def test_the_registry_builds_what_it_is_asked_and_nothing_else():
    assert OBJECTIVES["xflow"] is XFlowObjective
    built = make_objective("xflow", {"clamp": 0.1}, loss_space="v", time_sampling="lognormal")
    assert isinstance(built, XFlowObjective) and (built.clamp, built.loss_space, built.time_sampling) == (0.1, "v",
                                                                                                         "lognormal")
    with pytest.raises(ChoiceError):  # a name nobody registered is refused, never built as some default
        make_objective("edm")
    with pytest.raises(SettingError, match="applies to the xflow objective only"):
        make_objective("flow", loss_space="v")
    with pytest.raises(SettingError, match="records only convention"):
        make_objective("flow", {"clamp": 0.1})
    with pytest.raises(TypeError, match="is taken by"):
        register_objective(dataclass(type("Other", (XFlowObjective,), {"name": "xflow"})))


def test_x_prediction_samples_land_on_the_data_the_oracle_predicts():
    """With a network that always predicts the one data point x1, Euler's last step (h = 1 - tau) lands on x1."""
    x1 = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    objective = make_objective("xflow")
    x = run_sampler(objective, "euler", lambda x, t: x1, torch.randn_like(x1), 8, {})
    torch.testing.assert_close(x, x1, atol=1e-5, rtol=1e-5)
    with pytest.raises(SettingError, match="samples ddpm models"):
        run_sampler(objective, "ddim", lambda x, t: x1, torch.randn_like(x1), 8, {})


# ----------------------------------------------------------------------------------------------------------
# Through the real command lines
# ----------------------------------------------------------------------------------------------------------

def _run(args, tmp_path, expect=0) -> subprocess.CompletedProcess:
    """`python -m ARGS` from the repository root, as a user types it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == expect, done.stderr[-3000:]
    return done


@pytest.mark.usefixtures("private_digits_cache")
def test_a_plugin_objective_trains_samples_and_is_evaluated(tmp_path, image_folder, tiny_vae_dir):
    from extract.__main__ import main as extract_main
    from shared.runtime import rundir
    from shared.weights.export import read_config

    latents = tmp_path / "latents"
    assert extract_main([str(a) for a in ("--data-path", image_folder, "--out", latents, "--vae", tiny_vae_dir,
                                          "--image-size", 32, "--shard-size", 8, "--batch-size", 9,
                                          "--num-workers", 0)]) == 0
    run = tmp_path / "run"
    _run(["train", "--plugin", PLUGIN, "--objective", "xflow", "--loss-space", "v", "--model", "DiT-T/2",
          "--latents", latents, "--results-dir", run, "--global-batch-size", "4", "--num-workers", "0",
          "--max-steps", "2", "--ckpt-every", "2", "--sample-every", "2", "--sample-steps", "2", "--log-every", "1"],
         tmp_path)
    config = json.loads((run / "config.json").read_text())
    assert (config["objective"], config["objective_options"]["loss_space"]) == ("xflow", "v")
    export = rundir.list_exports(run)[-1]
    recorded = read_config(export)
    assert (recorded.objective, recorded.objective_args, recorded.plugins) == (
        "xflow", {"convention": "sit", "time_dist_shift": 1.0, "clamp": 0.05}, [PLUGIN])
    assert isinstance(objective_of(recorded), XFlowObjective)
    assert (run / "samples" / "step-0000002.safetensors").is_file()  # the preview used the plugin's sampler path

    out = tmp_path / "samples"
    sample = ["sample", "--ckpt", run, "--vae", tiny_vae_dir, "--num-samples", "2", "--num-sampling-steps", "3",
              "--cfg-scale", "1", "--cpu", "--out", out]
    refused = _run(sample, tmp_path, expect=2)  # without the module, the objective cannot be rebuilt: say which
    assert f"pass --plugin {PLUGIN}" in " ".join(refused.stderr.split()) and not out.exists()
    _run([*sample, "--plugin", PLUGIN], tmp_path)
    settings = json.loads((out / "settings.json").read_text())["identity"]
    assert settings["sampler"] == "sde" and settings["model"]["objective"] == "xflow"  # the objective's default
    assert len(list(out.glob("0*.png"))) == 2

    _run(["evaluate", "run", run, "--plugin", PLUGIN, "--vae", tiny_vae_dir, "--features", "digits",
          "--num-samples", "4", "--num-sampling-steps", "2", "--cfg-scale", "1", "--batch-size", "4", "--cpu"],
         tmp_path)
    rows = [json.loads(line) for line in rundir.eval_path(run).read_text().splitlines()]
    assert [r["step"] for r in rows] == [2] and rows[0]["sampler"] == "euler" and rows[0]["fid"] > 0
