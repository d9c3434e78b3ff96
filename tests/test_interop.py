"""diffusers-format DiT in and out: the exact key mapping, --ckpt on pipelines / transformer folders / files / Hub
ids (a fake offline Hub cache), `python -m sample export ... --format diffusers`, and the refusals."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from tests.helpers import run_main, space_of
from sample.__main__ import main
from shared.network.diffusers_dit import (check_dit_config, diffusers_config, diffusers_to_dit, dit_kwargs, dit_to_diffusers)
from shared.runtime.errors import UserError
from shared.weights.export import load_weights, save_weights
from shared.network.models import DiT, ModelConfig
from shared.tokenizers.locate import load_tokenizer

# One guidance rule for every form of the weights: auto differs by origin (the .pt: DiT's 3 of 4 channels; diffusers: all).
STEPS = ["--num-sampling-steps", "2", "--cpu", "--num-samples", "2", "--guide-channels", "all"]
HUB_ID = "tiny-org/tiny-dit-pipe"
SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"  # any 40-hex commit name


def perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Perturb every trainable weight (adaLN-Zero starts at zero), so outputs depend on all of them."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def tie_embedder_copies(model) -> None:
    """Make every block's timestep/class embedder copy equal block 0's (what a conversion of DiT weights holds)."""
    with torch.no_grad():
        first = model.transformer_blocks[0].norm1.emb
        for block in model.transformer_blocks[1:]:
            block.norm1.emb.load_state_dict(first.state_dict())


def tiny_diffusers_dit(num_classes=10, seed=0):
    """A non-preset random diffusers DiT: latent 4x8x8, patch 2, 2 layers, 2 heads x 16 channels."""
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(seed)
    model = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8,
                                  num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=num_classes)
    perturbed(model, seed)
    tie_embedder_copies(model)
    return model


def full_config(model) -> dict:
    """The model's config as its config.json reads, checked."""
    return check_dit_config({"_class_name": type(model).__name__, **dict(model.config)}, "test model")


def save_pipeline(folder: Path, state_dict: dict, config: ModelConfig, vae_dir: Path) -> Path:
    """A DiTPipeline folder (save_pretrained) holding `state_dict` in diffusers' layout and a copy of the VAE."""
    from diffusers import AutoencoderKL, DDIMScheduler, DiTPipeline, DiTTransformer2DModel

    transformer = DiTTransformer2DModel(**diffusers_config(config))
    transformer.load_state_dict(dit_to_diffusers(state_dict), strict=True)
    pipe = DiTPipeline(transformer=transformer, vae=AutoencoderKL.from_pretrained(vae_dir), scheduler=DDIMScheduler())
    pipe.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def made(tmp_path_factory, tiny_vae_dir):
    """Our 1000-class DiT-T/2 weights as a .pt, as a run folder export, and as a diffusers pipeline folder."""
    root = tmp_path_factory.mktemp("interop")
    config = ModelConfig("DiT-T/2", input_size=8, in_channels=4, num_classes=1000)
    state = perturbed(config.build()).state_dict()
    torch.save(state, root / "weights.pt")
    vae = load_tokenizer(tiny_vae_dir)
    meta = {"image_size": 16, "scaling_factor": vae.scaling_factor, "latent_shape": [4, 8, 8], "vae": vae.identity,
            "class_names": [f"thing{i}, alias{i}" for i in range(1000)]}
    save_weights(root / "run" / "exports" / "ema-step-0000300.safetensors", state, config, space_of(meta), 300)
    pipe = save_pipeline(root / "pipe", state, config, tiny_vae_dir)
    return {"root": root, "state": state, "config": config, "pt": root / "weights.pt", "run": root / "run",
            "pipe": pipe, "vae": tiny_vae_dir}


@pytest.fixture(scope="module")
def reference(made, tmp_path_factory) -> dict:
    """PNGs of the original .pt decoded by the pipeline's VAE: what every diffusers form of it must give."""
    out = tmp_path_factory.mktemp("reference") / "pt"
    main([str(a) for a in ["--ckpt", made["pt"], "--vae", made["pipe"] / "vae", "--out", out, *STEPS]])
    images = pngs(out)
    assert len(images) == 2
    return images


