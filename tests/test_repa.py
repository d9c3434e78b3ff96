"""REPA: shard tensors, extraction with a tiny DINOv2, training with alignment, REPA's released layout."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.runtime.errors import UserError
from shared.network.repa import alignment_loss, match_tokens
from tests.helpers import write_space

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------------
# REPA's key layout (sihyun-yu/REPA models/sit.py, SiT_models + build_mlp), written out by name at tiny size
# ---------------------------------------------------------------------------------------------------------

def repa_state_dict(depth=6, width=192, patch=2, channels=4, grid=4, classes=10, proj=32, feat=16, seed=0):
    """Random tensors under REPA SiT's key names and shapes (4 output channels, one projector to `feat`)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "pos_embed": (1, grid * grid, width),
        "x_embedder.proj.weight": (width, channels, patch, patch), "x_embedder.proj.bias": (width,),
        "t_embedder.mlp.0.weight": (width, 256), "t_embedder.mlp.0.bias": (width,),
        "t_embedder.mlp.2.weight": (width, width), "t_embedder.mlp.2.bias": (width,),
        "y_embedder.embedding_table.weight": (classes + 1, width),
        "final_layer.linear.weight": (patch * patch * channels, width),
        "final_layer.linear.bias": (patch * patch * channels,),
        "final_layer.adaLN_modulation.1.weight": (2 * width, width),
        "final_layer.adaLN_modulation.1.bias": (2 * width,),
        "projectors.0.0.weight": (proj, width), "projectors.0.0.bias": (proj,),
        "projectors.0.2.weight": (proj, proj), "projectors.0.2.bias": (proj,),
        "projectors.0.4.weight": (feat, proj), "projectors.0.4.bias": (feat,),
    }
    for i in range(depth):
        shapes.update({
            f"blocks.{i}.attn.qkv.weight": (3 * width, width), f"blocks.{i}.attn.qkv.bias": (3 * width,),
            f"blocks.{i}.attn.proj.weight": (width, width), f"blocks.{i}.attn.proj.bias": (width,),
            f"blocks.{i}.mlp.fc1.weight": (4 * width, width), f"blocks.{i}.mlp.fc1.bias": (4 * width,),
            f"blocks.{i}.mlp.fc2.weight": (width, 4 * width), f"blocks.{i}.mlp.fc2.bias": (width,),
            f"blocks.{i}.adaLN_modulation.1.weight": (6 * width, width),
            f"blocks.{i}.adaLN_modulation.1.bias": (6 * width,),
        })
    return {k: 0.02 * torch.randn(s, generator=g) for k, s in shapes.items()}


def make_feature_latents(root: Path, n=24, flips=2, tokens=16, dim=8, encoder="enc-a", seed=0) -> Path:
    """A finished latent folder whose samples also store "repr" (F, T, E) tokens and the encoder's identity."""
    from shared.datasets.shards import ShardWriter, shard_name, write_index

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    with ShardWriter(root / shard_name(0), columns={"mean": torch.float16, "std": torch.float16, "repr": torch.float16}
                     ) as writer:
        for i in range(n):
            mean = rng.normal(size=(flips, 4, 4, 4)).astype(np.float32) * 0.5 + (i % 4) - 1.5
            feats = torch.from_numpy(rng.normal(size=(flips, tokens, dim)).astype(np.float32)).half()
            writer.add(f"{i:06d}", {"mean": mean, "std": np.full_like(mean, 0.1), "repr": feats}, i % 4)
    identity = {"source": encoder, "model_type": "dinov2", "config_sha256": encoder * 4, "input_size": 16,
                "patch_size": 4, "grid": 4, "tokens": tokens, "dim": dim, "dtype": "fp16",
                "normalisation": {"mean": [0.5] * 3, "std": [0.5] * 3}}
    space = write_space(root, (4, 4, 4), 8, list("abcd"), 0.5)
    write_index(root, [writer.info], {"image_size": 8, "num_classes": 4, "class_names": list("abcd"),
                                      "latent_space": space, "repr_encoder": identity})
    return root


