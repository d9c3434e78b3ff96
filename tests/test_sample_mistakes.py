"""Issue 11 for sample/: every everyday mistake ends in the right result or one paragraph, through the real CLI.

Tiny DiT-T/2 (latent 4x8x8, or 8x8x8) + tiny VAEs (x2) -> 16x16 PNGs; real folders and files on disk.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests import small_disk
from tests.conftest import ROOT, make_tiny_vae
from shared.sampling.previews import write_preview
from tests.helpers import pngs, random_dit, run_sample, space_of
from shared.weights.export import save_weights
from shared.network.models import ModelConfig
from shared.tokenizers.locate import load_tokenizer

NAMES = ["cat", "Dog", "sea eel", "ant", "bee"]
STEPS = ["--num-sampling-steps", "2", "--cpu"]


def _meta(vae_dir, channels=4, names=NAMES):
    """Latent metadata as training records it for latents made by the VAE in vae_dir."""
    vae = load_tokenizer(vae_dir)
    return {"image_size": 16, "scaling_factor": vae.scaling_factor, "latent_shape": [channels, 8, 8],
            "vae": vae.identity, "class_names": list(names)}


def _copy_vae(src: Path, dst: Path, **config_changes) -> Path:
    """A copy of a VAE folder with some config.json entries changed (weights untouched)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(config_changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_vae_dir):
    """A run folder (two exports, one checkpoint) of a 5-class model whose latents carry class names."""
    root = tmp_path_factory.mktemp("mistakes")
    config = ModelConfig("DiT-T/2", input_size=8, in_channels=4, num_classes=len(NAMES))
    state = random_dit(config).state_dict()
    meta = _meta(tiny_vae_dir)
    folder = root / "run"
    for step in (100, 200):
        save_weights(folder / "exports" / f"ema-step-{step:07d}.safetensors", state, config, space_of(meta), step)
    ckpt = folder / "checkpoints" / "step-0000200"
    save_weights(ckpt / "model.safetensors", state, config, space_of(meta), 200)
    save_weights(ckpt / "ema.safetensors", state, config, space_of(meta), 200)
    (ckpt / "state.json").write_text('{"step": 200}')
    torch.save(state, root / "official.pt")
    return {"root": root, "run": folder, "config": config, "state": state, "meta": meta, "vae": tiny_vae_dir,
            "pt": root / "official.pt"}


def _sample(run, out, *extra, ckpt=None):
    """argv sampling `ckpt` (default: the run folder) into out."""
    return ["--ckpt", ckpt or run["run"], "--out", out, "--num-samples", 2, *STEPS, *extra]


def says(err: str, text) -> bool:
    """Whether the wrapped message contains text (whitespace ignored: exit_with wraps lines between words)."""
    return "".join(str(text).split()) in "".join(err.split())


def _settings(out: Path) -> dict:
    return json.loads((out / "settings.json").read_text())


def _copy_run(run, dst: Path) -> Path:
    """A private copy of the run folder (tests that damage files)."""
    return Path(shutil.copytree(run["run"], dst))


# --------------------------------------------------------------------------------------------------------
# Item 4: a different VAE
# --------------------------------------------------------------------------------------------------------

def test_vae_with_other_scaling_factor_is_refused_unless_allowed(run, tmp_path, capsys):
    """Both VAEs named, the difference said; --allow-other-vae decodes and says so in the log and settings."""
    other = _copy_vae(run["vae"], tmp_path / "other-vae", scaling_factor=0.5)
    code, err = run_sample(_sample(run, tmp_path / "o", "--vae", other), capsys)
    assert code == 2 and says(err, other.resolve()) and says(err, Path(run["vae"]).resolve())
    assert "scaling factor 0.5 in this VAE" in err and "--allow-other-vae" in err
    assert not (tmp_path / "o").exists()
    code, err = run_sample(_sample(run, tmp_path / "o", "--vae", other, "--allow-other-vae"), capsys)
    assert code == 0, err
    assert len(pngs(tmp_path / "o")) == 2
    assert any("--allow-other-vae" in n for n in _settings(tmp_path / "o")["run"]["notes"])


