"""sample/: tiny DiT-T/2 (latent 4x8x8) + tiny VAE (x2) -> 16x16 PNGs, through the real CLI entry points."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import ROOT, make_tiny_vae
from shared.sampling.previews import write_preview
from tests.helpers import NUM_CLASSES, pngs, random_dit, run_sample, space_of
from shared.weights.checkpoint import run_weight_file
from shared.sampling.plan import ckpt_label
from shared.sampling.generate import grid_layout
from shared.weights.export import save_weights
from shared.runtime.interrupt import EXIT_STATUS, MESSAGE
from shared.network.models import DiT, ModelConfig
from shared.tokenizers.locate import load_tokenizer

STEPS = ["--num-sampling-steps", "4", "--cpu"]


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_vae_dir):
    """An official-layout .pt, a run folder with two exports and a checkpoint, and the VAE."""
    root = tmp_path_factory.mktemp("sample")
    config = ModelConfig("DiT-T/2", input_size=8, in_channels=4, num_classes=NUM_CLASSES)
    state = random_dit(config).state_dict()
    torch.save(state, root / "DiT-T-2-16x16.pt")
    vae = load_tokenizer(tiny_vae_dir)
    meta = {"image_size": 16, "scaling_factor": vae.scaling_factor, "latent_shape": [4, 8, 8],
            "vae": vae.identity, "class_names": [str(c) for c in range(NUM_CLASSES)]}
    run = root / "run"
    older = {k: torch.zeros_like(v) for k, v in state.items()}
    save_weights(run / "exports" / "ema-step-0000100.safetensors", older, config, space_of(meta), 100)
    save_weights(run / "exports" / "ema-step-0000200.safetensors", state, config, space_of(meta), 200)
    save_weights(run / "checkpoints" / "step-0000200" / "model.safetensors", state, config, space_of(meta), 200)
    (run / "checkpoints" / "step-0000200" / "state.json").write_text('{"step": 200}')  # marks it complete
    return {"root": root, "pt": root / "DiT-T-2-16x16.pt", "run": run, "vae": tiny_vae_dir, "state": state,
            "meta": meta}


def official(files, out, *extra):
    """argv sampling the official .pt."""
    return ["--ckpt", files["pt"], "--vae", files["vae"], "--out", out, *STEPS, *extra]


# --------------------------------------------------------------------------------------------------------
# End to end
# --------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_official_pt_through_real_command(files, tmp_path):
    """`python -m sample` on a bare state dict: preset inferred, PNGs, grid, npz, settings."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "sample", *map(str, official(files, out, "--class-labels", 3, 7,
                                                              "--num-samples", 4, "--npz", "--batch-size", 3))]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "DiT-T-2-16x16" in result.stdout and "settings.json" in result.stdout
    assert sorted(pngs(out)) == ["000000-class3.png", "000001-class7.png", "000002-class3.png", "000003-class7.png"]
    with np.load(out / "samples.npz") as npz:
        assert npz["arr_0"].dtype == np.uint8 and npz["arr_0"].shape == (4, 16, 16, 3)
        assert npz["labels"].tolist() == [3, 7, 3, 7]
        from PIL import Image
        assert np.array_equal(npz["arr_0"][2], np.asarray(Image.open(out / "000002-class3.png")))
        assert npz["arr_0"].std() > 0  # real pictures, not a constant
    settings = json.loads((out / "settings.json").read_text())
    assert settings["identity"]["model"]["model"] == "DiT-T/2" and settings["identity"]["image_size"] == 16
    assert any("inferred from tensor shapes" in note for note in settings["run"]["notes"])
    # one row per class: 2 rows of 2 cells, 16 px enlarged 6x to 96 px, 4 px padding, an 18 px caption line under
    # each row and the title line on top (the preview grid's layout)
    from PIL import Image
    assert Image.open(out / "grid.png").size == (4 + 2 * (96 + 4), 18 + 4 + 2 * (96 + 18 + 4))


