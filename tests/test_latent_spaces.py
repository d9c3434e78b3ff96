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
from shared.datasets.shards import ChannelStats
from shared.tokenizers.tokenizer import LatentNorm
from shared.tokenizers.locate import load_tokenizer
from shared.tokenizers.space import LatentSpace
from shared.tokenizers.tokenizer import measure_latent
from shared.tokenizers.locate import read_vae_config
from tests.conftest import make_image_folder
from tests.helpers import copy_without_stats, make_latents, run_main
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
    mean, std = norm.mean.view(1, -1, 1, 1), norm.std.view(1, -1, 1, 1)
    torch.testing.assert_close(x, (z - mean) / std * norm.scale)
    space = LatentSpace({"source": "t"}, (3, 4, 4), 16, ("a",), {"dit": norm})
    back = LatentSpace.from_parts(json.loads(json.dumps(space.text())), dict(space.tensors()), "f", "")
    assert back.norm == norm and back == space


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
    vae = load_tokenizer(tokenizers[name])
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
    stats, provenance = ds.space.norms["channel"], ds.space.statistics
    batch = ds.gather(np.arange(len(ds)))  # every column, (N, F, C, h, w)
    assert ("std" in batch) != ds.deterministic  # DC-AE's folder stores the latent alone
    means = batch["mean"].double().transpose(0, 2).reshape(ds.latent_shape[0], -1)  # (C, images*flips*h*w)
    var = means.var(dim=1, unbiased=False)
    if not ds.vae["deterministic"]:
        var = var + (batch["std"].double().transpose(0, 2).reshape(ds.latent_shape[0], -1) ** 2).mean(dim=1)
    # float64 sums, stored as fp32 (what training applies): equal to the direct result rounded to fp32
    torch.testing.assert_close(stats.mean, means.mean(dim=1).float(), rtol=1.2e-7, atol=1e-12)
    torch.testing.assert_close(stats.std, var.sqrt().float(), rtol=1.2e-7, atol=0)
    assert provenance["images"] == len(ds) and provenance["flips"] == 2


def test_stats_command_adds_the_same_statistics_without_encoding(extracted, tmp_path, capsys):
    folder = tmp_path / "copy"
    written = copy_without_stats(extracted["flux-like"], folder)
    code, out, err = run_main(extract_main, ["--stats", "--out", folder], capsys)
    assert code == 0, err
    assert "added" in out
    again = LatentDataset(folder, progress=False).space
    assert again.norms["channel"] == written["channel"]  # bit for bit
    assert again == LatentDataset(extracted["flux-like"], progress=False).space


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
    space = LatentSpace.read_file(export)
    record = space.norm
    ds = LatentDataset(extracted[name], progress=False)
    assert record == (ds.native_norm if norm == "auto" else ds.space.norms["channel"])
    # The round trip: a stored latent, normalised as training does and decoded as sampling does, equals the
    # tokenizer's own decode of the raw latent (fp32 tolerance).
    vae = load_tokenizer(tokenizers[name])
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
    assert code == 2 and "width 192" in err and "256 values per token" in err, err
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


# ---------------------------------------------------------------------------------------------------------
# Released tokenizers and DiTs by name, through the local caches (no network in tests)
# ---------------------------------------------------------------------------------------------------------

def _hub_cache(monkeypatch, tmp_path, repo_id: str, files: dict) -> None:
    """Put `files` {name: writer(path)} into a private Hugging Face cache as repo_id's snapshot; go offline."""
    import huggingface_hub.constants as constants

    cache = tmp_path / "hf-cache"
    revision = "0" * 40
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, write in files.items():
        write(snapshot / name)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def test_dc_ae_release_by_name_from_the_hub_cache(monkeypatch, tmp_path, tokenizers):
    folder = tokenizers["dc-ae"]
    _hub_cache(monkeypatch, tmp_path, "mit-han-lab/dc-ae-f32c32-in-1.0-diffusers",
               {name: (lambda dst, src=folder / name: shutil.copy(src, dst)) for name in
                ("config.json", "diffusion_pytorch_model.safetensors")})
    vae = load_tokenizer("dc-ae-f32c32")
    assert vae.identity["source"] == "mit-han-lab/dc-ae-f32c32-in-1.0-diffusers"
    assert vae.deterministic and vae.norm == LatentNorm.scale_only(0.3189)