# ---------------------------------------------------------------------------------------------------------
# Shards with named tensors
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_shards_store_extra_named_tensors_and_describe_them(tmp_path, dtype):
    from shared.datasets.shards import LatentDataset, ShardWriter, collate, shard_name, write_index

    g = torch.Generator().manual_seed(0)
    means = torch.randn(5, 2, 4, 2, 2, generator=g)
    feats = torch.randn(5, 2, 9, 3, generator=g).to(dtype)
    with ShardWriter(tmp_path / shard_name(0), columns={"mean": "fp16", "std": "fp16", "repr": dtype}) as writer:
        for i in range(5):
            writer.add(f"k{i}", {"mean": means[i], "std": means[i].abs(), "repr": feats[i]}, i % 2)
    write_index(tmp_path, [writer.info], {"image_size": 4, "num_classes": 2, "class_names": ["a", "b"],
                                          "latent_space": write_space(tmp_path, (4, 2, 2), 4, ["a", "b"])})
    index = json.loads((tmp_path / "index.json").read_text())
    name = str(dtype).replace("torch.", "")
    assert index["tensors"] == [{"name": "mean", "dtype": "float16", "shape": [2, 4, 2, 2]},
                                {"name": "std", "dtype": "float16", "shape": [2, 4, 2, 2]},
                                {"name": "repr", "dtype": name, "shape": [2, 9, 3]}]
    ds = LatentDataset(tmp_path, progress=False)
    assert ds.tensor_names == ("mean", "std", "repr")
    batch = ds.gather([4, 1, 1])
    assert batch["repr"].dtype == dtype and torch.equal(batch["repr"], feats[[4, 1, 1]])
    assert torch.equal(batch["mean"], means[[4, 1, 1]].half())
    assert torch.equal(ds[3]["repr"], feats[3])
    assert set(ds.gather([0], ("mean", "std"))) == {"mean", "std", "label"}  # the features are not read
    one = ds.gather([4, 1, 1], ("repr", "mean"), frames=[1, 0, 1])  # only the drawn flip of each column
    assert torch.equal(one["repr"], feats[[4, 1, 1], [1, 0, 1]])
    assert torch.equal(one["mean"], means[[4, 1, 1], [1, 0, 1]].half()) and set(one) == {"repr", "mean", "label"}
    with pytest.raises(IndexError, match="frame outside the 2"):
        ds.gather([0], frames=[2])
    assert torch.equal(collate([ds[2], ds[0]])["repr"], feats[[2, 0]])
    assert torch.equal(collate(ds.__getitems__([2, 0]))["repr"], feats[[2, 0]])


def test_moment_only_shards_keep_the_first_versions_bytes_and_layout(tmp_path):
    """A folder without extra tensors is byte-identical to the format before them (old folders read unchanged)."""
    import safetensors.numpy

    from shared.datasets.shards import LatentDataset, ShardWriter, shard_name

    mean = np.arange(32, dtype=np.float16).reshape(2, 4, 2, 2)
    with ShardWriter(tmp_path / shard_name(0), columns={"mean": torch.float16, "std": torch.float16}) as writer:
        writer.add("k0", {"mean": mean, "std": mean}, 1)
    payload = safetensors.numpy.save({"mean": mean, "std": mean})  # what the first version wrote
    assert payload in (tmp_path / shard_name(0)).read_bytes()
    assert set(writer.info.layout) == {"dtype", "shape", "header_size", "payload_size", "tensors"}
    assert set(writer.info.layout["tensors"]) == {"mean", "std"}
    # An index written before "tensors" existed still reads.
    from shared.datasets.shards import write_index
    write_index(tmp_path, [writer.info], {"image_size": 4, "num_classes": 2, "class_names": ["a", "b"],
                                          "latent_space": write_space(tmp_path, (4, 2, 2), 4, ["a", "b"])})
    index = json.loads((tmp_path / "index.json").read_text())
    del index["tensors"]
    (tmp_path / "index.json").write_text(json.dumps(index))
    ds = LatentDataset(tmp_path, progress=False)
    assert ds.tensor_names == ("mean", "std") and ds.gather([0])["mean"].shape == (1, 2, 4, 2, 2)


# ---------------------------------------------------------------------------------------------------------
# The pieces: tokens, loss, the model's hidden tokens, the flow convention
# ---------------------------------------------------------------------------------------------------------

