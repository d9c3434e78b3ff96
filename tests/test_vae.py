"""shared/tokenizers/tokenizer.py: locating specs, fp32 moments equal diffusers', decode with the config's scale, draws."""
import json
import shutil
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, make_tiny_vae
from shared.runtime.errors import SettingError, UserError, advise
from shared.tokenizers.tokenizer import LatentNorm
from shared.tokenizers.locate import load_tokenizer
from shared.datasets.shards import draw_latents
from shared.tokenizers.tokenizer import downsample_factor
from shared.tokenizers.locate import read_vae_config, resolve_vae_spec


def _images(n=2, size=16, seed=0):
    """Random images (n,3,size,size) in [-1,1]."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, size, size, generator=g) * 2 - 1


def _diffusers_vae(folder):
    """The same folder loaded straight through diffusers (the reference)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL.from_pretrained(folder).eval()


def test_import_does_not_pull_diffusers():
    code = "import sys, shared.tokenizers.tokenizer; assert 'diffusers' not in sys.modules, 'diffusers imported'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_round_trip_shapes_and_identity(tmp_path):
    folder = make_tiny_vae(tmp_path / "vae", latent_channels=4, levels=3)
    vae = load_tokenizer(folder)
    mean, std = vae.encode_moments(_images(size=16))
    assert mean.shape == std.shape == (2, 4, 4, 4) and mean.dtype == torch.float32
    images = vae.decode(draw_latents(mean, std, vae.norm))
    assert images.shape == (2, 3, 16, 16) and images.dtype == torch.float32
    assert images.min() >= -1 and images.max() <= 1
    config = json.loads((folder / "config.json").read_text())
    assert vae.identity == {
        "source": str(folder.resolve()),
        "class": "AutoencoderKL",
        "scaling_factor": config["scaling_factor"],
        "deterministic": False,
        "latent_channels": 4,
        "downsample_factor": 4,
        "config_sha256": vae.identity["config_sha256"],
    }
    assert len(vae.identity["config_sha256"]) == 64
    assert vae.norm == LatentNorm.scale_only(config["scaling_factor"])
    assert downsample_factor(read_vae_config(folder)) == 4 == vae.downsample_factor