def pngs(folder: Path) -> dict:
    """Name -> bytes of every sample PNG."""
    return {p.name: p.read_bytes() for p in sorted(Path(folder).glob("0*.png"))}


# --------------------------------------------------------------------------------------------------------
# The mapping
# --------------------------------------------------------------------------------------------------------

def test_mapping_is_exact_both_ways():
    """Every diffusers tensor lands bit for bit in ours (q/k/v fused, embedders once), and back again."""
    theirs = tiny_diffusers_dit()
    config = full_config(theirs)
    source = theirs.state_dict()
    ours = diffusers_to_dit(source, config, "test model")
    model = DiT(**dit_kwargs(config))
    model.load_state_dict(ours, strict=True)  # every name and shape of our DiT, nothing left over
    assert torch.equal(ours["blocks.1.attn.qkv.weight"][32:64], source["transformer_blocks.1.attn1.to_k.weight"])
    assert torch.equal(ours["blocks.0.mlp.fc2.bias"], source["transformer_blocks.0.ff.net.2.bias"])
    assert torch.equal(ours["y_embedder.embedding_table.weight"],
                       source["transformer_blocks.1.norm1.emb.class_embedder.embedding_table.weight"])
    assert torch.equal(ours["pos_embed"], DiT(**dit_kwargs(config)).pos_embed.detach())  # recomputed as official
    back = dit_to_diffusers(ours)
    assert sorted(back) == sorted(source) and all(torch.equal(back[k], source[k]) for k in source)
    again = diffusers_to_dit(back, config, "test model")
    assert sorted(again) == sorted(ours) and all(torch.equal(again[k], ours[k]) for k in ours)


def test_converted_model_is_the_official_function():
    """Ours on the mapped weights == diffusers with the official timestep features and eps; differs without."""
    theirs = tiny_diffusers_dit()
    model = DiT(**dit_kwargs(full_config(theirs))).eval()
    model.load_state_dict(diffusers_to_dit(theirs.state_dict(), full_config(theirs), "test model"))
    x, t, y = torch.randn(3, 4, 8, 8), torch.tensor([0.0, 421.0, 999.0]), torch.tensor([1, 10, 3])  # 10 = null
    with torch.no_grad():
        ours = model(x, t, y)
        as_is = theirs(x, timestep=t, class_labels=y).sample
        for block in theirs.transformer_blocks:  # the two documented differences, switched to the official ones
            block.norm1.emb.time_proj.downscale_freq_shift = 0
            block.norm3.eps = 1e-6
        official = theirs(x, timestep=t, class_labels=y).sample
    assert torch.allclose(ours, official, atol=1e-6, rtol=0)
    assert ((ours - as_is).norm() / ours.norm()).item() > 1e-3  # diffusers' own forward is another function


def test_unequal_embedder_copies_are_refused():
    """Per-block copies that differ (e.g. fine-tuned in diffusers) cannot be one shared embedder."""
    theirs = tiny_diffusers_dit()
    state = theirs.state_dict()
    state["transformer_blocks.1.norm1.emb.timestep_embedder.linear_2.bias"][0] += 0.5
    with pytest.raises(UserError, match=r"unequal per-block copies.*transformer_blocks\.1\.norm1\.emb\.timestep_"
                                        r"embedder\.linear_2\.bias.*max \|difference\| 0\.5"):
        diffusers_to_dit(state, full_config(theirs), "test model")


def test_unequal_copies_through_the_cli(made, tmp_path, capsys):
    """The same refusal for a saved pipeline, as one paragraph with exit status 2 and nothing written."""
    from safetensors.torch import load_file, save_file

    pipe = tmp_path / "pipe"
    shutil.copytree(made["pipe"], pipe)
    weights = pipe / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(weights)
    state["transformer_blocks.3.norm1.emb.class_embedder.embedding_table.weight"][5] *= 2
    save_file(state, weights, metadata={"format": "pt"})
    code, _, err = run_main(main, ["--ckpt", pipe, "--out", tmp_path / "out", *STEPS], capsys)
    assert code == 2 and "unequal per-block copies of its class embedder" in err and "transformer_blocks.3" in err
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------------------
# --ckpt on diffusers folders, files and Hub ids
# --------------------------------------------------------------------------------------------------------