def test_vae_with_other_config_hash_is_refused(run, tmp_path, capsys):
    """Same channels, factor and scale but another config: refused after loading, before any file is written."""
    other = _copy_vae(run["vae"], tmp_path / "v2", sample_size=64)
    code, err = run_sample(_sample(run, tmp_path / "o", "--vae", other), capsys)
    assert code == 2 and "config hash" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_vae_with_other_downsample_factor_is_refused_even_when_allowed(run, tmp_path, capsys):
    """A x4 VAE for x2 latents would give images of the wrong size: no flag overrides that."""
    deeper = make_tiny_vae(tmp_path / "x4", levels=3)
    code, err = run_sample(_sample(run, tmp_path / "o", "--vae", deeper, "--allow-other-vae"), capsys)
    assert code == 2 and "downsample factor 4 in this VAE, 2 for the latents" in err
    assert "--allow-other-vae does not apply" in err


def test_decode_with_other_vae_is_refused(run, tmp_path, capsys):
    """`sample decode` checks the preview file's recorded VAE the same way."""
    path = _preview(tmp_path / "run" / "samples", 100, run["meta"])
    other = _copy_vae(run["vae"], tmp_path / "other", scaling_factor=0.5)
    code, err = run_sample(["decode", path, "--cpu", "--vae", other], capsys)
    assert code == 2 and "scaling factor 0.5" in err and "--allow-other-vae" in err
    assert run_sample(["decode", path, "--cpu", "--vae", other, "--allow-other-vae"], capsys)[0] == 0


# --------------------------------------------------------------------------------------------------------
# Item 5: non-finite weights
# --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["export", "official"])
def test_nonfinite_weights_are_refused_at_load(run, tmp_path, capsys, kind):
    """NaN in an export, inf in an official .pt: the file and the first bad tensor are named."""
    state = {k: v.clone() for k, v in run["state"].items()}
    name = list(state)[3]
    state[name].view(-1)[:2] = float("nan") if kind == "export" else float("inf")
    if kind == "export":
        path = save_weights(tmp_path / "bad.safetensors", state, run["config"], space_of(run["meta"]), 7)
    else:
        path = tmp_path / "bad.pt"
        torch.save(state, path)
    code, err = run_sample(_sample(run, tmp_path / "o", "--vae", run["vae"], ckpt=path), capsys)
    assert code == 2 and says(err, path) and f"tensor {name} has 2 NaN/inf values" in err
    assert "black or noise images" in err and not (tmp_path / "o").exists()


# --------------------------------------------------------------------------------------------------------
# Item 6: --weights
# --------------------------------------------------------------------------------------------------------

def test_weights_raw_for_an_export_file_is_refused(run, tmp_path, capsys):
    code, err = run_sample(_sample(run, tmp_path / "o", "--weights", "raw",
                                ckpt=run["run"] / "exports" / "ema-step-0000200.safetensors"), capsys)
    assert code == 2 and "holds only the EMA weights" in err and "--weights raw" in err
    code, err = run_sample(_sample(run, tmp_path / "o", "--weights", "raw", "--vae", run["vae"], ckpt=run["pt"]),
                        capsys)
    assert code == 2 and "bare state dict" in err and not (tmp_path / "o").exists()


@pytest.mark.parametrize("ckpt, asked, recorded", [
    ("run", None, "ema"), ("run", "raw", "raw"), ("model", None, "raw"), ("pt", None, "as saved")])
def test_settings_record_the_weights_actually_loaded(run, tmp_path, capsys, ckpt, asked, recorded):
    path = {"run": run["run"], "model": run["run"] / "checkpoints" / "step-0000200" / "model.safetensors",
            "pt": run["pt"]}[ckpt]
    extra = (["--weights", asked] if asked else []) + (["--vae", run["vae"]] if ckpt == "pt" else [])
    code, err = run_sample(_sample(run, tmp_path / "o", *extra, ckpt=path), capsys)
    assert code == 0, err
    assert _settings(tmp_path / "o")["identity"]["weights"] == recorded


# --------------------------------------------------------------------------------------------------------
# Item 7: the 3-channel guidance quirk
# --------------------------------------------------------------------------------------------------------

