"""A block option from outside the package: a squared-ReLU MLP registered by a module of the user's alone.

PLUGIN_SOURCE is all a researcher writes (no file of the package is edited for it). It is written into a folder
on PYTHONPATH; `--plugin relu2_block` makes python -m train and python -m sample import it, so `--mlp relu2`
exists there. The model config records the module, so sampling without it names it. DiT and DiT^DH build the
option through the one table (shared/network/blocks.py).
"""
import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

import shared.network.blocks as blocks
from shared.network.models import ModelConfig, infer_model_config
from shared.runtime.errors import UserError
from tests.conftest import ROOT
from tests.helpers import expect_user_error, train_args

MODULE = "relu2_block"
PLUGIN_SOURCE = '''
"""Squared ReLU feed-forward (So et al. 2021, "Primer", Sec. 3): down(relu(up(x))^2)."""
import torch
import torch.nn as nn

from shared.network.blocks import register_block_option


class ReLU2Mlp(nn.Module):
    def __init__(self, dim, mlp_ratio):
        super().__init__()
        self.up = nn.Linear(dim, int(dim * mlp_ratio))
        self.down = nn.Linear(int(dim * mlp_ratio), dim)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)) ** 2)


register_block_option("mlp", "relu2", "squared ReLU, 4x width (Primer)", ReLU2Mlp, marker="blocks.0.mlp.up.weight")
'''


@pytest.fixture
def plugin_dir(tmp_path):
    """A folder outside the repository holding the plugin module."""
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / f"{MODULE}.py").write_text(PLUGIN_SOURCE)
    return folder


@pytest.fixture
def plugin(plugin_dir, monkeypatch):
    """The plugin imported in this process, into a copy of the table (the session's table is left as it was)."""
    monkeypatch.setattr(blocks, "BLOCK_OPTIONS", {slot: values.copy() for slot, values in blocks.BLOCK_OPTIONS.items()})
    monkeypatch.syspath_prepend(str(plugin_dir))
    sys.modules.pop(MODULE, None)
    try:
        yield importlib.import_module(MODULE)
    finally:
        sys.modules.pop(MODULE, None)


def test_dit_and_dit_dh_take_the_option_through_the_one_table(plugin):
    assert blocks.BLOCK_OPTIONS["mlp"]["relu2"].module == MODULE
    dit = ModelConfig("DiT-T/2", 8, num_classes=5, mlp="relu2")
    dh = ModelConfig("DiTDH-T", 8, in_channels=8, num_classes=5, learn_sigma=False, objective="flow", mlp="relu2")
    for config, blocks_in_all in ((dit, 6), (dh, 4 + 2)):  # DiT-T's 6; DiTDH-T's body of 4 and head of 2
        model = config.build()
        assert config.plugins == [MODULE]
        assert [type(b.mlp) for b in model.blocks] == [plugin.ReLU2Mlp] * blocks_in_all
        x = torch.randn(2, 3, model.blocks[-1].mlp.up.in_features)
        mlp = model.blocks[-1].mlp  # the head's block in DiT^DH: the head's width
        torch.testing.assert_close(mlp(x), mlp.down(torch.relu(mlp.up(x)) ** 2))
        with torch.device("meta"):
            assert infer_model_config(config.build().state_dict()).mlp == "relu2"  # read back by its marker
    assert dh.build().blocks[-1].mlp.up.in_features == 384  # DiTDH-T's head width


def test_the_config_records_every_plugin_it_needs(plugin):
    import tests.test_objective_plugin as xflow  # registers the objective xflow

    both = ModelConfig("DiT-T/2", 8, learn_sigma=False, mlp="relu2", objective="xflow")
    assert both.plugins == sorted([MODULE, xflow.PLUGIN])
    assert ModelConfig.from_dict(both.to_dict()) == both
    old = {"model": "DiT-T/2", "input_size": 8, "learn_sigma": False, "objective": "xflow",
           "objective_plugin": xflow.PLUGIN}  # an earlier form, never released: refused, not read
    with pytest.raises(UserError, match=r"unknown keys \['objective_plugin'\]"):
        ModelConfig.from_dict(old)
    assert ModelConfig("DiT-T/2", 8, plugins=[MODULE]).plugins == []  # derived: a built-in model needs none


def test_a_plugin_cannot_take_a_built_in_value_or_a_slot_that_is_not_there(plugin):
    with pytest.raises(TypeError, match="is taken by"):
        blocks.register_block_option("mlp", "swiglu", "another", plugin.ReLU2Mlp)
    with pytest.raises(TypeError, match="no block slot"):
        blocks.register_block_option("layerscale", "on", "not a slot", plugin.ReLU2Mlp)
    with pytest.raises(TypeError, match="takes True/False"):
        blocks.register_block_option("rope", "axial", "a switch", plugin.ReLU2Mlp)


def test_without_the_plugin_the_value_is_refused_naming_the_flag(latents, tmp_path, capsys):
    message = expect_user_error(capsys, train_args(latents, tmp_path / "run", "--mlp", "relu2"))
    assert "--mlp 'relu2' is not a valid block mlp" in message and "gelu" in message and "swiglu" in message
    assert not (tmp_path / "run").exists()


def _run(args, plugin_dir, expect=0) -> subprocess.CompletedProcess:
    """`python -m ARGS` from the repository root, the plugin's folder on PYTHONPATH as a user would put it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(plugin_dir)]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == expect, done.stderr[-3000:]
    return done


@pytest.mark.slow
@pytest.mark.usefixtures("private_digits_cache")
def test_a_plugin_block_option_trains_and_samples(tmp_path, plugin_dir, plugin, image_folder, tiny_vae_dir):
    from extract.__main__ import main as extract_main
    from shared.runtime import rundir
    from shared.weights.export import load_weights

    latents = tmp_path / "latents"
    assert extract_main([str(a) for a in ("--data-path", image_folder, "--out", latents, "--vae", tiny_vae_dir,
                                          "--image-size", 32, "--shard-size", 8, "--batch-size", 9,
                                          "--num-workers", 0)]) == 0
    run = tmp_path / "run"
    _run(["train", "--plugin", MODULE, "--mlp", "relu2", "--model", "DiT-T/2", "--latents", latents, "--results-dir",
          run, "--global-batch-size", "4", "--num-workers", "0", "--max-steps", "2", "--ckpt-every", "2",
          "--sample-every", "0", "--log-every", "1"], plugin_dir)
    config = json.loads((run / "config.json").read_text())
    assert (config["block"], config["mlp"]) == ("dit", "relu2")  # the preset, one slot overridden
    state, recorded, _, step = load_weights(rundir.list_exports(run)[-1])  # read here with the plugin imported
    assert step == 2 and (recorded.block, recorded.mlp, recorded.plugins) == ("custom", "relu2", [MODULE])
    assert "blocks.5.mlp.up.weight" in state and not any(".mlp.fc1." in k for k in state)

    out = tmp_path / "samples"
    sample = ["sample", "--ckpt", run, "--vae", tiny_vae_dir, "--num-samples", "2", "--num-sampling-steps", "3",
              "--cfg-scale", "1", "--cpu", "--out", out]
    refused = _run(sample, plugin_dir, expect=2)  # without the module the block cannot be rebuilt: say which
    assert f"pass --plugin {MODULE}" in " ".join(refused.stderr.split()) and not out.exists()
    assert "Traceback" not in refused.stderr
    _run([*sample, "--plugin", MODULE], plugin_dir)
    assert json.loads((out / "settings.json").read_text())["identity"]["model"]["mlp"] == "relu2"
    assert len(list(out.glob("0*.png"))) == 2