def test_pipeline_folder_samples_like_the_original_weights(made, reference, tmp_path, capsys):
    """--ckpt PIPELINE (its own vae/ used) and its safetensors file: the .pt's pixels; its transformer/ folder: the
    .pt's weights."""
    from shared.weights.checkpoint import load_sampling_weights

    code, out, err = run_main(main, ["--ckpt", made["pipe"], "--out", tmp_path / "pipe", *STEPS], capsys)
    assert code == 0, err
    settings = json.loads((tmp_path / "pipe" / "settings.json").read_text())
    assert settings["identity"]["kind"] == "diffusers"
    assert settings["identity"]["vae"] == str((made["pipe"] / "vae").resolve())  # no --vae: the pipeline's own
    assert "downscale_freq_shift=1" in out  # the numerics note is printed
    assert pngs(tmp_path / "pipe") == reference
    file = made["pipe"] / "transformer" / "diffusion_pytorch_model.safetensors"
    code, _, err = run_main(main, ["--ckpt", file, "--out", tmp_path / "file", *STEPS], capsys)  # the VAE beside it, too
    assert code == 0, err
    assert pngs(tmp_path / "file") == reference
    loaded = load_sampling_weights(made["pipe"] / "transformer")
    assert loaded.space.source == str((made["pipe"] / "vae").resolve()) and loaded.label == "pipe"
    assert all(torch.equal(loaded.state_dict[k], v) for k, v in made["state"].items())


def fake_hub_cache(cache: Path, pipe: Path) -> Path:
    """The Hugging Face cache layout for HUB_ID: refs/main naming a snapshot folder holding the pipeline."""
    repo = cache / f"models--{HUB_ID.replace('/', '--')}"
    shutil.copytree(pipe, repo / "snapshots" / SNAPSHOT)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SNAPSHOT)
    return cache


@pytest.mark.slow
def test_hub_id_from_the_local_cache_offline(made, reference, tmp_path):
    """`python -m sample --ckpt owner/name` with HF_HUB_OFFLINE=1 reads the snapshot in HF_HUB_CACHE."""
    cache = fake_hub_cache(tmp_path / "hub", made["pipe"])
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "OMP_NUM_THREADS": str(torch.get_num_threads())}  # the reference's threads: identical float sums
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "sample", "--ckpt", HUB_ID, "--out", str(out), *STEPS]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    settings = json.loads((out / "settings.json").read_text())
    assert settings["identity"]["ckpt"].startswith(str(cache.resolve())) and "snapshots" in settings["identity"]["vae"]
    assert pngs(out) == reference


def test_hub_id_not_cached_while_offline(tmp_path, capsys, monkeypatch):
    """A Hub id absent from the cache, offline: one paragraph naming the cache and `hf download`."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(main, ["--ckpt", "facebook/DiT-XL-2-256", "--cpu"], capsys)
    assert code == 2
    assert "not in the local Hub cache" in err and str(tmp_path / "empty-cache") in err
    assert "hf download facebook/DiT-XL-2-256" in err and "Traceback" not in err


def test_other_diffusers_architectures_are_refused(tmp_path, capsys):
    """A UNet2DModel folder, and a Transformer2DModel that is not ada_norm_zero: named, exit 2."""
    from diffusers import Transformer2DModel, UNet2DModel

    UNet2DModel(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(8, 8), norm_num_groups=4,
                down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
                layers_per_block=1).save_pretrained(tmp_path / "unet")
    code, _, err = run_main(main, ["--ckpt", tmp_path / "unet", "--vae", "ema", *STEPS], capsys)
    assert code == 2 and "holds a diffusers UNet2DModel, not a DiT transformer" in err
    Transformer2DModel(in_channels=8, num_attention_heads=2, attention_head_dim=8, num_layers=1,
                       norm_num_groups=8).save_pretrained(tmp_path / "t2d")
    code, _, err = run_main(main, ["--ckpt", tmp_path / "t2d", "--vae", "ema", *STEPS], capsys)
    assert code == 2 and "is a diffusers Transformer2DModel but not a DiT" in err
    assert "norm_type='layer_norm'" in err and "patch_size=None" in err


def test_legacy_transformer2d_config_loads(made, tmp_path):
    """The Hub's older config (Transformer2DModel, norm_type ada_norm_zero, defaults spelled out) maps the same."""
    from shared.weights.checkpoint import load_sampling_weights

    pipe = tmp_path / "pipe"
    shutil.copytree(made["pipe"], pipe)
    config_path = pipe / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config.update(_class_name="Transformer2DModel", cross_attention_dim=None, num_vector_embeds=None,
                  only_cross_attention=False, use_linear_projection=False)
    for key in ("attention_bias", "norm_elementwise_affine"):  # absent: DiTTransformer2DModel's defaults apply,
        config.pop(key)                                         # as diffusers builds this config as that class
    config_path.write_text(json.dumps(config))
    loaded = load_sampling_weights(pipe)
    assert loaded.config == made["config"]
    assert all(torch.equal(loaded.state_dict[k], v) for k, v in made["state"].items())