def test_guidance_rule_follows_the_weights_and_the_latent_channels(run, tmp_path, capsys):
    """auto is what the weights' own sampler does: all 4 for this project's runs (as their training previews),
    3 of 4 for a bare DiT-layout .pt (the DiT release's sampler); 8 channels: all, and '3' is refused."""
    from train.config import TrainConfig

    code, err = run_sample(_sample(run, tmp_path / "four"), capsys)
    assert code == 0, err
    assert _settings(tmp_path / "four")["identity"]["guide_channels"] == "all"
    assert TrainConfig.sample_guide_channels == "all"  # the previews of the same run: the same channels
    code, err = run_sample(_sample(run, tmp_path / "pt", "--vae", run["vae"], ckpt=run["pt"]), capsys)
    assert code == 0, err
    assert _settings(tmp_path / "pt")["identity"]["guide_channels"] == "3"
    assert "first 3 of 4 latent channels (auto: the DiT release's sampler" in _settings(tmp_path / "pt")["run"]["guidance"]
    wide_vae = make_tiny_vae(tmp_path / "vae8", latent_channels=8)
    config = ModelConfig("DiT-T/2", input_size=8, in_channels=8, num_classes=len(NAMES))
    path = save_weights(tmp_path / "wide.safetensors", random_dit(config).state_dict(), config,
                        space_of(_meta(wide_vae, channels=8)), 1)
    code, err = run_sample(_sample(run, tmp_path / "eight", ckpt=path), capsys)
    assert code == 0, err
    settings = _settings(tmp_path / "eight")
    assert settings["identity"]["guide_channels"] == "all"
    assert settings["run"]["guidance"].startswith("guidance: cfg scale 4 on all 8 latent channels")
    code, err = run_sample(_sample(run, tmp_path / "three", "--guide-channels", "3", ckpt=path), capsys)
    assert code == 2 and "--guide-channels 3 is the DiT release's quirk for 4-channel latents" in err


def test_guidance_rule_is_printed(run, tmp_path, capsys):
    code = run_sample(_sample(run, tmp_path / "o"), None)[0]
    out = capsys.readouterr().out
    assert code == 0 and "guidance: cfg scale 4 on all 4 latent channels (auto: trained by this project" in out
    code = run_sample(_sample(run, tmp_path / "q", "--guide-channels", "3"), None)[0]
    out = capsys.readouterr().out
    assert code == 0 and "guidance: cfg scale 4 on the first 3 of 4 latent channels (as asked" in out


# --------------------------------------------------------------------------------------------------------
# Tracebacks: broken VAE folders, malicious pickles, decode --out FILE
# --------------------------------------------------------------------------------------------------------

def test_vae_folder_with_missing_tensors_or_weights(run, tmp_path, capsys):
    from safetensors.torch import load_file

    broken = Path(shutil.copytree(run["vae"], tmp_path / "missing"))
    weights = broken / "diffusion_pytorch_model.safetensors"
    state = load_file(weights)
    save_file({k: v for k, v in state.items() if k != "decoder.conv_in.bias"}, weights)
    code, err = run_sample(_sample(run, tmp_path / "o", "--vae", broken), capsys)
    assert code == 2 and "decoder.conv_in.bias" in err and "does not fit its config.json" in err
    assert "TRAIN this model" not in err
    weights.unlink()
    code, err = run_sample(_sample(run, tmp_path / "o", "--vae", broken), capsys)
    assert code == 2 and "no weights (diffusion_pytorch_model.safetensors" in err
    mixed = Path(shutil.copytree(run["vae"], tmp_path / "mixed"))
    wide = make_tiny_vae(tmp_path / "wide", latent_channels=8)
    shutil.copy(wide / "diffusion_pytorch_model.safetensors", mixed)
    code, err = run_sample(_sample(run, tmp_path / "o", "--vae", mixed), capsys)
    assert code == 2 and "expected shape" in err and "same VAE" in err and "overwrite" not in err


def _evil(path: Path) -> Path:
    """A .pt/.ckpt whose pickle calls os.system when loaded without weights_only."""
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo PWNED",))

    torch.save({"state_dict": Evil()}, path)
    return path