def test_run_folder_export_needs_no_model_or_vae_flags(files, tmp_path, capsys):
    """--ckpt RUN picks the newest EMA export; config and VAE come from its metadata."""
    out = tmp_path / "out"
    code, err = run_sample(["--ckpt", files["run"], "--out", out, "--num-samples", 3, "--cfg-scale", 1.5, *STEPS], capsys)
    assert code == 0, err
    settings = json.loads((out / "settings.json").read_text())
    assert settings["identity"]["ckpt"].endswith("ema-step-0000200.safetensors")
    assert settings["identity"]["step"] == 200 and settings["identity"]["vae"] == str(Path(files["vae"]).resolve())
    assert ckpt_label(Path(settings["identity"]["ckpt"])) == "run-ema-step-0000200"
    assert sorted(pngs(out)) == ["000000-class0.png", "000001-class1.png", "000002-class2.png"]


def test_export_file_matches_official_pt_with_same_weights(files, tmp_path, capsys):
    """The same weights as an export and as a .pt give the same pixels under the same guidance rule (auto differs:
    all channels for our export, the DiT release's 3 of 4 for a bare .pt)."""
    code, err = run_sample(["--ckpt", files["run"] / "exports" / "ema-step-0000200.safetensors", "--out",
                         tmp_path / "a", "--num-samples", 2, "--guide-channels", "3", *STEPS], capsys)
    assert code == 0, err
    assert run_sample(official(files, tmp_path / "b", "--num-samples", 2), capsys)[0] == 0
    assert pngs(tmp_path / "a") == pngs(tmp_path / "b")


def test_seed_reproducible_across_batch_sizes(files, tmp_path, capsys):
    """Batch 1 and batch 3 give byte-identical PNGs (random labels too); images differ from each other."""
    for name, batch in (("b1", 1), ("b3", 3)):
        assert run_sample(official(files, tmp_path / name, "--num-samples", 4, "--batch-size", batch,
                                "--random-labels", "--seed", 3), capsys)[0] == 0
    assert pngs(tmp_path / "b1") == pngs(tmp_path / "b3")
    assert len(set(pngs(tmp_path / "b1").values())) == 4


def test_resume_after_interrupted_run_matches_uninterrupted(files, tmp_path, capsys, monkeypatch):
    """Kill a 2-batch job after its first batch; the rerun draws only the rest; files equal a clean run."""
    args = ("--num-samples", 4, "--batch-size", 2, "--npz")
    assert run_sample(official(files, tmp_path / "clean", *args), capsys)[0] == 0

    import shared.sampling.generate as generate
    real_draw, drawn = generate.Drawer.draw, []

    def draw_then_die(self, indices):
        if drawn:
            raise KeyboardInterrupt  # the process is killed while drawing the second batch
        drawn.append(list(indices))
        return real_draw(self, indices)

    monkeypatch.setattr(generate.Drawer, "draw", draw_then_die)
    code, err = run_sample(official(files, tmp_path / "resumed", *args), capsys)  # Ctrl-C: one line, status 130
    assert code == EXIT_STATUS and err.endswith(f"python -m sample: {MESSAGE}") and "Traceback" not in err
    assert sorted(pngs(tmp_path / "resumed")) == ["000000-class0.png", "000001-class1.png"]
    assert not (tmp_path / "resumed" / "samples.npz").exists()
    (tmp_path / "resumed" / ".tmp-999-000002-class2.png").write_bytes(b"half")  # what kill -9 can leave

    def record(self, indices):
        drawn.append(list(indices))
        return real_draw(self, indices)

    monkeypatch.setattr(generate.Drawer, "draw", record)
    assert run_sample(official(files, tmp_path / "resumed", *args), capsys)[0] == 0
    assert drawn == [[0, 1], [2, 3]]  # the rerun drew only images 2 and 3
    assert pngs(tmp_path / "resumed") == pngs(tmp_path / "clean")
    assert not list((tmp_path / "resumed").glob(".tmp-*"))
    for name in ("samples.npz", "grid.png"):
        assert (tmp_path / "resumed" / name).read_bytes() == (tmp_path / "clean" / name).read_bytes()