def test_vavae_by_name_converts_the_ldm_checkpoint_with_its_statistics(monkeypatch, tmp_path):
    from tests.tiny_tokenizers import vavae_ldm_state_dict

    checkpoint, reference = vavae_ldm_state_dict(seed=3)
    g = torch.Generator().manual_seed(4)
    stats = {"mean": torch.randn(1, 32, 1, 1, generator=g), "std": torch.rand(1, 32, 1, 1, generator=g) + 0.5}
    _hub_cache(monkeypatch, tmp_path, "hustvl/vavae-imagenet256-f16d32-dinov2",
               {"vavae-imagenet256-f16d32-dinov2.pt": lambda p: torch.save(checkpoint, p),
                "latents_stats.pt": lambda p: torch.save(stats, p)})
    vae = load_tokenizer("vavae")
    assert vae.identity["source"] == "hustvl/vavae-imagenet256-f16d32-dinov2"
    assert (vae.latent_channels, vae.downsample_factor) == (32, 16)
    # LightningDiT's normalisation: (z - mean_c) / std_c, latent_multiplier 1
    assert vae.norm == LatentNorm.channel(stats["mean"].flatten().tolist(), stats["std"].flatten().tolist(), 1.0)
    for ours, theirs in zip(vae.vae.state_dict().values(), reference.state_dict().values()):
        assert torch.equal(ours, theirs)  # every tensor where the conversion puts it
    converted = list((tmp_path / "xdg" / "dit-latent-pipeline" / "tokenizers").iterdir())
    assert len(converted) == 1 and (converted[0] / "config.json").is_file()  # converted once, reused


def test_lightningdit_release_by_name_loads_into_the_lightning_block(monkeypatch, tmp_path):
    from shared.weights.checkpoint import build_sampling_model, load_sampling_weights
    from shared.network.models import BLOCKS, ModelConfig

    monkeypatch.setenv("DIT_CHECKPOINT_DIR", str(tmp_path / "ckpts"))
    (tmp_path / "ckpts").mkdir()
    # A random model of LightningDiT's layout (its tensor names are the lightning block's; the parity check in
    # tests/bench/check_lightningdit_parity.py compares with its own code), saved as its train.py does.
    torch.manual_seed(0)
    model = ModelConfig("DiT-T/1", input_size=16, in_channels=32, learn_sigma=False, **BLOCKS["lightning"]).build()
    state = {f"module.{k}": v for k, v in model.state_dict().items()}
    torch.save({"model": state, "ema": state}, tmp_path / "ckpts" / "lightningdit-xl-imagenet256-64ep.pt")
    loaded = load_sampling_weights("lightningdit-xl-imagenet256-64ep.pt")
    assert loaded.config.block == "lightning" and loaded.config.objective == "flow"
    assert loaded.config.objective_args["convention"] == "sit" and not loaded.config.learn_sigma
    assert loaded.space.source == "vavae" and loaded.space.latent_shape == (32, 16, 16)
    assert any("--cfg-scale 10" in note for note in loaded.notes)
    # LightningDiT's own sampling (its 64ep config: euler, shift 0.3, guided where its time >= 0.10) is recorded, so
    # sample and evaluate run use it with no flags; auto guidance is its forward_with_cfg's first 3 channels.
    assert loaded.config.sampling == {"sampler": "euler", "time_shift": 0.3, "cfg_interval": [0.0, 0.9]}
    from shared.generative.guidance import describe_guidance, guide_channel_count
    assert guide_channel_count("auto", 32, loaded.auto_guide) == 3  # LightningDiT guides 3 of 32
    assert "first 3 of 32" in describe_guidance("auto", 32, 10.0, auto=loaded.auto_guide)
    assert guide_channel_count("auto", 32) is None  # our own 32-channel runs guide all
    built = build_sampling_model(loaded, "cpu")
    x, t, y = torch.randn(2, 32, 16, 16), torch.rand(2), torch.tensor([3, 1000])
    with torch.no_grad():
        torch.testing.assert_close(built(x, t, y), model.eval()(x, t, y), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------
# Patch-1 presets: planner, MACs, RoPE grid
# ---------------------------------------------------------------------------------------------------------

def test_patch_one_presets_follow_lightningdit_xl1():
    from shared.network.models import PRESETS, BLOCKS, ModelConfig, infer_model_config
    from train.memory import forward_macs

    assert PRESETS["DiT-XL/1"] == dict(depth=28, hidden_size=1152, patch_size=1, num_heads=16)  # LightningDiT-XL/1
    config = ModelConfig("DiT-XL/1", input_size=16, in_channels=32, learn_sigma=False, **BLOCKS["lightning"])
    with torch.device("meta"):
        model = config.build()
    assert model.x_embedder.num_patches == 256 and tuple(model.feat_rope.freqs_cos.shape) == (256, 72)
    assert infer_model_config(model.state_dict()).model == "DiT-XL/1"
    macs = forward_macs(model)
    # 256 tokens as XL/2 at 32x32x4: the same transformer cost; only the patch embedding and output differ
    assert 110e9 < macs["total"] < 125e9
