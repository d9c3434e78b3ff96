"""RAE as a tokenizer: diffusers' AutoencoderRAE folders through extract, train, sample and the decode paths.

The tokenizer is a tiny random AutoencoderRAE (tests/tiny_tokenizers.py `rae`: 64x4x4 tokens of 32 px images),
saved with save_pretrained and loaded back through the real loading code; the commands are the real ones.
"""
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from extract.__main__ import main as extract_main
from sample.__main__ import main as sample_main
from shared.datasets.shards import LatentDataset
from shared.runtime.export import load_weights
from shared.tokenizers.norm import ElementStats, LatentNorm
from shared.tokenizers.vae import LatentVAE, measure_latent, read_vae_config
from tests.conftest import make_image_folder
from tests.helpers import make_latents, run_main
from tests.tiny_tokenizers import rae, vavae_like
from train.__main__ import main as train_main

IMAGE_SIZE = 32  # the tiny RAE's decoder size (4x4 tokens x patch 8)
SHAPE = (64, 4, 4)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("images") / "imgs", per_class=2, size=(36, 40))


@pytest.fixture(scope="module")
def raes(tmp_path_factory):
    """with-stats (per-element latents_mean/std and scaling_factor 0.7 in its config) and no-stats folders."""
    root = tmp_path_factory.mktemp("raes")
    return {"stats": rae(root / "stats", scaling_factor=0.7), "nostats": rae(root / "nostats", seed=6, stats=False)}


def _extract(images, vae, out, *extra, capsys=None):
    return run_main(extract_main, ["--data-path", images, "--out", out, "--vae", vae, "--image-size", IMAGE_SIZE,
                                   "--num-workers", 0, *extra], capsys)


@pytest.fixture(scope="module")
def extracted(tmp_path_factory, images, raes):
    """name -> latent folder (fp32, both flips)."""
    root = tmp_path_factory.mktemp("latents")
    for name, vae in raes.items():
        code, _, err = _extract(images, vae, root / name, "--dtype", "fp32")
        assert code == 0, err
    return {name: root / name for name in raes}


def _train(latents, run, *extra, capsys=None):
    """Two steps of DiTDH-T with a checkpoint, an export and a preview at step 2 -> (code, stdout, stderr)."""
    argv = ["--model", "DiTDH-T", "--latents", latents, "--results-dir", run, "--global-batch-size", 4,
            "--num-workers", 0, "--max-steps", 2, "--ckpt-every", 2, "--sample-every", 2, "--sample-steps", 2,
            "--log-every", 1, *extra]
    return run_main(train_main, argv, capsys)


# ---------------------------------------------------------------------------------------------------------
# The record and the numbers
# ---------------------------------------------------------------------------------------------------------

def test_element_norm_applies_inverts_and_travels_exactly():
    g = torch.Generator().manual_seed(0)
    mean, std = torch.randn(*SHAPE, generator=g), torch.rand(*SHAPE, generator=g) + 0.5
    norm = LatentNorm.element(mean, std, 0.7)
    z = torch.randn(3, *SHAPE, generator=g)
    x = norm.apply(z)
    assert torch.equal(x, (z - mean) / std * 0.7)
    torch.testing.assert_close(norm.invert(x), z, rtol=1e-6, atol=1e-6)
    back = LatentNorm.from_dict(json.loads(json.dumps(norm.to_dict())))
    assert back == norm and back.shape == SHAPE and torch.equal(back.apply(z), x)  # float32 bits, base64
    with pytest.raises(ValueError, match="64x4x4 cannot apply to these latents of shape 64x2x8"):
        norm.apply(torch.zeros(1, 64, 2, 8))