def test_bf16_ddim_all_channel_guidance_and_vae_switches(files, tmp_path, capsys):
    """The non-default paths run: bf16 autocast DiT, bf16 VAE with tiling and slicing, DDIM, guide all."""
    out = tmp_path / "o"
    code, err = run_sample(official(files, out, "--num-samples", 2, "--precision", "bf16", "--vae-precision", "bf16",
                                 "--vae-tiling", "--vae-slicing", "--sampler", "ddim", "--guide-channels", "all"),
                        capsys)
    assert code == 0, err
    identity = json.loads((out / "settings.json").read_text())["identity"]
    assert (identity["precision"], identity["vae_tiling"], identity["guide_channels"]) == ("bf16", True, "all")
    assert len(pngs(out)) == 2


@pytest.mark.slow
def test_two_processes_split_images_and_match_one(files, tmp_path, capsys):
    """torchrun with 2 CPU processes (what accelerate launch starts) writes the same files as 1 process."""
    args = official(files, tmp_path / "two", "--num-samples", 3, "--batch-size", 2, "--npz")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "sample", *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0/2" in result.stderr
    # Same thread count as each worker: CPU matmuls reduce in a thread-dependent order (last-bit differences).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = official(files, tmp_path / "one", "--num-samples", 3, "--batch-size", 2, "--npz")
        assert run_sample(one, capsys)[0] == 0
    finally:
        torch.set_num_threads(threads)
    assert len(pngs(tmp_path / "two")) == 3 and pngs(tmp_path / "two") == pngs(tmp_path / "one")
    with np.load(tmp_path / "two" / "samples.npz") as a, np.load(tmp_path / "one" / "samples.npz") as b:
        assert np.array_equal(a["arr_0"], b["arr_0"]) and np.array_equal(a["labels"], b["labels"])


def test_decode_training_latents(files, tmp_path, capsys):
    """`decode` turns a RUN/samples/step-*.safetensors file into labelled PNGs equal to a direct VAE decode."""
    latents = torch.randn(3, 4, 8, 8)
    path = tmp_path / "samples" / "step-0000100.safetensors"
    path.parent.mkdir()
    write_preview(path, latents, torch.tensor([5, 1, 5]), space_of(files["meta"]), 100)
    code, err = run_sample(["decode", path, "--cpu"], capsys)
    assert code == 0, err
    out = tmp_path / "samples" / "step-0000100"
    assert sorted(pngs(out)) == ["000000-class5.png", "000001-class1.png", "000002-class5.png"]
    from PIL import Image
    expected = load_tokenizer(files["vae"]).decode(latents)[1]  # (3, H, W)
    expected = ((expected + 1) * 127.5 + 0.5).clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
    assert np.array_equal(np.asarray(Image.open(out / "000001-class1.png")), expected)
    assert (out / "grid.png").exists()


# --------------------------------------------------------------------------------------------------------
# Pieces
# --------------------------------------------------------------------------------------------------------

def test_run_folder_resolution(files, tmp_path):
    """Newest export by step; --weights raw -> newest checkpoint's model.safetensors; empty run -> fix named."""
    run = files["run"]
    assert run_weight_file(run, "ema")[0].name == "ema-step-0000200.safetensors"
    assert run_weight_file(run, "raw")[0] == run / "checkpoints" / "step-0000200" / "model.safetensors"
    assert run_weight_file(run / "checkpoints" / "step-0000200", "raw")[0].name == "model.safetensors"
    (tmp_path / "empty").mkdir()
    with pytest.raises(Exception, match="--weights raw"):
        run_weight_file(tmp_path / "empty", "ema")


def test_every_flag_has_help():
    """Both parsers: no flag without help text."""
    from sample.__main__ import decode_parser, sample_parser
    for parser in (sample_parser(), decode_parser()):
        assert all(action.help for action in parser._actions), parser.prog


def test_grid_layout_rows_per_class_or_square():
    """Repeated labels -> one row per class (ragged rows padded); distinct labels -> near-square."""
    assert grid_layout([3, 7, 3, 7, 3]) == [[0, 2, 4], [1, 3, None]]
    assert grid_layout([0, 1, 2, 3, 4]) == [[0, 1, 2], [3, 4, None]]


# --------------------------------------------------------------------------------------------------------
# Bad input: one paragraph naming the fix, exit status 2
# --------------------------------------------------------------------------------------------------------

