"""A tokenizer class and a shard column from outside the package, through the real extract, train and sample CLIs.

The module below is written into a temporary folder on PYTHONPATH: it is all a researcher writes, no file of the
package is edited. It registers (a) `PatchAE`, a strided-conv autoencoder loaded as a diffusers folder, and the
name `--vae patch-ae`, converted once from a released file of other key names ($PATCH_AE_WEIGHTS), and (b) the
column "rgb", each image's mean colour (F, 3), stored by `python -m extract --plugin tiny_plugin
--rgb-store` and trained on by `python -m train --rgb-weight W`: a linear head on block `--rgb-depth`'s pooled
tokens predicts it (an auxiliary MSE loss added to the objective's).
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.conftest import ROOT

PLUGIN = "tiny_plugin"
SOURCE = textwrap.dedent('''
    """A test plugin: a tokenizer class (PatchAE, converted by name) and a shard column ("rgb") with a consumer."""
    import os
    from dataclasses import dataclass, replace

    import torch
    import torch.nn as nn
    from diffusers import ConfigMixin, ModelMixin
    from diffusers.configuration_utils import register_to_config

    from shared.datasets.columns import ShardColumn, register_column
    from shared.runtime.cli import option
    from shared.runtime.errors import UserError
    from shared.tokenizers.tokenizer import LatentNorm, TokenizerClass, register_tokenizer
    from shared.tokenizers.locate import converted_folder, register_converted


    class PatchAE(ModelMixin, ConfigMixin):
        """Images (N, 3, H, W) in [-1, 1] <-> latents (N, C, H/p, W/p) by one strided conv each way."""

        @register_to_config
        def __init__(self, latent_channels: int = 4, patch: int = 4, scaling_factor: float = 0.5):
            super().__init__()
            self.encoder = nn.Conv2d(3, latent_channels, patch, stride=patch)
            self.decoder = nn.ConvTranspose2d(latent_channels, 3, patch, stride=patch)


    register_tokenizer(TokenizerClass(
        "PatchAE", "a strided-conv autoencoder (a test plugin)",
        encode=lambda module, x: (module.encoder(x).float(), None),
        decode=lambda module, z: module.decoder(z),
        native_norm=lambda config, module: LatentNorm.scale_only(config["scaling_factor"], source="PatchAE"),
        deterministic=True, decoder_parts=("decoder",), model_class=PatchAE))


    def convert():
        """The release's {"enc.*", "dec.*"} tensors under PatchAE's names, loaded strictly."""
        released = torch.load(os.environ["PATCH_AE_WEIGHTS"], weights_only=True)
        model = PatchAE()
        model.load_state_dict({k.replace("enc.", "encoder.").replace("dec.", "decoder."): v
                               for k, v in released.items()}, strict=True)
        return model


    register_converted(("patch-ae",), lambda name: (name, converted_folder(name, os.environ["PATCH_AE_WEIGHTS"],
                                                                          convert)))


    @dataclass(kw_only=True)
    class RgbFlags:
        """python -m extract's flag of the column."""

        rgb_store: bool = option(False, "also store each image's mean colour (the rgb column)")


    @dataclass(kw_only=True)
    class RgbTrainFlags:
        """python -m train's flags of the column."""

        rgb_weight: float = option(0.0, "weight of the mean-colour loss (0: off)")
        rgb_depth: int = option(1, "the block whose pooled tokens predict the mean colour")


    class ColourHead(nn.Module):
        """Block tokens (N, T, D) -> mean colour (N, 3)."""

        def __init__(self, width: int):
            super().__init__()
            self.linear = nn.Linear(width, 3)

        def forward(self, h):
            return self.linear(h.mean(dim=1))


    def resolve(flags, record, shape, model, root):
        if flags.rgb_depth < 1:
            raise UserError(f"--rgb-depth must be at least 1, got {flags.rgb_depth}.")
        return replace(flags)


    register_column(ShardColumn(
        name="rgb", meta_key="rgb_record", what="mean colours", how="--plugin tiny_plugin --rgb-store",
        extract_flags=RgbFlags, plan=lambda flags, size: {"dtype": "fp32", "range": [0, 1]} if flags.rgb_store else None,
        load=lambda flags, record, device: lambda pixels: pixels.float().mean(dim=(2, 3)) / 255,  # (B, 3)
        storage=lambda record, frames: (frames * 3 * 4, "mean colour {size} per image"),
        train_flags=RgbTrainFlags, weight="rgb_weight", depth="rgb_depth", resolve=resolve,
        build_head=lambda flags, width: ColourHead(width),
        loss=lambda predicted, colour: ((predicted.float() - colour) ** 2).mean(dim=1)))
