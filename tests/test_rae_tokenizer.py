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
from shared.datasets.shards import ElementStats
from shared.tokenizers.tokenizer import LatentNorm
from shared.tokenizers.locate import load_tokenizer
from shared.tokenizers.space import LatentSpace
from shared.tokenizers.tokenizer import measure_latent
from shared.tokenizers.locate import read_vae_config
from tests.conftest import make_image_folder
from tests.helpers import copy_without_stats, make_latents, run_main
from tests.tiny_tokenizers import RAE_TINY, rae, vavae_like
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
    space = LatentSpace({"source": "t"}, SHAPE, IMAGE_SIZE, (), {"dit": norm})
    back = LatentSpace.from_parts(space.text(), space.tensors(), "f", "").norm  # JSON + fp32 tensors
    assert back == norm and back.shape == SHAPE and torch.equal(back.apply(z), x)  # float32 bits
    with pytest.raises(ValueError, match="64x4x4 cannot apply to these latents of shape 64x2x8"):
        norm.apply(torch.zeros(1, 64, 2, 8))


def test_element_stats_merge_equals_direct_float64():
    g = torch.Generator().manual_seed(1)
    parts = [torch.randn(n, 2, 3, 4, 4, generator=g) * 2 + 1 for n in (5, 1, 7)]
    stats = ElementStats()
    for part in parts:
        half = ElementStats()
        half.add(part)
        stats.merge(ElementStats.from_bytes(half.to_bytes()))  # through a shard's stats file
    every = torch.cat(parts).double().reshape(-1, 3, 4, 4)  # (images x flips, C, h, w)
    mean, std = stats.result()
    torch.testing.assert_close(mean, every.mean(dim=0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(std, (every.var(dim=0, unbiased=False) + 1e-5).sqrt(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["stats", "nostats"])
def test_tokens_and_decode_equal_autoencoder_rae(raes, name):
    """Our raw tokens + our norm record reproduce AutoencoderRAE.encode, and our decode its decode(encode(x))."""
    vae = load_tokenizer(raes[name])
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
        assert vae.norm is None and "native" not in LatentSpace.of_tokenizer(vae, IMAGE_SIZE, SHAPE, ()).norms
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
        vae = load_tokenizer(raes[name])
        every = batch.double().reshape(-1, *SHAPE)
        norm = ds.space.norms["element"]
        torch.testing.assert_close(norm.mean, every.mean(dim=0).float(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(norm.std, (every.var(dim=0, unbiased=False) + 1e-5).sqrt().float(), rtol=1e-6,
                                   atol=1e-6)
        assert ds.space.tokenizer["class"] == "AutoencoderRAE" and ds.space.tokenizer["family"] == "rae"
        assert ds.space.native == vae.norm and "vae" not in index and "latent_stats" not in index
        assert len((folder / "index.json").read_bytes()) < 64 * 1024  # the statistics live in latent_space.*


def test_a_resumed_extraction_writes_the_same_per_element_sums_and_space(images, raes, tmp_path, capsys):
    """Each shard's per-element float64 sums sit in its own stats file; a shard encoded again rewrites it bit for bit."""
    first = tmp_path / "first"
    assert _extract(images, raes["nostats"], first, "--shard-size", 2, capsys=capsys)[0] == 0
    again = shutil.copytree(first, tmp_path / "again")
    for name in ("index.json", "latent_space.json", "shard-000001.done.json"):  # as a run killed after shard 0
        (again / name).unlink()
    assert _extract(images, raes["nostats"], again, "--shard-size", 2, capsys=capsys)[0] == 0
    for name in ("shard-000001.stats.safetensors", "latent_space.json", "latent_space.safetensors"):
        assert (again / name).read_bytes() == (first / name).read_bytes(), name
    assert LatentDataset(again, progress=False).space == LatentDataset(first, progress=False).space
    assert json.loads((first / "shard-000000.done.json").read_text())["element_stats"] == \
        "shard-000000.stats.safetensors"  # the sums are not inline


def test_a_damaged_stats_file_encodes_its_shard_again(images, raes, tmp_path, capsys):
    """A cut-short per-element sums file of a finished shard: the rerun encodes that shard again, exit 0."""
    first = tmp_path / "first"
    assert _extract(images, raes["nostats"], first, "--shard-size", 2, capsys=capsys)[0] == 0
    again = shutil.copytree(first, tmp_path / "again")
    for name in ("index.json", "latent_space.json"):  # as a run killed before its index
        (again / name).unlink()
    stats = again / "shard-000000.stats.safetensors"
    stats.write_bytes(stats.read_bytes()[:100])
    code, out, err = _extract(images, raes["nostats"], again, "--shard-size", 2, capsys=capsys)
    assert code == 0, err
    assert stats.read_bytes() == (first / stats.name).read_bytes()
    assert LatentDataset(again, progress=False).space == LatentDataset(first, progress=False).space


def test_dry_run_prints_the_token_storage(images, raes, tmp_path, capsys):
    code, out, err = _extract(images, raes["stats"], tmp_path / "out", "--dtype", "bf16", "--flip", "none",
                              "--dry-run", capsys=capsys)
    assert code == 0, err
    assert "AutoencoderRAE (deterministic): latent 64x4x4 at 32 px" in out, out
    # 64 x 4 x 4 values x 2 bytes, one frame, the tokens alone
    assert "moments 2 KiB per image (1 flip(s) x latent (deterministic tokenizer, no std) 64x4x4 bf16) = 2,048 bytes" \
        in out, out
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
    space = LatentSpace.read_file(sorted((run / "exports").glob("*.safetensors"))[-1])
    record = space.norm
    ds = LatentDataset(extracted[name], progress=False)
    if name == "stats":
        assert record == load_tokenizer(raes[name]).norm  # the config's numbers, diffusers' convention
    else:
        assert record == ds.space.norms["element"]  # the folder's
    # sample decodes through the RAE decoder, with no flags: the record and the tokenizer travel with the run
    code, _, err = run_main(sample_main, ["--ckpt", run, "--num-samples", 2, "--num-sampling-steps", 2, "--out",
                                          tmp_path / "samples", "--cpu"])
    assert code == 0, err
    pngs = sorted((tmp_path / "samples").glob("0*.png"))
    assert len(pngs) == 2 and Image.open(pngs[0]).size == (IMAGE_SIZE, IMAGE_SIZE)
    # what sampling decodes: a stored token grid normalised as training did comes back as the RAE's own decode
    vae = load_tokenizer(raes[name])
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
    latents = make_latents(tmp_path / "lat", shape=SHAPE, n=8, image_size=IMAGE_SIZE,  # the RAE's very shape
                           vae={"class": "AutoencoderKL"})  # a VAE's latents, as extract records them
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


# ---------------------------------------------------------------------------------------------------------
# RAE's released tokenizer by name, served from 127.0.0.1 through the release cache (no network in tests)
# ---------------------------------------------------------------------------------------------------------

def _rae_files(tmp_path, extra_decoder_tensor=False):
    """A tiny RAE's three files in RAE's own layouts -> (name -> bytes, the module, stat mean, stat var)."""
    import io

    from diffusers import AutoencoderRAE
    from safetensors.torch import save as save_safetensors

    from shared.tokenizers.rae import RAE_TOKENIZERS, rae_decoder_key

    module = AutoencoderRAE.from_pretrained(rae(tmp_path / "src", stats=False))
    state = module.state_dict()
    decoder = {rae_decoder_key(k): v for k, v in state.items() if k.startswith("decoder.")}
    decoder["decoder_pos_embed"] = module.decoder.decoder_pos_embed.clone()  # RAE keeps its sin-cos table
    if extra_decoder_tensor:
        decoder["decoder_layers.0.extra.weight"] = torch.zeros(3)
    encoder = {k.removeprefix("encoder."): v.contiguous() for k, v in state.items() if k.startswith("encoder.")}
    encoder.update({"layernorm.weight": torch.ones(64), "layernorm.bias": torch.zeros(64)})  # RAE drops these
    g = torch.Generator().manual_seed(7)
    stats = {"mean": torch.randn(1, *SHAPE, generator=g), "var": torch.rand(1, *SHAPE, generator=g) + 0.3}
    release = RAE_TOKENIZERS["rae-dinov2-b"]
    files = {}
    for (name, _), obj in ((release.decoder, decoder), (release.stats, stats)):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        files[name] = buffer.getvalue()
    files[release.encoder[0]] = save_safetensors(encoder)
    return files, module, stats


@pytest.fixture
def tiny_release(monkeypatch, tmp_path):
    """The rae-dinov2-b record with the tiny RAE's geometry (its names and URLs unchanged)."""
    import dataclasses

    from shared.tokenizers.rae import RAE_TOKENIZERS

    monkeypatch.setitem(RAE_TOKENIZERS, "rae-dinov2-b", dataclasses.replace(
        RAE_TOKENIZERS["rae-dinov2-b"], config={**RAE_TINY, "image_size": IMAGE_SIZE, "scaling_factor": 1.0}))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def test_the_released_tokenizer_by_name_converts_rae_files_strictly(tiny_release, images, tmp_path, monkeypatch,
                                                                    capsys):
    from shared.tokenizers.rae import _rae_tokens
    from tests.helpers import serve_releases

    files, module, stats = _rae_files(tmp_path)
    with serve_releases(files, tmp_path, monkeypatch):
        vae = load_tokenizer("rae-dinov2-b")
        assert vae.identity["source"] == "rae-dinov2-b" and all((tmp_path / "cache" / n).is_file() for n in files)
        x = torch.rand(2, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(3)) * 2 - 1
        tokens, _ = vae.encode_moments(x)
        assert torch.equal(tokens, _rae_tokens(module.eval(), x))  # the DINOv2 weights where RAE's encoder has them
        # RAE's normalisation (z - mean) / sqrt(var + 1e-5), to float32 rounding
        torch.testing.assert_close(torch.as_tensor(vae.norm.std).view(SHAPE), (stats["var"][0] + 1e-5).sqrt(),
                                   rtol=2e-7, atol=0)
        assert torch.equal(torch.as_tensor(vae.norm.mean, dtype=torch.float32).view(SHAPE), stats["mean"][0])
        torch.testing.assert_close(vae.decode_raw(tokens), module.decode(tokens / (1 + 1e-5)).sample.clamp(0, 1) * 2 - 1,
                                   rtol=0, atol=2e-6)
        # by name on the command line; the converted folder is reused
        code, out, err = _extract(images, "rae-dinov2-b", tmp_path / "out", "--dry-run", capsys=capsys)
        assert code == 0 and "AutoencoderRAE (deterministic): latent 64x4x4" in out, err
    assert len(list((tmp_path / "xdg" / "dit-latent-pipeline" / "tokenizers").iterdir())) == 1


def test_a_released_decoder_with_tensors_not_rae_s_is_refused(tiny_release, images, tmp_path, monkeypatch, capsys):
    from tests.helpers import serve_releases

    files, _, _ = _rae_files(tmp_path, extra_decoder_tensor=True)
    with serve_releases(files, tmp_path, monkeypatch):
        code, _, err = _extract(images, "rae-dinov2-b", tmp_path / "out", capsys=capsys)
    err = _one_paragraph(err)
    assert code == 2 and "1 tensors are not the RAE's (e.g. decoder.decoder_layers.0.extra.weight)" in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "xdg" / "dit-latent-pipeline").exists()


def test_the_real_release_record_makes_rae_s_tokens_and_names_its_dit():
    """rae-dinov2-b's config (meta device): 768x16x16 tokens of 256 px images, as RAE's DiT^DH-XL reads them."""
    from shared.tokenizers.rae import RAE_DIT_LATENTS, RAE_TOKENIZERS

    config = {"_class_name": "AutoencoderRAE", **RAE_TOKENIZERS["rae-dinov2-b"].config}
    assert measure_latent(config, 256) == (768, 16, 16) == tuple(RAE_DIT_LATENTS["latent_shape"])
    with pytest.raises(Exception, match="256x256 images only"):
        measure_latent(config, 224)


def test_a_dit_dh_on_768x16x16_tokens_is_decoded_by_the_released_tokenizer(tmp_path, monkeypatch):
    from shared.weights.checkpoint import load_sampling_weights
    from shared.network.models import ModelConfig
    from shared.tokenizers.rae import RAE_DIT_LATENTS

    monkeypatch.chdir(tmp_path)
    config = ModelConfig("DiTDH-T", input_size=16, in_channels=768, num_classes=10, learn_sigma=False,
                         objective="flow")
    torch.save({"ema": config.build().state_dict()}, tmp_path / "stage2_model.pt")
    loaded = load_sampling_weights(tmp_path / "stage2_model.pt")
    assert loaded.space == LatentSpace.of_release(RAE_DIT_LATENTS) and any("rae-dinov2-b" in n for n in loaded.notes)
    assert loaded.space.source == "rae-dinov2-b" and loaded.space.latent_shape == (768, 16, 16)


def test_stats_command_recomputes_the_per_element_statistics(extracted, tmp_path, capsys):
    folder = tmp_path / "copy"
    written = copy_without_stats(extracted["nostats"], folder)
    code, out, err = run_main(extract_main, ["--stats", "--out", folder], capsys)
    assert code == 0 and "per-channel and per element" in out, err
    again = LatentDataset(folder, progress=False).space
    assert again.norms["element"] == written["element"] and again == LatentDataset(extracted["nostats"]).space


def test_train_dry_run_prints_the_space_by_its_hash(extracted, tmp_path, capsys):
    code, out, err = run_main(train_main, ["--model", "DiTDH-T", "--latents", extracted["nostats"], "--results-dir",
                                           tmp_path / "run", "--dry-run"], capsys)
    assert code == 0, err
    space = LatentDataset(extracted["nostats"], progress=False).space.for_run(
        LatentDataset(extracted["nostats"], progress=False).space.norms["element"])
    assert f'"latent_space": "{space.sha256}"' in out and '"latent_norm": "element ((z - mean)' in out, out
    assert len(out) < 64 * 1024  # the statistics (1,024 numbers each) are not printed
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_an_rae_by_hub_id_from_the_local_cache(raes, monkeypatch, tmp_path):
    import huggingface_hub.constants as constants

    repo = tmp_path / "hf-cache" / "models--someone--tiny-rae"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    shutil.copytree(raes["stats"], repo / "snapshots" / ("0" * 40))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    vae = load_tokenizer("someone/tiny-rae")
    assert vae.identity["source"] == "someone/tiny-rae" and vae.norm == load_tokenizer(raes["stats"]).norm