def test_missing_ckpt(files, tmp_path, capsys):
    """A --ckpt path that does not exist."""
    code, err = run_sample(["--ckpt", tmp_path / "nope.pt", "--vae", files["vae"], *STEPS], capsys)
    assert code == 2 and "does not exist" in err and "--ckpt" in err


@pytest.mark.parametrize("name", ["broken.pt", "broken.safetensors"])
def test_unreadable_ckpt(files, tmp_path, capsys, name):
    """Garbage bytes named .pt or .safetensors."""
    (tmp_path / name).write_bytes(b"\x00not a checkpoint" * 10)
    code, err = run_sample(["--ckpt", tmp_path / name, "--vae", files["vae"], *STEPS], capsys)
    assert code == 2 and "cannot read" in err and "truncated" in err


def test_state_dict_fitting_no_preset(files, tmp_path, capsys):
    """A DiT of a non-preset size: the message says what the weights are."""
    odd = DiT(input_size=8, patch_size=2, hidden_size=96, depth=3, num_heads=3, num_classes=NUM_CLASSES)
    torch.save(odd.state_dict(), tmp_path / "odd.pt")
    code, err = run_sample(["--ckpt", tmp_path / "odd.pt", "--vae", files["vae"], *STEPS], capsys)
    assert code == 2 and "depth 3, width 96, patch 2" in err and "match no preset" in err


def test_model_flag_contradicting_weights(files, capsys, tmp_path):
    """--model is checked against the shapes, never trusted over them."""
    code, err = run_sample(official(files, tmp_path / "o", "--model", "DiT-S/2"), capsys)
    assert code == 2 and "DiT-T/2" in err


def test_labels_out_of_range(files, tmp_path, capsys):
    """A label equal to num_classes (the null class) is refused before anything is written."""
    code, err = run_sample(official(files, tmp_path / "o", "--class-labels", 2, NUM_CLASSES), capsys)
    assert code == 2 and f"[{NUM_CLASSES}]" in err and f"0 to {NUM_CLASSES - 1}" in err
    assert not (tmp_path / "o").exists()


def test_vae_channel_mismatch(files, tmp_path, capsys):
    """An 8-channel VAE for a 4-channel model."""
    wide = make_tiny_vae(tmp_path / "vae8", latent_channels=8)
    code, err = run_sample(["--ckpt", files["pt"], "--vae", wide, "--out", tmp_path / "o", *STEPS], capsys)
    assert code == 2 and "latent channels 8 in this VAE, 4 for the latents" in err
    assert "--allow-other-vae does not apply" in err and not (tmp_path / "o").exists()


def test_image_size_flag_contradicting_weights(files, tmp_path, capsys):
    """--image-size must equal latent size x VAE factor."""
    code, err = run_sample(official(files, tmp_path / "o", "--image-size", 256), capsys)
    assert code == 2 and "--image-size 16" in err


def test_out_folder_of_another_run(files, tmp_path, capsys):
    """Another seed into the same --out is refused; more images with the same settings are not."""
    assert run_sample(official(files, tmp_path / "o", "--num-samples", 1), capsys)[0] == 0
    code, err = run_sample(official(files, tmp_path / "o", "--num-samples", 1, "--seed", 5), capsys)
    assert code == 2 and "another run" in err and "seed" in err and "new --out" in err
    # More images with the same settings extend the run instead.
    assert run_sample(official(files, tmp_path / "o", "--num-samples", 2), capsys)[0] == 0
    assert len(pngs(tmp_path / "o")) == 2


def test_guidance_on_model_without_null_class(files, tmp_path, capsys):
    """cfg > 1 needs a null-class row, which class_dropout_prob=0 models lack."""
    config = ModelConfig("DiT-T/2", input_size=8, num_classes=NUM_CLASSES, class_dropout_prob=0.0)
    save_weights(tmp_path / "nodrop.safetensors", config.build().state_dict(), config, space_of(files["meta"]), 1)
    code, err = run_sample(["--ckpt", tmp_path / "nodrop.safetensors", "--out", tmp_path / "o", *STEPS], capsys)
    assert code == 2 and "--cfg-scale 1" in err