''')


def _run(args, plugin_dir, expect=0) -> subprocess.CompletedProcess:
    """`python -m ARGS` from the repository root with the plugin's folder on PYTHONPATH, as a user types it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(plugin_dir)]), "OMP_NUM_THREADS": "1",
           "PATCH_AE_WEIGHTS": str(plugin_dir / "patch-ae.pt"), "XDG_CACHE_HOME": str(plugin_dir / "cache")}
    done = subprocess.run([sys.executable, "-m", *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == expect, done.stderr[-3000:]
    return done


def _refused(capsys, main, args) -> str:
    """One paragraph and exit status 2 from a CLI's main run in this process (which never imports the plugin)."""
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and PLUGIN not in sys.modules
    return " ".join(err.split())


@pytest.mark.slow
def test_a_plugin_tokenizer_and_column_extract_train_and_sample(tmp_path, image_folder, capsys):
    from extract.__main__ import main as extract_main
    from sample.__main__ import main as sample_main
    from train.__main__ import main as train_main

    plugin_dir = tmp_path / "plugins"
    plugin_dir.mkdir()
    (plugin_dir / f"{PLUGIN}.py").write_text(SOURCE)
    generator = torch.Generator().manual_seed(0)  # the "released" weights, under names of another layout
    torch.save({name: torch.randn(shape, generator=generator) / 8 for name, shape in (
        ("enc.weight", (4, 3, 4, 4)), ("enc.bias", (4,)), ("dec.weight", (4, 3, 4, 4)), ("dec.bias", (3,)))},
        plugin_dir / "patch-ae.pt")

    latents = tmp_path / "latents"
    extract = ["extract", "--data-path", image_folder, "--out", latents, "--vae", "patch-ae", "--image-size", 32,
               "--shard-size", 8, "--batch-size", 5, "--num-workers", 0]
    refused = _refused(capsys, extract_main, extract[1:])  # PatchAE is unknown without the module
    assert "Unknown VAE 'patch-ae'" in refused and "--plugin MODULE" in refused and not latents.exists()
    dry = _run([*extract, "--plugin", PLUGIN, "--rgb-store", "--dry-run"], plugin_dir).stdout
    assert "tokenizer: PatchAE (deterministic): latent 4x8x8" in dry and "storage: mean colour 24 B per image" in dry
    _run([*extract, "--plugin", PLUGIN, "--rgb-store"], plugin_dir)
    converted = next((plugin_dir / "cache" / "dit-latent-pipeline" / "tokenizers").glob("patch-ae-*"))
    assert json.loads((converted / "config.json").read_text())["_class_name"] == "PatchAE"  # converted once

    from shared.datasets.images import ImageFileDataset
    from shared.datasets.imagefolder import scan_image_folder
    from shared.datasets.shards import LatentDataset

    ds = LatentDataset(latents, progress=False)
    assert ds.meta["plugins"] == [PLUGIN] and ds.meta["rgb_record"] == {"dtype": "fp32", "range": [0, 1]}
    assert ds.vae["source"] == "patch-ae" and ds.vae["class"] == "PatchAE"  # the folder's LatentSpace records it
    assert ds.tensor_names == ("mean", "rgb") and ds.tensor_spec("rgb")["shape"] == [2, 3]
    pixels = ImageFileDataset(scan_image_folder(image_folder), 32)[0]["pixels"].float()  # (3, 32, 32) uint8 values
    stored = ds.gather([0])["rgb"][0]  # (F, 3): the original's colour, then its mirror's (the same mean)
    torch.testing.assert_close(stored, (pixels.mean(dim=(1, 2)) / 255).expand(2, 3))

    run = tmp_path / "run"
    train = ["train", "--model", "DiT-T/2", "--latents", latents, "--results-dir", run, "--global-batch-size", 4,
             "--num-workers", 0, "--sample-every", 2, "--sample-steps", 2, "--log-every", 1, "--objective", "flow", "--max-steps", 2,
             "--ckpt-every", 2, "--report-to", "none"]
    refused = _refused(capsys, train_main, [*train[1:], "--rgb-weight", "0.5"])
    assert "--rgb-weight" in refused and not run.exists()  # the column's flag exists only with its module
    refused = _refused(capsys, train_main, train[1:])
    assert f"pass --plugin {PLUGIN} to python -m train" in refused and not (run / "checkpoints").exists()
    _run([*train, "--plugin", PLUGIN, "--rgb-weight", "0.5", "--rgb-depth", "2"], plugin_dir)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(abs(r["loss"] - r["diffusion_loss"] - 0.5 * r["rgb_loss"]) < 1e-4 for r in rows)
    head = run / "checkpoints" / "step-0000002" / "rgb-head.safetensors"
    from safetensors.torch import load_file

    assert load_file(head)["linear.weight"].shape == (3, 192)  # DiT-T's width
    assert json.loads((run / "config.json").read_text())["column_options"]["rgb_weight"] == 0.5

    out = tmp_path / "samples"
    sample = ["sample", "--ckpt", run, "--num-samples", "2", "--num-sampling-steps", "2", "--cfg-scale", "1",
              "--cpu", "--out", out]
    refused = _refused(capsys, sample_main, [*sample[1:], "--vae", converted])  # its class needs the module too
    assert "is a diffusers PatchAE" in refused and "--plugin MODULE" in refused and not out.exists()
    _run([*sample, "--plugin", PLUGIN], plugin_dir)
    assert len(list(out.glob("0*.png"))) == 2
    preview = run / "samples" / "step-0000002.safetensors"  # latents only: decoded later by the tokenizer
    _run(["sample", "decode", preview, "--cpu", "--plugin", PLUGIN], plugin_dir)
    assert len(list(preview.with_suffix("").glob("0*.png"))) == len(load_file(preview)["latents"]) > 0