def test_alignment_loss_and_token_matching():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 16, 5, generator=g)
    assert torch.allclose(alignment_loss(z, 2 * z), torch.full((3,), -1.0), atol=1e-6)  # cosine ignores scale
    assert torch.allclose(alignment_loss(-z, z), torch.full((3,), 1.0), atol=1e-6)
    assert match_tokens(z, 16) is z
    # 4x4 -> 2x2: each DiT token sees the mean of its 2x2 block of encoder tokens (antialiased bilinear, factor 2)
    grid = torch.arange(16.0).view(1, 16, 1)
    pooled = match_tokens(grid, 4).view(-1)
    assert torch.allclose(pooled, torch.tensor([2.5, 4.5, 10.5, 12.5]))
    up = match_tokens(torch.ones(2, 4, 3), 16)  # 2x2 -> 4x4 (upsampling keeps a constant field)
    assert up.shape == (2, 16, 3) and torch.allclose(up, torch.ones_like(up))


@pytest.mark.parametrize("every", [0, 1])
def test_model_returns_block_k_tokens_from_the_same_forward(every):
    from shared.network.models import DiT_models

    torch.manual_seed(0)
    model = DiT_models["DiT-T/2"](input_size=8, num_classes=4, grad_checkpoint_every=every)
    for p in model.parameters():  # leave adaLN-Zero's identity start so the blocks do something
        torch.nn.init.normal_(p, std=0.05)
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([3.0, 700.0]), torch.tensor([1, 2])
    out, hidden = model(x, t, y, return_hidden_at=3)
    assert torch.equal(out, model(x, t, y))
    h = model.x_embedder(x) + model.pos_embed
    c = model.t_embedder(t) + model.y_embedder(y, model.training)
    for block in model.blocks[:3]:
        h = block(h, c)
    assert torch.allclose(hidden, h, atol=1e-6)
    hidden.sum().backward()  # gradients reach the early blocks through the returned tokens
    assert model.blocks[0].attn.qkv.weight.grad.abs().sum() > 0 and model.blocks[5].attn.qkv.weight.grad is None


def test_repa_convention_loss_is_repas():
    """REPA's loss.py: input (1 - t) x + t eps at time t (0 = data), target eps - x (d/dt of its path)."""
    from shared.generative.flow import FlowPath

    g = torch.Generator().manual_seed(0)
    x, eps, tau = torch.randn(4, 3, 2, 2, generator=g), torch.randn(4, 3, 2, 2, generator=g), torch.rand(4, generator=g)
    seen = {}

    def model_fn(xt, t):
        seen.update(xt=xt, t=t)
        return 0.3 * xt

    loss = FlowPath("repa").training_losses(model_fn, x, tau, eps)["loss"]
    t = seen["t"].view(-1, 1, 1, 1)
    assert torch.allclose(seen["t"], 1 - tau)
    assert torch.allclose(seen["xt"], (1 - t) * x + t * eps, atol=1e-6)
    assert torch.allclose(loss, ((0.3 * seen["xt"] - (eps - x)) ** 2).mean(dim=(1, 2, 3)), atol=1e-6)


def test_training_features_follow_the_latents_flip_variant(tmp_path):
    """With std 0 the latent is the stored mean, so its value names the flip each sample drew."""
    from shared.generative.objectives import make_objective
    from shared.datasets.shards import LatentDataset, ShardWriter, shard_name, write_index
    from train.loop import TrainingDraws

    with ShardWriter(tmp_path / shard_name(0), columns={"mean": "fp16", "std": "fp16", "repr": "fp32"}) as writer:
        for i in range(16):
            mean = np.stack([np.full((4, 2, 2), f + 10 * i, np.float32) for f in range(2)])  # (F=2, C, h, w)
            feats = torch.stack([torch.full((4, 3), float(f + 10 * i)) for f in range(2)])  # (F, T, E)
            writer.add(f"k{i}", {"mean": mean, "std": np.zeros_like(mean), "repr": feats}, 0)
    write_index(tmp_path, [writer.info], {"image_size": 4, "num_classes": 1, "class_names": ["a"],
                                          "latent_space": write_space(tmp_path, (4, 2, 2), 4, ["a"])})
    draws = TrainingDraws(LatentDataset(tmp_path, progress=False), seed=3, class_dropout_prob=0.0,
                          objective=make_objective("flow"), extra=("repr",))
    batch = draws.__getitems__([(p, p) for p in range(16)])
    assert torch.equal(batch["repr"][:, 0, 0], batch["x0"][:, 0, 0, 0])
    assert set((batch["x0"][:, 0, 0, 0] % 10).tolist()) == {0.0, 1.0}  # both flips were drawn
    assert "repr" not in TrainingDraws(draws.dataset, 3, 0.0, draws.objective).__getitems__([(0, 0)])


