"""Any latent space: tokenizers by class, the normalisation record end to end, folder statistics, patch-1 presets.

Every tokenizer here is a tiny random model made through diffusers' own class and save_pretrained
(tests/tiny_tokenizers.py), then loaded back through the real loading code and run through the real commands.
"""
import json
import shutil

import numpy as np
import pytest
import torch

from extract.__main__ import main as extract_main
from sample.__main__ import main as sample_main
from shared.datasets.shards import LatentDataset
from shared.runtime.export import load_weights
from shared.tokenizers.norm import ChannelStats, LatentNorm
from shared.tokenizers.vae import LatentVAE, measure_latent, read_vae_config
from tests.conftest import make_image_folder
from tests.helpers import make_latents, run_main
from tests.tiny_tokenizers import MAKERS, unsupported
from train.__main__ import main as train_main

IMAGE_SIZE = 16
# class -> (normalisation kind of its own convention, deterministic, latent (C, h, w) at 16 px)
EXPECTED = {"flux-like": ("shift-scale", False, (16, 4, 4)), "vavae-like": ("channel", False, (8, 4, 4)),
            "dc-ae": ("scale", True, (8, 8, 8)), "flux2-like": ("channel", False, (16, 4, 4))}


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("images") / "imgs", per_class=2)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """name -> folder of each tiny tokenizer."""
    root = tmp_path_factory.mktemp("tokenizers")
    return {name: make(root / name) for name, make in MAKERS.items()}


@pytest.fixture(scope="module")
def extracted(tmp_path_factory, images, tokenizers):
    """name -> latent folder extracted at 16 px in fp32 (so stored moments equal the encoder's exactly)."""
    root = tmp_path_factory.mktemp("latents")
    out = {}
    for name, vae in tokenizers.items():
        out[name] = root / name
        code, _, err = run_main(extract_main, ["--data-path", images, "--out", out[name], "--vae", vae,
                                               "--image-size", IMAGE_SIZE, "--num-workers", 0, "--dtype", "fp32"])
        assert code == 0, err
    return out


def _train(latents, run, *extra, capsys=None):
    """Two steps of DiT-T/1 with a checkpoint, an export and a preview at step 2 -> (code, stdout, stderr)."""
    argv = ["--model", "DiT-T/1", "--latents", latents, "--results-dir", run, "--global-batch-size", 4,
            "--num-workers", 0, "--max-steps", 2, "--ckpt-every", 2, "--sample-every", 2, "--sample-steps", 2,
            "--log-every", 1, *extra]
    return run_main(train_main, argv, capsys)


# ---------------------------------------------------------------------------------------------------------
# The record
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("norm", [LatentNorm.scale_only(0.18215), LatentNorm.shift_scale(0.1159, 0.3611),
                                  LatentNorm.channel([0.5, -1.0, 2.0], [0.5, 2.0, 1.5], 1.0),
                                  LatentNorm.channel([0.1, 0.2, 0.3], [1.0, 2.0, 3.0], 0.13025), LatentNorm.none()])
def test_norm_apply_invert_and_record(norm):
    z = torch.randn(2, 3, 4, 4, dtype=torch.float64).float()
    x = norm.apply(z)
    torch.testing.assert_close(norm.invert(x), z, rtol=1e-6, atol=1e-6)
    mean = torch.tensor(norm.mean).view(1, -1, 1, 1)
    std = torch.tensor(norm.std).view(1, -1, 1, 1)
    torch.testing.assert_close(x, (z - mean) / std * norm.scale)
    assert LatentNorm.from_dict(json.loads(json.dumps(norm.to_dict()))) == norm


def test_channel_stats_merge_equals_direct_float64():
    g = torch.Generator().manual_seed(0)
    parts = [(torch.randn(n, 2, 3, 4, 4, generator=g) * 2 + 1, torch.rand(n, 2, 3, 4, 4, generator=g))
             for n in (5, 1, 7)]
    stats = ChannelStats()
    for mean, std in parts:
        half = ChannelStats()
        half.add(mean, std)
        stats.merge(ChannelStats.from_dict(json.loads(json.dumps(half.to_dict()))))  # through the sidecar's JSON
    means = torch.cat([m for m, _ in parts]).double().transpose(0, 2).reshape(3, -1)  # (C, values)
    stds = torch.cat([s for _, s in parts]).double().transpose(0, 2).reshape(3, -1)
    expected_std = (means.var(dim=1, unbiased=False) + (stds ** 2).mean(dim=1)).sqrt()
    mean, std = stats.result()
    np.testing.assert_allclose(mean, means.mean(dim=1).numpy(), rtol=1e-12)
    np.testing.assert_allclose(std, expected_std.numpy(), rtol=1e-12)


