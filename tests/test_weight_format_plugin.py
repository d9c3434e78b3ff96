"""A new weight source from outside the package: one WeightFormat record, registered by this module alone.

The record reads a DiT state dict saved as a numpy archive (e.g. a port from JAX) whose `__objective__` entry
names the objective. `--plugin tests.test_weight_format_plugin` makes python -m sample import this module, so the
record exists in that process and the real CLI samples the file; no file of the package is edited for it.
"""
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from shared.network.models import ModelConfig, infer_model_config
from shared.runtime.errors import UserError
from shared.weights.checkpoint import FORMATS, Read, WeightFormat, load_sampling_weights, register_format
from tests.conftest import ROOT
from tests.helpers import NUM_CLASSES, random_dit

PLUGIN = __name__  # "tests.test_weight_format_plugin": importable from the repository root
OBJECTIVE_KEY = "__objective__"


def _read_npz(found, weights, objective) -> Read:
    """The archive's arrays as tensors; the architecture from their shapes, the objective from its entry."""
    with np.load(found.path) as arrays:
        state = {k: torch.from_numpy(arrays[k].copy()) for k in arrays.files if k != OBJECTIVE_KEY}
        name = str(arrays[OBJECTIVE_KEY])
    config = dataclasses.replace(infer_model_config(state), objective=name)
    return Read(state, config, "the archive's __objective__ entry", ["read from a numpy archive (the npz plugin)"])


NPZ = WeightFormat("npz", lambda found: found.path.is_file() and found.path.suffix == ".npz", _read_npz,
                   lambda found: ((), "one set of weights (a numpy archive)"), kind="npz",
                   config_from="inferred from the archive's array shapes",
                   damaged="Export the archive again from its source.")
if NPZ.name not in FORMATS:  # pytest imports this module once; python -m sample --plugin once per process
    register_format(NPZ)


@pytest.fixture
def archive(tmp_path):
    """A random flow DiT-T/2 (8x8x4 latents) as a numpy archive, and its state dict."""
    state = random_dit(ModelConfig("DiT-T/2", input_size=8, num_classes=NUM_CLASSES)).state_dict()
    path = tmp_path / "port.npz"
    np.savez(path, **{k: v.numpy() for k, v in state.items()}, **{OBJECTIVE_KEY: np.array("flow")})
    return path, state


def test_a_registered_record_reads_its_files_through_the_one_loader(archive):
    path, state = archive
    loaded = load_sampling_weights(path)
    assert (loaded.kind, loaded.config.model, loaded.config.objective, loaded.weights) == ("npz", "DiT-T/2", "flow",
                                                                                          "as saved")
    assert loaded.state_dict.keys() == state.keys()
    assert all(torch.equal(loaded.state_dict[k], v) for k, v in state.items())
    assert "objective flow (the archive's __objective__ entry)" in loaded.notes
    assert "read from a numpy archive (the npz plugin)" in loaded.notes
    # The refusals are the loader's, written once: --weights raw, a contradicting --model or --objective, NaN.
    with pytest.raises(UserError, match="--weights raw does not apply to .*one set of weights \\(a numpy archive\\)"):
        load_sampling_weights(path, "raw")
    with pytest.raises(UserError, match="--model DiT-S/2 does not fit .*inferred from the archive's array shapes"):
        load_sampling_weights(path, model="DiT-S/2")
    with pytest.raises(UserError, match="--objective ddpm contradicts port.npz"):
        load_sampling_weights(path, objective="ddpm")
    arrays = {k: v.numpy().copy() for k, v in state.items()}
    arrays["final_layer.linear.bias"][0] = np.nan
    np.savez(path, **arrays, **{OBJECTIVE_KEY: np.array("flow")})
    with pytest.raises(UserError, match="holds non-finite weights.*Export the archive again"):
        load_sampling_weights(path)


def test_python_m_sample_reads_the_new_source_with_its_plugin(archive, tiny_vae_dir, tmp_path):
    path, _ = archive
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "sample", "--ckpt", path, "--vae", tiny_vae_dir, "--num-samples", "2",
            "--num-sampling-steps", "2", "--cpu", "--out", tmp_path / "out"]
    refused = subprocess.run([*map(str, argv)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr  # without the plugin: no record reads it
    done = subprocess.run([*map(str, argv), "--plugin", PLUGIN], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    settings = json.loads((tmp_path / "out" / "settings.json").read_text())
    assert settings["identity"]["kind"] == "npz" and settings["identity"]["model"]["objective"] == "flow"
    assert "read from a numpy archive (the npz plugin)" in settings["run"]["notes"]
    assert len(list((tmp_path / "out").glob("0*.png"))) == 2