# ---------------------------------------------------------------------------------------------------------
# Extraction with a tiny DINOv2 (loaded through the real loading code), through the real CLI
# ---------------------------------------------------------------------------------------------------------

def _extract(data, out, vae, encoder, *extra) -> list:
    features = ["--repr-encoder", str(encoder), "--repr-image-size", "16"] if encoder else []
    return ["--data-path", str(data), "--out", str(out), "--vae", str(vae), "--image-size", "16", "--shard-size", "4",
            "--batch-size", "3", "--num-workers", "0", *features, *extra]


def _user_error(capsys, main, argv, prog) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"{prog}: error:" in err and "Traceback" not in err, err[-2000:]
    return " ".join(err[err.index(f"{prog}: error:"):].split())


def test_extract_stores_the_encoders_tokens_of_each_flip(image_folder, tiny_vae_dir, tiny_dinov2_dir, tmp_path,
                                                          capsys):
    from extract.__main__ import main
    from shared.datasets.imagefolder import scan_image_folder
    from shared.tokenizers.repr_encoder import load_encoder, plan_identity
    from shared.datasets.shards import LatentDataset

    out = tmp_path / "lat"
    assert main(_extract(image_folder, out, tiny_vae_dir, tiny_dinov2_dir, "--dry-run")) == 0
    plan = capsys.readouterr().out
    assert "storage: encoder tokens 1 KiB per image (2 flip(s) x 16 tokens x 16 fp16; 4x4 patches of 4 px at 16 px)" \
        in plan, plan
    assert "at ImageNet's 1,281,167 images" in plan and not out.exists()  # the dry run writes nothing
    assert main(_extract(image_folder, out, tiny_vae_dir, tiny_dinov2_dir, "--repr-dtype", "fp32")) == 0
    ds = LatentDataset(out, progress=False)
    assert ds.tensor_spec("repr")["shape"] == [2, 16, 16] and ds.meta["repr_encoder"]["dim"] == 16
    # The stored tokens are the encoder's on the stage's own crop, and on its mirror for flip 1.
    from shared.datasets.images import ImageFileDataset as Files
    scan = scan_image_folder(image_folder)
    pixels = torch.stack([Files(scan, 16)[i]["pixels"] for i in range(2)])  # (2, 3, 16, 16) uint8
    encode = load_encoder(str(tiny_dinov2_dir), plan_identity(str(tiny_dinov2_dir), 16, 16), "cpu")
    stored = ds.gather([0, 1])["repr"]  # (2, F, T, E)
    assert torch.allclose(stored[:, 0], encode(pixels), atol=1e-5)
    assert torch.allclose(stored[:, 1], encode(pixels.flip(3)), atol=1e-5)
    assert not torch.allclose(stored[:, 0], stored[:, 1], atol=1e-3)


def test_adding_an_encoder_to_a_half_extracted_folder_is_refused(image_folder, tiny_vae_dir, tiny_dinov2_dir,
                                                                  tmp_path, capsys):
    from extract.__main__ import main

    out = tmp_path / "lat"
    assert main(_extract(image_folder, out, tiny_vae_dir, None, "--limit", "4")) == 0
    (out / "index.json").unlink()  # as if stopped before the index: shards without features exist
    before = sorted(p.name for p in out.iterdir())
    message = _user_error(capsys, main, _extract(image_folder, out, tiny_vae_dir, tiny_dinov2_dir, "--limit", "4"),
                          "python -m extract")
    assert f"--out {out} holds shards of a different extraction (repr_encoder: None ->" in message
    assert "Use a new --out folder for these settings" in message
    assert sorted(p.name for p in out.iterdir()) == before  # nothing lost or added


def test_not_a_dinov2_encoder_is_one_paragraph(image_folder, tiny_vae_dir, tmp_path, capsys):
    from extract.__main__ import main

    message = _user_error(capsys, main, _extract(image_folder, tmp_path / "lat", tiny_vae_dir, tmp_path / "nothing"),
                          "python -m extract")
    assert "--repr-encoder" in message and "is neither a folder holding a transformers encoder" in message
    assert not (tmp_path / "lat").exists()


# ---------------------------------------------------------------------------------------------------------
# Training with REPA through the real entry point
# ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def feature_latents(tmp_path_factory) -> Path:
    return make_feature_latents(tmp_path_factory.mktemp("flat") / "lat")