def test_element_stats_merge_equals_direct_float64():
    g = torch.Generator().manual_seed(1)
    parts = [torch.randn(n, 2, 3, 4, 4, generator=g) * 2 + 1 for n in (5, 1, 7)]
    stats = ElementStats()
    for part in parts:
        half = ElementStats()
        half.add(part)
        stats.merge(ElementStats.from_dict(json.loads(json.dumps(half.to_dict()))))  # through a sidecar's JSON
    every = torch.cat(parts).double().reshape(-1, 3, 4, 4)  # (images x flips, C, h, w)
    mean, std = stats.result()
    torch.testing.assert_close(mean, every.mean(dim=0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(std, (every.var(dim=0, unbiased=False) + 1e-5).sqrt(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["stats", "nostats"])
def test_tokens_and_decode_equal_autoencoder_rae(raes, name):
    """Our raw tokens + our norm record reproduce AutoencoderRAE.encode, and our decode its decode(encode(x))."""
    vae = LatentVAE.load(raes[name])
    module = vae.vae
    assert vae.deterministic and vae.identity["family"] == "rae"
    assert (vae.latent_channels, vae.downsample_factor) == (64, 8)
    assert measure_latent(read_vae_config(raes[name]), IMAGE_SIZE) == SHAPE
    x = torch.rand(3, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(2)) * 2 - 1
    tokens, std = vae.encode_moments(x)
    assert std is None and tuple(tokens.shape) == (3, *SHAPE)
    theirs = module.encode((x + 1) / 2).latent  # diffusers normalises inside encode; it takes [0, 1] images
    reference = module.decode(theirs).sample.clamp(0, 1)  # (3, 3, 32, 32) in [0, 1]
    assert reference.std() > 0.05  # the decoder's output depends on the tokens
    if name == "stats":
        config = read_vae_config(raes[name])
        expected = LatentNorm.element(torch.tensor(config["latents_mean"]),
                                      torch.tensor(config["latents_std"]) + 1e-5, 0.7)
        assert vae.norm == expected
        assert torch.equal(vae.norm.apply(tokens), theirs)  # bit for bit: one owner, the same arithmetic
        ours = vae.decode(vae.norm.apply(tokens))
    else:
        assert vae.norm is None and vae.identity["norm"] is None  # the folder's statistics are used
        torch.testing.assert_close(tokens / (1 + 1e-5), theirs, rtol=0, atol=1e-6)  # diffusers' (z - 0) / (1 + eps)
        ours = vae.decode_raw(tokens)
    torch.testing.assert_close((ours + 1) / 2, reference, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------
# extract -> train -> sample -> preview decode
# ---------------------------------------------------------------------------------------------------------

def test_extraction_stores_the_tokens_alone_and_per_element_statistics(extracted, raes):
    for name, folder in extracted.items():
        ds = LatentDataset(folder, progress=False)
        assert ds.deterministic and ds.latent_shape == SHAPE and ds.flips == 2
        index = json.loads((folder / "index.json").read_text())
        assert [t["name"] for t in index["tensors"]] == ["mean"]  # no std column
        batch = ds.gather(np.arange(len(ds)), ("mean",))["mean"]  # (N, 2, 64, 4, 4) as stored
        vae = LatentVAE.load(raes[name])
        every = batch.double().reshape(-1, *SHAPE)
        summary = index["latent_stats"]["element"]
        norm = ElementStats.norm_of_summary(summary, "")
        torch.testing.assert_close(torch.tensor(norm.mean).view(SHAPE), every.mean(dim=0).float(), rtol=1e-6,
                                   atol=1e-6)
        torch.testing.assert_close(torch.tensor(norm.std).view(SHAPE),
                                   (every.var(dim=0, unbiased=False) + 1e-5).sqrt().float(), rtol=1e-6, atol=1e-6)
        assert index["vae"]["class"] == "AutoencoderRAE" and index["vae"]["family"] == "rae"
        assert vae.identity["norm"] == index["vae"]["norm"]


def test_dry_run_prints_the_token_storage(images, raes, tmp_path, capsys):
    code, out, err = _extract(images, raes["stats"], tmp_path / "out", "--dtype", "bf16", "--flip", "none",
                              "--dry-run", capsys=capsys)
    assert code == 0, err
    assert "AutoencoderRAE (deterministic): latent 64x4x4 at 32 px" in out, out
    # 64 x 4 x 4 values x 2 bytes, one frame, the tokens alone
    assert "moments 2 KiB per image (1 flip(s) x latent (deterministic tokenizer, no std) 64x4x4 bf16)" in out, out
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, extracted):
    """name -> a two-step DiTDH-T run on that folder's tokens (checkpoint, export and preview at step 2)."""
    root = tmp_path_factory.mktemp("runs")
    for name, folder in extracted.items():
        code, _, err = _train(folder, root / name)
        assert code == 0, err
    return {name: root / name for name in extracted}


@pytest.mark.parametrize("name", ["stats", "nostats"])
def test_train_sample_and_preview_decode_through_the_rae_decoder(extracted, raes, runs, tmp_path, name):
    run = runs[name]
    _, config, meta, _ = load_weights(sorted((run / "exports").glob("*.safetensors"))[-1])
    record = LatentNorm.from_dict(meta["latent_norm"])
    ds = LatentDataset(extracted[name], progress=False)
    if name == "stats":
        assert record == LatentVAE.load(raes[name]).norm  # the config's numbers, diffusers' convention
    else:
        assert record == ElementStats.norm_of_summary(ds.latent_stats["element"], "")  # the folder's
    # sample decodes through the RAE decoder, with no flags: the record and the tokenizer travel with the run
    code, _, err = run_main(sample_main, ["--ckpt", run, "--num-samples", 2, "--num-sampling-steps", 2, "--out",
                                          tmp_path / "samples", "--cpu"])
    assert code == 0, err
    pngs = sorted((tmp_path / "samples").glob("0*.png"))
    assert len(pngs) == 2 and Image.open(pngs[0]).size == (IMAGE_SIZE, IMAGE_SIZE)
    # what sampling decodes: a stored token grid normalised as training did comes back as the RAE's own decode
    vae = LatentVAE.load(raes[name])
    stored = ds.gather(np.arange(2), ("mean",))["mean"][:, 0]  # (2, 64, 4, 4) raw, flip 0
    torch.testing.assert_close(vae.decode(record.apply(stored), record), vae.decode_raw(stored), rtol=0, atol=2e-6)


def test_previews_decode_and_watch_through_the_rae_decoder(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["nostats"], run)
    code, _, err = run_main(sample_main, ["decode", run, "--cpu"])
    assert code == 0, err
    grid = run / "samples" / "step-0000002" / "grid.png"
    assert grid.is_file()
    shutil.rmtree(grid.parent)
    code, _, err = run_main(sample_main, ["watch", run, "--cpu", "--interval", "0.1", "--exit-when-done",
                                          "--report-to", "none"])
    assert code == 0, err
    assert grid.is_file()


def test_the_evaluation_floor_round_trips_digits_through_the_rae(raes, capsys):
    from evaluate.floor import main as floor_main

    code, out, err = run_main(floor_main, ["--vae", raes["stats"], "--counts", 30, "--draws", 1], capsys)
    assert code == 0, err
    assert "30 via VAE vs all" in out, out


# ---------------------------------------------------------------------------------------------------------
# Bad input: one paragraph, exit 2, nothing written
# ---------------------------------------------------------------------------------------------------------

def _one_paragraph(err: str) -> str:
    assert "Traceback" not in err and err.count("error:") == 1, err
    return " ".join(err.split())


def test_an_rae_whose_decoder_was_trained_on_another_encoder_is_refused(images, tmp_path, capsys):
    folder = rae(tmp_path / "mixed")
    other = rae(tmp_path / "wide", encoder_hidden_size=128, stats=False)  # a decoder of 128-channel tokens
    shutil.copy(other / "diffusion_pytorch_model.safetensors", folder / "diffusion_pytorch_model.safetensors")
    code, _, err = _extract(images, folder, tmp_path / "out", capsys=capsys)
    err = _one_paragraph(err)
    assert code == 2 and "its decoder reads tokens of 128 channels, its encoder gives 64" in err, err
    assert not (tmp_path / "out").exists()


def test_statistics_of_another_shape_than_the_tokens_are_refused(images, tmp_path, capsys):
    folder = rae(tmp_path / "rae")
    config = json.loads((folder / "config.json").read_text())
    config["latents_mean"] = torch.zeros(64, 2, 2).tolist()
    (folder / "config.json").write_text(json.dumps(config))
    code, _, err = _extract(images, folder, tmp_path / "out", capsys=capsys)
    err = _one_paragraph(err)
    assert code == 2 and "latents_mean has shape (64, 2, 2)" in err and "(64, 4, 4)" in err, err
    assert not (tmp_path / "out").exists()


def test_extraction_at_another_size_than_the_decoder_draws_is_refused(images, raes, tmp_path, capsys):
    code, _, err = run_main(extract_main, ["--data-path", images, "--out", tmp_path / "out", "--vae", raes["stats"],
                                           "--image-size", 64], capsys)
    err = _one_paragraph(err)
    assert code == 2 and "32x32 images only" in err and "--image-size 32" in err, err
    assert not (tmp_path / "out").exists()


def test_rae_tokens_never_decode_with_a_vae(runs, tmp_path, capsys):
    vae = vavae_like(tmp_path / "vae")
    code, _, err = run_main(sample_main, ["--ckpt", runs["stats"], "--vae", vae, "--allow-other-vae", "--num-samples",
                                          2, "--num-sampling-steps", 2, "--out", tmp_path / "o", "--cpu"], capsys)
    err = _one_paragraph(err)
    assert code == 2 and "these latents are RAE tokens" in err and "--allow-other-vae does not apply" in err, err
    assert not (tmp_path / "o").exists()


def test_vae_latents_never_decode_with_an_rae(raes, tmp_path, capsys):
    latents = make_latents(tmp_path / "lat", shape=SHAPE, n=8, image_size=IMAGE_SIZE)  # the RAE's very shape
    index = json.loads((latents / "index.json").read_text())
    index["vae"]["class"] = "AutoencoderKL"  # a VAE's latents, as extract records them
    (latents / "index.json").write_text(json.dumps(index))
    code, _, err = run_main(train_main, ["--model", "DiTDH-T", "--latents", latents, "--results-dir", tmp_path / "run",
                                         "--global-batch-size", 4, "--num-workers", 0, "--max-steps", 1])
    assert code == 0, err
    code, _, err = run_main(sample_main, ["--ckpt", tmp_path / "run", "--vae", raes["stats"], "--allow-other-vae",
                                          "--num-samples", 2, "--num-sampling-steps", 2, "--out", tmp_path / "o",
                                          "--cpu"], capsys)
    err = _one_paragraph(err)
    assert code == 2 and "these latents are a VAE's latents" in err and "AutoencoderRAE" in err, err
    assert not (tmp_path / "o").exists()


def test_element_norm_of_a_folder_without_element_statistics_is_refused(tmp_path, capsys):
    latents = make_latents(tmp_path / "lat", n=8)
    code, _, err = run_main(train_main, ["--model", "DiT-T/1", "--latents", latents, "--results-dir", tmp_path / "run",
                                         "--latent-norm", "element", "--dry-run"], capsys)
    err = _one_paragraph(err)
    assert code == 2 and "per-element statistics" in err and "--latent-norm auto or channel" in err, err
    assert not (tmp_path / "run").exists()
