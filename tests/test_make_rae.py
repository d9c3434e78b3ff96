"""`python -m data.make_rae` at a tiny size: a folder diffusers' AutoencoderRAE loads, that reconstructs digits."""
import json
import subprocess
import sys

import pytest
import torch

from data.make_rae import ENCODER, psnr, split, to_unit
from shared.datasets.digits import digit_images
from tests.conftest import ROOT
from tests.helpers import run_main


@pytest.fixture(scope="module")
def tiny_rae(tmp_path_factory):
    """A digits RAE made by the real command as a subprocess (few steps), and what it printed."""
    out = tmp_path_factory.mktemp("rae") / "rae-digits"
    done = subprocess.run([sys.executable, "-m", "data.make_rae", "--out", str(out), "--encoder-steps", "10",
                           "--decoder-steps", "150"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done.stdout


def test_the_folder_loads_strictly_as_an_autoencoder_rae(tiny_rae):
    from diffusers import AutoencoderRAE

    out, printed = tiny_rae
    rae, info = AutoencoderRAE.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    config = json.loads((out / "config.json").read_text())
    assert torch.tensor(config["latents_mean"]).shape == (64, 4, 4)  # per element (C, H, W), RAE's statistics
    assert torch.tensor(config["latents_std"]).min() > 0
    assert type(rae.encoder).__name__ == "Dinov2WithRegistersModel"
    assert rae.encoder.config.num_attention_heads == 1 and rae.encoder.layernorm.weight is None
    assert not any(p.requires_grad for p in rae.encoder.parameters())
    assert "PSNR held-out, RAE" in printed and "digits VAE" in printed


def test_it_reconstructs_held_out_digits_better_than_the_mean_digit(tiny_rae):
    """decode(encode(x)) beats the best constant guess (the mean training digit), so the tokens carry the digit."""
    from diffusers import AutoencoderRAE

    rae = AutoencoderRAE.from_pretrained(tiny_rae[0]).eval()
    images = to_unit(torch.from_numpy(digit_images()[0]))  # (1797, 3, 32, 32) in [0, 1]
    train_idx, held_idx = split(len(images))
    held = images[held_idx]
    with torch.no_grad():
        latents = rae.encode(held).latent  # (N, 64, 4, 4), normalised
        recon = rae.decode(latents).sample
    assert latents.shape == (len(held), ENCODER["encoder_hidden_size"], 4, 4)
    assert abs(float(latents.mean())) < 0.5 and 0.5 < float(latents.std()) < 2  # about unit scale on unseen digits
    baseline = psnr(images[train_idx].mean(0, keepdim=True).expand_as(held), held)
    assert psnr(recon, held) > baseline + 1.0


def test_bad_settings_are_one_paragraph_and_write_nothing(tmp_path, capsys):
    from data.make_rae import main

    code, _, err = run_main(main, ["--out", tmp_path / "rae", "--decoder-steps", "0"], capsys)
    assert code == 2 and "--decoder-steps" in err and "Traceback" not in err
    assert not (tmp_path / "rae").exists()