def _train(latents, run, *extra) -> list:
    return ["--model", "DiT-T/2", "--latents", str(latents), "--results-dir", str(run), "--global-batch-size", "4",
            "--num-workers", "0", "--sample-every", "0", "--log-every", "1", "--objective", "flow",
            "--repa-weight", "0.5", "--repa-depth", "2", "--repa-projector-dim", "32", "--report-to", "none", *extra]


def test_repa_trains_checkpoints_its_projector_resumes_and_exports_without_it(feature_latents, tmp_path):
    from safetensors import safe_open

    from shared.runtime import rundir
    from train.__main__ import main

    run = tmp_path / "run"
    assert main(_train(feature_latents, run, "--max-steps", "2", "--ckpt-every", "2")) == 0
    ckpt = run / "checkpoints" / "step-0000002"
    projector = ckpt / rundir.PROJECTOR_FILE
    with safe_open(projector, "pt") as f:
        assert f.get_tensor("mlp.4.weight").shape == (8, 32)  # E = 8 from the folder, P = 32
    export = sorted((run / "exports").iterdir())[-1]
    with safe_open(export, "pt") as f:
        assert not any("mlp.4" in k or "projector" in k for k in f.keys())  # sampling never needs it
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all({"diffusion_loss", "repa_loss"} <= set(m) for m in lines)
    assert all(abs(m["loss"] - m["diffusion_loss"] - 0.5 * m["repa_loss"]) < 1e-4 for m in lines)
    saved = torch.load(ckpt / rundir.OPTIMIZER_FILE, weights_only=True)
    before = {k: v.clone() for k, v in __import__("safetensors.torch").torch.load_file(projector).items()}
    assert main(_train(feature_latents, run, "--max-steps", "3", "--ckpt-every", "3")) == 0
    after = __import__("safetensors.torch").torch.load_file(run / "checkpoints" / "step-0000003" / rundir.PROJECTOR_FILE)
    assert "resumed from" in (run / "log.txt").read_text()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the projector kept training
    assert len(saved["state"]) > 0


def test_repa_mistakes_are_one_paragraph_each(feature_latents, tmp_path, capsys):
    from tests.helpers import make_latents
    from train.__main__ import main

    def refused(latents, run, *extra):
        message = _user_error(capsys, main, _train(latents, run, "--max-steps", "2", *extra), "python -m train")
        assert not (run / "checkpoints").exists()
        return message

    plain = make_latents(tmp_path / "plain")
    message = refused(plain, tmp_path / "r1")
    assert "holds no encoder features" in message and "--repr-encoder" in message and "drop --repa-weight" in message
    message = refused(feature_latents, tmp_path / "r2", "--repa-depth", "7")
    assert "--repa-depth 7 is outside the 6 blocks of DiT-T/2" in message
    message = refused(feature_latents, tmp_path / "r3", "--repa-feature-dim", "768")
    assert "--repa-feature-dim 768 does not match the features stored" in message and "width 8" in message
    message = refused(feature_latents, tmp_path / "r5", "--repa-weight", "-0.5")  # the option's declared bound
    assert "--repa-weight must be at least 0; got -0.5" in message
    # Resuming on features of another encoder (same latents otherwise) is refused, nothing written.
    run = tmp_path / "r4"
    assert main(_train(feature_latents, run, "--max-steps", "1", "--ckpt-every", "1")) == 0
    other = make_feature_latents(tmp_path / "other", encoder="enc-b")
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    with pytest.raises(SystemExit) as info:
        main(_train(other, run, "--max-steps", "2"))
    assert info.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "the checkpoint was trained with the 'repr' column (encoder features) of enc-a" in err
    assert "config_sha256" in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


# ---------------------------------------------------------------------------------------------------------
# REPA's released checkpoint layout, sampled through the real CLI
# ---------------------------------------------------------------------------------------------------------