# ---------------------------------------------------------------------------------------------------------
# Tokenizers by class
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(MAKERS))
def test_each_class_loads_measures_and_knows_its_convention(tokenizers, name):
    kind, deterministic, shape = EXPECTED[name]
    vae = LatentVAE.load(tokenizers[name])
    assert vae.norm.kind == kind and vae.deterministic is deterministic
    assert measure_latent(read_vae_config(tokenizers[name]), IMAGE_SIZE) == shape
    mean, std = vae.encode_moments(torch.rand(2, 3, IMAGE_SIZE, IMAGE_SIZE) * 2 - 1)
    assert tuple(mean.shape[1:]) == shape and (std is None) == deterministic
    assert vae.identity["class"] == vae.vae.__class__.__name__
    assert vae.downsample_factor == IMAGE_SIZE // shape[-1] and vae.latent_channels == shape[0]
    config = read_vae_config(tokenizers[name])
    if name == "flux-like":
        assert vae.norm == LatentNorm.shift_scale(config["shift_factor"], config["scaling_factor"])
    if name == "vavae-like":
        assert vae.norm == LatentNorm.channel(config["latents_mean"], config["latents_std"], 1.0)
    if name == "flux2-like":  # FLUX.2's pipeline: its BatchNorm running statistics
        bn = vae.vae.bn
        assert vae.norm == LatentNorm.channel(bn.running_mean.tolist(),
                                              torch.sqrt(bn.running_var.double() + 1e-4).tolist(), 1.0)
    # decode inverts the record: equal to the diffusers decode of the raw latent
    z = torch.randn(1, *shape)
    torch.testing.assert_close(vae.decode(vae.norm.apply(z)), vae.decode_raw(z), rtol=1e-4, atol=1e-5)


def test_an_unsupported_class_is_one_paragraph_and_writes_nothing(tmp_path, images, capsys):
    vae = unsupported(tmp_path / "vq")
    code, _, err = run_main(extract_main, ["--data-path", images, "--out", tmp_path / "out", "--vae", vae,
                                           "--image-size", IMAGE_SIZE], capsys)
    assert code == 2 and "VQModel" in err and "AutoencoderKL" in err and "AutoencoderDC" in err, err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_dry_run_measures_a_dc_ae_instead_of_counting_blocks(images, tokenizers, tmp_path, capsys):
    code, out, _ = run_main(extract_main, ["--data-path", images, "--out", tmp_path / "out", "--vae",
                                           tokenizers["dc-ae"], "--image-size", IMAGE_SIZE, "--dry-run"], capsys)
    assert code == 0
    assert "AutoencoderDC (deterministic): latent 8x8x8 at 16 px (f2, measured" in out, out
    # 2 flips x 8x8x8 values x fp16, the latent alone: 2 KiB per image
    assert "moments 2 KiB per image (2 flip(s) x latent (deterministic tokenizer, no std) 8x8x8 fp16)" in out
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------
# Folder statistics
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["vavae-like", "dc-ae"])
def test_statistics_from_shards_equal_statistics_computed_directly(extracted, name):
    folder = extracted[name]
    ds = LatentDataset(folder, progress=False)
    stats = ds.latent_stats
    batch = ds.gather(np.arange(len(ds)))  # every column, (N, F, C, h, w)
    assert ("std" in batch) != ds.deterministic  # DC-AE's folder stores the latent alone
    means = batch["mean"].double().transpose(0, 2).reshape(ds.latent_shape[0], -1)  # (C, images*flips*h*w)
    var = means.var(dim=1, unbiased=False)
    if not ds.vae["deterministic"]:
        var = var + (batch["std"].double().transpose(0, 2).reshape(ds.latent_shape[0], -1) ** 2).mean(dim=1)
    np.testing.assert_allclose(stats["mean"], means.mean(dim=1).numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(stats["std"], var.sqrt().numpy(), rtol=1e-10)
    assert stats["images"] == len(ds) and stats["flips"] == 2


def test_stats_command_adds_the_same_statistics_without_encoding(extracted, tmp_path, capsys):
    folder = tmp_path / "copy"
    shutil.copytree(extracted["flux-like"], folder)
    index = json.loads((folder / "index.json").read_text())
    written = index.pop("latent_stats")
    (folder / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    code, out, err = run_main(extract_main, ["--stats", "--out", folder], capsys)
    assert code == 0, err
    assert "added" in out
    again = json.loads((folder / "index.json").read_text())["latent_stats"]
    np.testing.assert_allclose(again["mean"], written["mean"], rtol=1e-12)
    np.testing.assert_allclose(again["std"], written["std"], rtol=1e-12)


# ---------------------------------------------------------------------------------------------------------
# extract -> train -> sample -> decode, per class
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,norm", [("flux-like", "auto"), ("vavae-like", "auto"), ("dc-ae", "auto"),
                                       ("flux2-like", "auto"), ("flux-like", "channel")])
