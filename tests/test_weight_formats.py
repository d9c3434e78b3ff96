"""The one loader's rules, the same for every record of shared/weights/checkpoint.py FORMATS: --weights picks an
entry wherever a file holds both, and a --objective that contradicts what the file says is refused, not ignored."""
import pytest
import torch

from shared.network.models import BLOCKS, ModelConfig
from shared.network.repa import REPA_PROJECTOR_PREFIX
from shared.runtime.errors import UserError
from shared.weights.export import save_weights
from shared.weights.checkpoint import load_sampling_weights
from tests.helpers import NUM_CLASSES, random_dit


def test_weights_raw_reads_a_lightningdit_checkpoints_model_entry(tmp_path):
    """Its train.py saves {'ema', 'model'}: ema by default, the raw 'model' entry with --weights raw."""
    config = ModelConfig("DiT-T/1", input_size=16, in_channels=32, learn_sigma=False, **BLOCKS["lightning"])
    ema, raw = random_dit(config, 1).state_dict(), random_dit(config, 2).state_dict()
    path = tmp_path / "lightningdit-xl-imagenet256-64ep.pt"
    torch.save({"ema": ema, "model": raw}, path)
    for asked, want, recorded in ((None, ema, "ema"), ("raw", raw, "raw")):
        loaded = load_sampling_weights(path, asked)
        assert loaded.weights == recorded and loaded.config.block == "lightning"
        assert all(torch.equal(loaded.state_dict[k], v) for k, v in want.items())


def test_an_objective_that_contradicts_the_file_is_refused(tmp_path):
    config = ModelConfig("DiT-T/2", input_size=8, num_classes=NUM_CLASSES)
    state = random_dit(config).state_dict()
    export = save_weights(tmp_path / "ema-step-0000001.safetensors", state, config, None, 1)
    assert load_sampling_weights(export, objective="ddpm").config.objective == "ddpm"
    with pytest.raises(UserError, match="--objective flow contradicts ema-step-0000001.safetensors: .* are ddpm models"):
        load_sampling_weights(export, objective="flow")
    repa = tmp_path / "last.pt"
    torch.save({**state, f"{REPA_PROJECTOR_PREFIX}0.0.weight": torch.zeros(2, 2)}, repa)
    with pytest.raises(UserError, match="weights of REPA's layout \\(its projector\\) are flow models"):
        load_sampling_weights(repa, objective="ddpm")