def test_a_repa_layout_state_dict_loads_strictly_and_samples_with_the_sde(tiny_vae_dir, tmp_path, capsys):
    from sample.__main__ import main
    from shared.weights.checkpoint import build_sampling_model as build_model, load_sampling_weights as load_checkpoint

    path = tmp_path / "repa.pt"
    state = repa_state_dict()
    torch.save(state, path)
    loaded = load_checkpoint(path)
    config = loaded.config
    assert (config.objective, config.objective_args["convention"], config.learn_sigma) == ("flow", "repa", False)
    model = build_model(loaded, "cpu")  # strict
    assert torch.equal(model.blocks[5].mlp.fc2.weight, state["blocks.5.mlp.fc2.weight"])
    assert any("REPA layout: its projector (6 tensors" in n for n in loaded.notes)
    # REPA's FID command is recorded (SDE, 250 steps, guidance at noise levels 0..0.7); the steps flag wins.
    assert config.sampling == {"sampler": "sde", "num_sampling_steps": 250, "cfg_interval": [0.0, 0.7]}
    out = tmp_path / "samples"
    main(["--ckpt", str(path), "--vae", str(tiny_vae_dir), "--num-samples", "2", "--batch-size", "2",
          "--num-sampling-steps", "3", "--cfg-scale", "1.8", "--out", str(out)])
    settings = json.loads((out / "settings.json").read_text())
    assert len(list(out.glob("0*.png"))) == 2
    assert (settings["identity"]["sampler"], settings["identity"]["num_sampling_steps"],
            settings["identity"]["cfg_interval"]) == ("sde", 3, [0.0, 0.7])
    assert "sampling as the weights record: sampler sde, cfg interval 0 0.7" in capsys.readouterr().out
    assert settings["identity"]["guide_channels"] == "all"  # auto: what REPA's sampler guides
    assert "(auto: REPA's sampler guides all channels)" in settings["run"]["guidance"]
    del state["blocks.2.attn.qkv.bias"]
    torch.save(state, path)
    with pytest.raises(UserError) as info:  # strict: a missing tensor is refused, not silently zero
        build_model(load_checkpoint(path), "cpu")
    assert "these weights look like DiT-T/2" in str(info.value)  # refused by the layout check before any build


def test_repa_release_is_named_with_its_url():
    from shared.weights.official import OFFICIAL_NAMES, checkpoint_url

    assert "REPA-SiT-XL-2-256x256.pt" in OFFICIAL_NAMES
    assert checkpoint_url("REPA-SiT-XL-2-256x256.pt").startswith(
        "https://www.dl.dropboxusercontent.com/scl/fi/cxedbs4da5ugjq5wg3zrg/last.pt")


def test_sde_in_repas_convention_is_repas_euler_maruyama():
    """Our SDE on a REPA-convention model equals REPA's sampler written in its own time (t = 0 data, 1 noise):
    grid linspace(1, 0.04, N), drift u - 0.5 * 2t * score with score = (-(1 - t) u - x) / t, noise sqrt(2t |dt|),
    then a noise-free step to t = 0 (REPA samplers.py euler_maruyama_sampler, linear path)."""
    from shared.generative.objectives import make_objective

    g = torch.Generator().manual_seed(0)
    w = 0.3 * torch.randn(3, 3, generator=g)

    def model_fn(x, t, y=None):  # a smooth stand-in network: u(x, t) = W x + t
        return torch.einsum("ij,njhw->nihw", w, x) + t.view(-1, 1, 1, 1)

    noise, steps = torch.randn(2, 3, 4, 4, generator=g), 6
    ours = make_objective("flow", {"convention": "repa"}).sample("sde", model_fn, noise, steps, {"last_step_size": 0.04},
                                                 generator=torch.Generator().manual_seed(5))
    z = torch.Generator().manual_seed(5)
    x = noise.double()
    times = torch.linspace(1.0, 0.04, steps, dtype=torch.float64).tolist() + [0.0]
    for i, (t0, t1) in enumerate(zip(times[:-1], times[1:])):
        u = model_fn(x.float(), torch.full((2,), t0)).double()
        score = (-(1 - t0) * u - x) / t0
        drift = u - 0.5 * (2 * t0) * score
        x = x + drift * (t1 - t0)
        if i < steps - 1:
            x = x + (2 * t0) ** 0.5 * abs(t1 - t0) ** 0.5 * torch.randn(x.shape, generator=z).double()
    assert torch.allclose(ours.double(), x, atol=1e-4), (ours.double() - x).abs().max()


def test_projector_width_bound_is_declared_on_its_option():
    """--repa-projector-dim 0 is refused by the option's own bound (min=1), one paragraph naming the flag."""
    from shared.network.repa import RepaFlags
    from shared.runtime.cli import check_flag_bounds

    with pytest.raises(UserError, match=r"--repa-projector-dim must be at least 1; got 0"):
        check_flag_bounds(RepaFlags(repa_projector_dim=0))