def test_scaling_factor_comes_from_config(tmp_path, tiny_vae_dir):
    folder = tmp_path / "vae"
    shutil.copytree(tiny_vae_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["scaling_factor"] = 0.5
    (folder / "config.json").write_text(json.dumps(config))
    vae, ref = load_tokenizer(folder), _diffusers_vae(folder)
    assert vae.scaling_factor == 0.5
    assert vae.identity["config_sha256"] != load_tokenizer(tiny_vae_dir).identity["config_sha256"]
    latents = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        expected = ref.decode(latents / 0.5).sample.clamp(-1, 1)
    torch.testing.assert_close(vae.decode(latents), expected)


def test_moments_equal_diffusers_posterior(tiny_vae_dir):
    x = _images(n=3)
    with torch.no_grad():
        posterior = _diffusers_vae(tiny_vae_dir).encode(x).latent_dist
    mean, std = load_tokenizer(tiny_vae_dir).encode_moments(x)
    torch.testing.assert_close(mean, posterior.mean)
    torch.testing.assert_close(std, posterior.std)
    torch.testing.assert_close(std, torch.exp(0.5 * posterior.logvar.clamp(-30, 20)))


def test_encode_stays_fp32_under_autocast(tiny_vae_dir):
    vae, x = load_tokenizer(tiny_vae_dir), _images()
    plain = vae.encode_moments(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = vae.encode_moments(x)
    assert under[0].dtype == torch.float32
    torch.testing.assert_close(under[0], plain[0])
    torch.testing.assert_close(under[1], plain[1])


def test_bf16_decode_close_to_fp32(tiny_vae_dir):
    full = load_tokenizer(tiny_vae_dir)
    half = load_tokenizer(tiny_vae_dir, dtype=torch.bfloat16)
    assert half.vae.decoder.conv_in.weight.dtype == torch.bfloat16
    assert half.vae.encoder.conv_in.weight.dtype == torch.float32
    torch.testing.assert_close(half.encode_moments(_images())[0], full.encode_moments(_images())[0])
    latents = torch.randn(2, 4, 8, 8)
    a, b = full.decode(latents), half.decode(latents)
    assert b.dtype == torch.float32 and torch.isfinite(b).all()
    assert (a - b).abs().max() < 0.1


def test_tiling_and_slicing_switches(tiny_vae_dir):
    vae = load_tokenizer(tiny_vae_dir)
    x = _images(n=3)
    reference = vae.encode_moments(x)[0]
    vae.enable_slicing()
    assert vae.vae.use_slicing
    torch.testing.assert_close(vae.encode_moments(x)[0], reference, atol=1e-5, rtol=1e-5)
    vae.enable_tiling()
    assert vae.vae.use_tiling


def test_draws_have_the_stored_mean_and_std():
    mean = torch.tensor([[[[1.5, -2.0]], [[0.0, 3.0]]]])  # (1, 2, 1, 2)
    std = torch.tensor([[[[0.5, 2.0]], [[1e-3, 1.0]]]])
    scale = 0.25
    g = torch.Generator().manual_seed(0)
    draws = torch.cat([draw_latents(mean, std, LatentNorm.scale_only(scale), generator=g) for _ in range(20000)])
    torch.testing.assert_close(draws.mean(0), (mean * scale)[0], atol=0.03 * scale * 2.0, rtol=0)
    torch.testing.assert_close(draws.std(0), (std * scale)[0], atol=0.02 * scale * 2.0, rtol=0.02)


def test_draws_with_one_generator_per_row_do_not_depend_on_the_batch():
    mean, std = torch.randn(3, 4, 2, 2), torch.rand(3, 4, 2, 2)
    gens = [torch.Generator().manual_seed(10 + i) for i in range(3)]
    batch = draw_latents(mean, std, LatentNorm.scale_only(0.5), generator=gens)
    alone = draw_latents(mean[1:2], std[1:2], LatentNorm.scale_only(0.5), generator=[torch.Generator().manual_seed(11)])
    torch.testing.assert_close(batch[1:2], alone)
    same = draw_latents(mean, std, LatentNorm.scale_only(0.5), generator=torch.Generator().manual_seed(3))
    again = draw_latents(mean, std, LatentNorm.scale_only(0.5), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(same, again)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_single_file_with_config_beside_or_given(tmp_path, tiny_vae_dir, suffix):
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in _diffusers_vae(tiny_vae_dir).state_dict().items()}
    weights = tmp_path / "alone" / f"vae{suffix}"
    weights.parent.mkdir()
    if suffix == ".safetensors":
        save_file(state, weights)
    else:
        torch.save({"state_dict": state}, weights)  # the .ckpt habit of wrapping the tensors
    with pytest.raises(SettingError, match="pass vae config PATH") as caught:  # shared/ names the setting
        resolve_vae_spec(weights)
    assert "pass --vae-config PATH" in str(advise(caught.value, {"vae config": "--vae-config"}))  # a CLI, its flag
    given = load_tokenizer(weights, config=tiny_vae_dir / "config.json")
    shutil.copy(tiny_vae_dir / "config.json", weights.parent / "config.json")
    beside = load_tokenizer(weights)
    x = _images()
    reference = load_tokenizer(tiny_vae_dir).encode_moments(x)
    for vae in (given, beside):
        assert vae.identity["source"] == str(weights.resolve())
        torch.testing.assert_close(vae.encode_moments(x)[1], reference[1])


def test_single_file_that_does_not_match_its_config(tmp_path, tiny_vae_dir):
    from safetensors.torch import save_file

    other = make_tiny_vae(tmp_path / "other", latent_channels=8)
    state = {k: v.contiguous() for k, v in _diffusers_vae(other).state_dict().items()}
    save_file(state, tmp_path / "vae.safetensors")
    with pytest.raises(UserError, match="does not match its config"):
        load_tokenizer(tmp_path / "vae.safetensors", config=tiny_vae_dir / "config.json")


def test_offline_hub_id_names_the_local_options(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    for spec in ("ema", "someone/some-vae"):
        with pytest.raises(UserError) as err:
            resolve_vae_spec(spec)
        message = str(err.value)
        assert "offline" in message and "huggingface-cli download stabilityai/sd-vae-ft-ema" in message
        assert "--local-dir" in message and "config.json" in message


def test_bad_specs_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="Unknown VAE"):
        resolve_vae_spec(tmp_path / "missing-folder")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no config.json"):
        resolve_vae_spec(tmp_path / "empty")
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text("{}")
    with pytest.raises(UserError, match="no weights"):
        resolve_vae_spec(tmp_path / "noweights")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(UserError, match="not a weight file"):
        resolve_vae_spec(tmp_path / "notes.txt")


def test_pipeline_folder_uses_its_vae_subfolder(tmp_path):
    make_tiny_vae(tmp_path / "pipeline" / "vae")
    assert resolve_vae_spec(tmp_path / "pipeline") == str((tmp_path / "pipeline" / "vae").resolve())


def test_folder_whose_tensors_do_not_fit_its_config(tmp_path, tiny_vae_dir):
    """diffusers would only warn and initialise missing tensors randomly; shapes of another VAE; a truncated file."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "missing"
    shutil.copytree(tiny_vae_dir, folder)
    weights = folder / "diffusion_pytorch_model.safetensors"
    save_file({k: v for k, v in load_file(weights).items() if k != "decoder.conv_in.bias"}, weights)
    with pytest.raises(SettingError, match="1 tensors its config needs are missing .*decoder.conv_in.bias"):
        load_tokenizer(folder)
    shutil.copy(make_tiny_vae(tmp_path / "wide", latent_channels=8) / weights.name, weights)
    with pytest.raises(SettingError, match="expected shape") as caught:
        load_tokenizer(folder)
    assert "overwrite" not in str(caught.value)
    weights.write_bytes(weights.read_bytes()[:500])
    with pytest.raises(SettingError, match="cannot be read .*truncated"):
        load_tokenizer(folder)


def test_malicious_ckpt_vae_is_refused(tmp_path, tiny_vae_dir):
    """A single-file .ckpt is read by the weights-only loader; its blocked global is named."""
    import os

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo PWNED",))

    torch.save({"state_dict": Evil()}, tmp_path / "vae.ckpt")
    shutil.copy(tiny_vae_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(SettingError, match="tried to run code.*posix.system") as caught:
        load_tokenizer(tmp_path / "vae.ckpt")
    assert "pass another --vae" in str(advise(caught.value, {"vae": "--vae"})).lower()