# --------------------------------------------------------------------------------------------------------
# export --format diffusers
# --------------------------------------------------------------------------------------------------------

def test_export_loads_and_runs_in_diffusers(made, tmp_path, capsys):
    """`python -m sample export RUN --format diffusers OUT`: DiTPipeline.from_pretrained runs it; --ckpt OUT
    gives back our weights bit for bit."""
    from diffusers import DiTPipeline

    out = tmp_path / "exported"
    code, _, err = run_main(main, ["export", made["run"], "--format", "diffusers", out], capsys)
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "model_index.json", "scheduler", "transformer", "vae"]
    assert "downscale_freq_shift=1" in (out / "README.md").read_text()
    assert not list(tmp_path.glob(".tmp-*"))
    pipe = DiTPipeline.from_pretrained(out)
    assert type(pipe.scheduler).__name__ == "DDIMScheduler" and pipe.scheduler.config.beta_end == 0.02
    images = pipe(class_labels=[3, 999], num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                  output_type="np").images
    assert images.shape == (2, 16, 16, 3) and float(images.std()) > 0
    assert pipe.get_label_ids(["thing7", "alias999"]) == [7, 999]  # class names travel as DiTPipeline's id2label
    from shared.weights.checkpoint import load_sampling_weights

    loaded = load_sampling_weights(out)
    state, _, _, _ = load_weights(made["run"] / "exports" / "ema-step-0000300.safetensors")
    assert loaded.config == made["config"] and sorted(loaded.state_dict) == sorted(state)
    assert loaded.space.class_names[7] == "thing7"  # and back, first synonym of each
    assert all(torch.equal(loaded.state_dict[k], state[k]) for k in state)


def test_export_refuses_an_existing_target(made, tmp_path, capsys):
    """An existing OUT is never overwritten."""
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = run_main(main, ["export", made["run"], "--format", "diffusers", out], capsys)
    assert code == 2 and "already exists" in err and "never overwrites" in err
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"


def test_export_refuses_what_ditpipeline_cannot_run(made, tmp_path, capsys):
    """A 10-class model: DiTPipeline's unconditional label is the literal 1000."""
    config = ModelConfig("DiT-T/2", input_size=8, in_channels=4, num_classes=10)
    path = tmp_path / "ten.pt"
    torch.save(config.build().state_dict(), path)
    code, _, err = run_main(main, ["export", path, "--vae", made["vae"], tmp_path / "out"], capsys)
    assert code == 2 and "10 classes" in err and "hard-codes the unconditional label as 1000" in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".tmp-*"))
    no_null = ModelConfig("DiT-T/2", input_size=8, num_classes=1000, class_dropout_prob=0.0)  # trained unguided
    export = save_weights(tmp_path / "no-null.safetensors", no_null.build().state_dict(), no_null, None, 1)
    code, _, err = run_main(main, ["export", export, "--vae", made["vae"], tmp_path / "out"], capsys)
    assert code == 2 and "no null-class embedding" in err


def test_export_command_line_parses_options_between_positionals():
    """The issue's spelling: `export RUN --format diffusers OUT`."""
    from sample.__main__ import export_parser

    args = export_parser().parse_args(["results/run", "--format", "diffusers", "exports/out"])
    assert (args.ckpt, args.format, args.out) == ("results/run", "diffusers", "exports/out")