def test_train_records_the_norm_and_every_decode_inverts_it(extracted, tokenizers, tmp_path, name, norm):
    run = tmp_path / "run"
    code, _, err = _train(extracted[name], run, "--latent-norm", norm)
    assert code == 0, err
    export = sorted((run / "exports").glob("*.safetensors"))[-1]
    _, config, meta, _ = load_weights(export)
    record = LatentNorm.from_dict(meta["latent_norm"])
    ds = LatentDataset(extracted[name], progress=False)
    if norm == "auto":
        assert record == ds.native_norm
    else:
        assert record == LatentNorm.channel(ds.latent_stats["mean"], ds.latent_stats["std"])
    # The round trip: a stored latent, normalised as training does and decoded as sampling does, equals the
    # tokenizer's own decode of the raw latent (fp32 tolerance).
    vae = LatentVAE.load(tokenizers[name])
    stored = ds.gather(np.arange(2), ("mean",))["mean"][:, 0]  # (2, C, h, w) raw, flip 0
    torch.testing.assert_close(vae.decode(record.apply(stored), record), vae.decode_raw(stored),
                               rtol=1e-4, atol=2e-5)
    # sample and the preview decode run with no flags: the record travels in the export and the preview file
    code, _, err = run_main(sample_main, ["--ckpt", run, "--num-samples", 2, "--num-sampling-steps", 2, "--out",
                                          tmp_path / "samples", "--cpu"])
    assert code == 0, err
    assert len(list((tmp_path / "samples").glob("0*.png"))) == 2
    code, _, err = run_main(sample_main, ["decode", run, "--cpu"])
    assert code == 0, err
    assert (run / "samples" / "step-0000002" / "grid.png").is_file()


# ---------------------------------------------------------------------------------------------------------
# Bad input: one paragraph, exit 2, nothing written or lost
# ---------------------------------------------------------------------------------------------------------

def test_channel_norm_without_statistics_names_the_stats_command(tmp_path, capsys):
    latents = make_latents(tmp_path / "lat")  # a folder from before the statistics
    code, _, err = _train(latents, tmp_path / "run", "--latent-norm", "channel", capsys=capsys)
    assert code == 2 and f"`python -m extract --stats --out {latents}`" in err and "without them" in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_shift_scale_without_a_shift_is_refused(extracted, tmp_path, capsys):
    code, _, err = run_main(train_main, ["--model", "DiT-T/1", "--latents", extracted["dc-ae"], "--results-dir",
                                         tmp_path / "run", "--latent-norm", "shift-scale", "--dry-run"], capsys)
    assert code == 2 and "shift_factor" in err and "--latent-norm auto" in err, err


def test_resume_with_another_norm_is_refused_and_keeps_the_run(extracted, tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(extracted["vavae-like"], run)[0] == 0
    before = sorted(p.name for p in run.rglob("*"))
    code, _, err = run_main(train_main, ["--model", "DiT-T/1", "--latents", extracted["vavae-like"], "--results-dir",
                                         run, "--global-batch-size", 4, "--num-workers", 0, "--max-steps", 4,
                                         "--latent-norm", "channel"], capsys)
    assert code == 2 and "normalised as" in err and "--latent-norm" in err, err
    assert sorted(p.name for p in run.rglob("*")) == before


def test_a_dit_narrower_than_its_tokens_is_refused(tmp_path, capsys):
    latents = make_latents(tmp_path / "lat", shape=(64, 2, 2), n=8)
    code, _, err = run_main(train_main, ["--model", "DiT-T/2", "--latents", latents, "--results-dir",
                                         tmp_path / "run", "--dry-run"], capsys)
    assert code == 2 and "192 wide" in err and "256 values per token" in err and "DiT-T/1" in err, err
    assert not (tmp_path / "run").exists()


def test_a_patch_that_does_not_divide_the_grid_is_refused(tmp_path, capsys):
    latents = make_latents(tmp_path / "lat", shape=(4, 3, 3), n=8, image_size=12)
    code, _, err = run_main(train_main, ["--model", "DiT-T/2", "--latents", latents, "--results-dir",
                                         tmp_path / "run", "--dry-run"], capsys)
    assert code == 2 and "patch size 2" in err and "DiT-T/1" in err, err


def test_export_of_a_non_scale_norm_to_dit_pipeline_is_refused(extracted, tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(extracted["flux-like"], run)[0] == 0
    code, _, err = run_main(sample_main, ["export", run, tmp_path / "pipe", "--format", "diffusers"], capsys)
    assert code == 2 and "shift-scale" in err and "DiTPipeline" in err and "--latent-norm scale" in err, err
    assert not (tmp_path / "pipe").exists()