@pytest.mark.parametrize("where", ["vae", "ckpt"])
def test_malicious_pickle_is_refused_naming_the_global(run, tmp_path, where):
    """As a VAE .ckpt or as --ckpt: refused, the global named, no traceback, torch's unsafe advice not repeated."""
    evil = _evil(tmp_path / ("vae.ckpt" if where == "vae" else "model.pt"))
    if where == "vae":
        shutil.copy(Path(run["vae"]) / "config.json", tmp_path / "config.json")
        argv = _sample(run, tmp_path / "o", "--vae", evil)
    else:
        argv = _sample(run, tmp_path / "o", "--vae", run["vae"], ckpt=evil)
    result = subprocess.run([sys.executable, "-m", "sample", *map(str, argv)], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    err = " ".join(result.stderr.split())
    assert result.returncode == 2 and "Traceback" not in result.stderr and "PWNED" not in result.stdout
    assert "tried to run code" in err and "posix.system" in err and "nothing in it was run" in err
    assert "weights_only=False" not in err and "weights_only` set to `False" not in err


def test_ckpt_file_is_read_as_pytorch(run, tmp_path, capsys):
    shutil.copy(run["pt"], tmp_path / "official.ckpt")
    code, err = run_sample(_sample(run, tmp_path / "o", "--vae", run["vae"], ckpt=tmp_path / "official.ckpt"), capsys)
    assert code == 0, err


@pytest.mark.parametrize("out", ["existing-file", "grid.png"])
def test_decode_and_sample_out_that_is_a_file(run, tmp_path, capsys, out):
    path = _preview(tmp_path / "samples", 100, run["meta"])
    target = tmp_path / out
    if out == "existing-file":
        target.write_text("keep me")
    for argv in (["decode", path, "--cpu", "--out", target], _sample(run, target)):
        code, err = run_sample(argv, capsys)
        assert code == 2 and "writes a folder" in err and "pass a folder path to --out" in err
    assert not target.exists() or target.read_text() == "keep me"


# --------------------------------------------------------------------------------------------------------
# A truncated newest export
# --------------------------------------------------------------------------------------------------------

def test_truncated_newest_export_falls_back_saying_so(run, tmp_path, capsys):
    folder = _copy_run(run, tmp_path / "run")
    newest = folder / "exports" / "ema-step-0000200.safetensors"
    newest.write_bytes(newest.read_bytes()[:5000])
    code, err = run_sample(_sample(run, tmp_path / "o", ckpt=folder), None)
    out = capsys.readouterr().out
    assert code == 0
    assert f"note: the newer {newest} is not a whole weight file" in out and "sampling ema-step-0000100" in out
    assert f"pass --ckpt {folder / 'checkpoints' / 'step-0000200'}" in out
    assert _settings(tmp_path / "o")["identity"]["ckpt"].endswith("ema-step-0000100.safetensors")
    (folder / "exports" / "ema-step-0000100.safetensors").write_bytes(b"\x00" * 10)
    code, err = run_sample(_sample(run, tmp_path / "o2", ckpt=folder), capsys)
    assert code == 2 and "no whole exports/ema-step-*.safetensors" in err
    assert says(err, f"pass --ckpt {folder / 'checkpoints' / 'step-0000200'}") and "re-export" not in err.lower()


# --------------------------------------------------------------------------------------------------------
# decode DIR
# --------------------------------------------------------------------------------------------------------

def _preview(folder: Path, step: int, meta: dict, labels=(1, 3)) -> Path:
    """A RUN/samples/step-*.safetensors preview file as training writes it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step:07d}.safetensors"
    write_preview(path, torch.randn(len(labels), 4, 8, 8), torch.tensor(labels), space_of(meta), step)
    return path


def test_decode_refuses_a_preview_whose_tensor_contradicts_its_metadata(run, tmp_path, capsys):
    """Metadata saying 4 channels over an 8-channel tensor: one paragraph, not a traceback from the VAE."""
    path = tmp_path / "step-0000001.safetensors"
    write_preview(path, torch.randn(2, 8, 8, 8), torch.tensor([1, 3]), space_of(run["meta"]), 1)
    code, err = run_sample(["decode", path, "--cpu", "--vae", run["vae"]], capsys)
    assert code == 2 and says(err, f"{path} holds latents of shape (8, 8, 8) but its metadata describes (4, 8, 8)")


def test_decode_folder_newest_or_all(run, tmp_path, capsys):
    samples = tmp_path / "run" / "samples"
    for step in (100, 900, 1000):
        _preview(samples, step, run["meta"])
    assert run_sample(["decode", samples, "--cpu"], capsys)[0] == 0
    assert sorted(p.name for p in samples.iterdir() if p.is_dir()) == ["step-0001000"]
    assert sorted(pngs(samples / "step-0001000")) == ["000000-class1-Dog.png", "000001-class3-ant.png"]
    assert run_sample(["decode", tmp_path / "run", "--cpu", "--all", "--out", tmp_path / "all"], capsys)[0] == 0
    assert sorted(p.name for p in (tmp_path / "all").iterdir()) == ["step-0000100", "step-0000900", "step-0001000"]
    assert (tmp_path / "all" / "step-0000900" / "grid.png").exists()
    (tmp_path / "empty").mkdir()
    code, err = run_sample(["decode", tmp_path / "empty", "--cpu"], capsys)
    assert code == 2 and "holds no preview files" in err


# --------------------------------------------------------------------------------------------------------
# Aliases and class names
# --------------------------------------------------------------------------------------------------------

def test_official_flag_names_are_aliases(run, tmp_path, capsys):
    official = ["--ckpt", run["run"], "--sample-dir", tmp_path / "a", "--num-fid-samples", 3, "--global-seed", 4,
                "--per-proc-batch-size", 2, *STEPS]
    ours = ["--ckpt", run["run"], "--out", tmp_path / "b", "--num-samples", 3, "--seed", 4, "--batch-size", 2, *STEPS]
    assert run_sample(official, capsys)[0] == 0 and run_sample(ours, capsys)[0] == 0
    assert pngs(tmp_path / "a") == pngs(tmp_path / "b") and len(pngs(tmp_path / "a")) == 3
    assert _settings(tmp_path / "a")["run"]["batch_size"] == 2 and _settings(tmp_path / "a")["identity"]["seed"] == 4


def test_class_labels_by_name(run, tmp_path, capsys):
    """Exact, then case-insensitive; names sanitised into the file names; an unknown name lists valid ones."""
    code, err = run_sample(_sample(run, tmp_path / "o", "--class-labels", "cat", "dog", "Sea EEL", "4"), capsys)
    assert code == 0, err
    assert sorted(pngs(tmp_path / "o")) == ["000000-class0-cat.png", "000001-class1-Dog.png"]
    assert _settings(tmp_path / "o")["identity"]["labels"] == "cycled over [0, 1, 2, 4]"
    code, err = run_sample(_sample(run, tmp_path / "p", "--class-labels", "cat", "--num-samples", 1), capsys)
    assert code == 0
    code, err = run_sample(_sample(run, tmp_path / "q", "--class-labels", "zebra"), capsys)
    assert code == 2 and "'zebra' is not a class name" in err and "'cat'" in err and "0 to 4" in err
    code, err = run_sample(_sample(run, tmp_path / "q", "--class-labels", "cat", "--vae", run["vae"], ckpt=run["pt"]),
                        capsys)
    assert code == 2 and "record no class names" in err


def test_sea_eel_file_name_is_sanitised(run, tmp_path, capsys):
    code, err = run_sample(_sample(run, tmp_path / "o", "--class-labels", "sea eel", "--num-samples", 1), capsys)
    assert code == 0, err
    assert sorted(pngs(tmp_path / "o")) == ["000000-class2-sea_eel.png"]


# --------------------------------------------------------------------------------------------------------
# -h, settings, permissions
# --------------------------------------------------------------------------------------------------------

def test_help_shows_every_default_and_the_decode_command():
    from sample.__main__ import decode_parser, sample_parser
    from shared.runtime.cli import HelpFormatter
    for parser in (sample_parser(), decode_parser()):
        formatter = HelpFormatter(parser.prog)
        for action in parser._actions:
            if action.option_strings and action.dest != "help" and not action.required:
                assert "default" in formatter._get_help_string(action).lower(), (parser.prog, action.dest)
    text = sample_parser().format_help()
    assert "python -m sample decode LATENTS|DIR" in text and "--global-seed" in text


def test_settings_are_written_not_printed_with_real_device_and_files_follow_umask(run, tmp_path):
    """A real process under umask 002: the settings go to settings.json and one summary line to stdout (no JSON),
    device and TF32 recorded, no 0600 files."""
    out = tmp_path / "o"
    argv = [sys.executable, "-m", "sample", *map(str, _sample(run, out, "--npz"))]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                            preexec_fn=lambda: os.umask(0o002))
    assert result.returncode == 0, result.stderr
    assert '"identity"' not in result.stdout and "{" not in result.stdout, result.stdout
    summary = [line for line in result.stdout.splitlines() if line.endswith(f"(all settings and notes: "
                                                                             f"{out / 'settings.json'})")]
    assert len(summary) == 1 and " steps, cfg " in summary[0], result.stdout
    assert len(result.stdout.splitlines()) <= 4, result.stdout  # guidance, summary, "wrote ...": no settings dump
    settings = _settings(out)
    assert settings["run"]["device"] == "cpu" and "not used" in settings["run"]["tf32"]
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir() if p.name != ".lock"}
    assert set(modes.values()) == {0o664}, modes


# --------------------------------------------------------------------------------------------------------
# The lock and a full disk
# --------------------------------------------------------------------------------------------------------

def _holder_pid(out: Path, timeout: float = 120.0) -> int:
    """Wait until a process holds out/.lock and return its PID."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return json.loads((out / ".lock").read_text())["pid"]
        except (OSError, ValueError, KeyError):
            time.sleep(0.2)
    raise AssertionError(f"no process took {out}/.lock")


@pytest.mark.slow
def test_second_launch_on_the_same_out_exits_naming_the_pid(run, tmp_path, capsys, monkeypatch):
    """The second launch is refused by the lock before it builds a model or draws an image (observed: the model
    builder is never called and the holder's folder is untouched), whatever the machine's load."""
    import shared.sampling.generate as generate
    from sample.__main__ import main
    from tests.helpers import run_main

    out = tmp_path / "o"
    # Many images and all 1000 steps keep the first process busy while the second starts.
    busy = ["--ckpt", run["run"], "--out", out, "--num-samples", 64, "--batch-size", 64,
            "--num-sampling-steps", 1000, "--cpu"]
    # The holder runs at the lowest priority on one thread: busy, yet the second launch is not starved of the CPU.
    first = subprocess.Popen([sys.executable, "-m", "sample", *map(str, busy)], cwd=ROOT,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=lambda: os.nice(19),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pid = _holder_pid(out)
        assert pid == first.pid
        deadline = time.monotonic() + 120  # the holder writes settings.json just after taking the lock
        while not (out / "settings.json").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        written = (out / "settings.json").stat().st_mtime_ns
        built = []

        def build_recorded(*args, **kwargs):
            """The model builder, observed: a launch that gets past the lock would call it."""
            built.append(args)
            raise AssertionError("the second launch built a model")

        monkeypatch.setattr(generate, "build_sampling_model", build_recorded)
        code, stdout, err = run_main(main, busy, capsys)  # this process is the second launch: flock sees the first
        assert first.poll() is None, "the first run ended before the second was refused; make it busier"
        assert code == 2 and "Traceback" not in err and says(err, f"--out {out} is in use by another process: PID {pid}")
        assert built == [] and "sampling (rank" not in err and "all settings and notes" not in stdout
        assert (out / "settings.json").stat().st_mtime_ns == written  # the holder's settings were not rewritten
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    from shared.runtime.lock import hold_lock
    hold_lock(out, "sample folder").release()  # the OS dropped the killed holder's lock


@pytest.mark.slow
@pytest.mark.skipif(not small_disk.available(), reason="needs unshare + an unprivileged tmpfs mount (Linux)")
def test_full_disk_is_one_paragraph_and_the_rerun_continues(run, tmp_path):
    """--out on a 64 KiB tmpfs: exit 2 naming the disk, no traceback; grown to 8 MiB, the rerun keeps and adds."""
    mount = tmp_path / "mnt"
    argv = [sys.executable, "-m", "sample", *map(str, ["--ckpt", run["run"], "--out", mount / "s", "--num-samples", 40,
                                                      "--batch-size", 8, *STEPS])]
    full, rerun = small_disk.run(mount, [(64, argv), (8192, argv)], tmp_path / "logs", tmp_path / "keep",
                                 dict(os.environ), ROOT)
    err1 = " ".join(full.stderr.split())
    assert full.returncode == 2, err1
    assert "Traceback" not in err1 and "no space left on the disk holding" in err1 and "rerun the same command" in err1
    first = [n for n in full.files if n.startswith("s/") and n.endswith(".png") and n[2].isdigit()]
    assert 0 < len(first) < 40 and not [n for n in full.files if ".tmp-" in n]
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert len(pngs(tmp_path / "keep" / "s")) == 40 and (tmp_path / "keep" / "s" / "grid.png").exists()
    left = 40 - len(first)
    assert f"{left}/{left}" in rerun.stderr  # the rerun drew only the images the full disk had stopped


def test_runtime_facts_on_cuda_record_the_gpu_and_tf32(monkeypatch):
    """On a GPU, settings.json names the card and the TF32 state set_tf32 left in force (no GPU needed here)."""
    from shared.sampling.generate import runtime_facts
    from shared.runtime.precision import set_tf32

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32  # flags, settable without a GPU
    try:
        for allowed, state in ((True, "on"), (False, "off")):
            set_tf32("cuda:0", allowed)
            assert runtime_facts("cuda:0") == {"device": "cuda:0 (NVIDIA Test GPU)", "tf32": state}
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
