"""The LatentSpace record: round trip, a hash stable across processes, its size at RAE's 768x16x16, files of an
earlier version refused, and a damaged record refused through the real train and sample commands."""
import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from extract.__main__ import main as extract_main
from sample.__main__ import main as sample_main
from shared.datasets.integrity import VERIFIED_NAME
from shared.datasets.shards import LatentDataset
from shared.network.models import ModelConfig
from shared.runtime.errors import UserError
from shared.weights.export import load_weights, save_weights
from shared.tokenizers.tokenizer import LatentNorm
from shared.tokenizers.locate import load_tokenizer
from shared.tokenizers.space import SPACE_JSON, SPACE_TENSORS, LatentSpace
from tests.conftest import make_image_folder
from tests.helpers import make_latents, run_main, train_args
from train.__main__ import main as train_main
from train.config import _data_mismatch, data_identity

RAE_SHAPE = (768, 16, 16)
LIMIT = 64 * 1024  # issue 35: the largest JSON written per checkpoint, RAE included


def rae_space(seed: int = 0) -> LatentSpace:
    """A run's space at RAE's real size: per-element "dit" and "native" statistics, 1,000 ImageNet-like names."""
    g = torch.Generator().manual_seed(seed)
    element = LatentNorm.element(torch.randn(*RAE_SHAPE, generator=g), torch.rand(*RAE_SHAPE, generator=g) + 0.5)
    identity = {"source": "rae-dinov2-b", "class": "AutoencoderRAE", "family": "rae", "deterministic": True,
                "latent_channels": 768, "downsample_factor": 16, "config_sha256": "c" * 64}
    names = [f"n{i:08d}, a class name of ImageNet length" for i in range(1000)]
    return LatentSpace(identity, RAE_SHAPE, 256, names, {"dit": element, "native": element})


# ---------------------------------------------------------------------------------------------------------
# The record
# ---------------------------------------------------------------------------------------------------------

def test_folder_round_trip_is_exact(tmp_path):
    space = rae_space()
    sha = space.write(tmp_path)
    back = LatentSpace.read(tmp_path, sha, "rebuild")
    assert back == space and back.sha256 == sha and back.norm == space.norm and back.class_names == space.class_names
    assert torch.equal(back.norm.mean, space.norm.mean) and back.norm.mean.dtype == torch.float32
    assert back.tokenizer == space.tokenizer and back.latent_shape == RAE_SHAPE and back.image_size == 256


def test_hash_is_the_same_in_another_process_and_ignores_message_words():
    code = ("from tests.test_latent_space_record import rae_space; print(rae_space().sha256)")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    space = rae_space()
    assert other == space.sha256
    reworded = LatentSpace(space.tokenizer, space.latent_shape, space.image_size, space.class_names,
                           {k: LatentNorm(n.kind, n.mean, n.std, n.scale, "other words") for k, n in space.norms.items()})
    assert reworded.sha256 == space.sha256  # sources are for messages
    changed = LatentSpace(space.tokenizer, space.latent_shape, space.image_size, space.class_names,
                          {**space.norms, "dit": LatentNorm.element(space.norm.mean, space.norm.std, 0.5)})
    assert changed.sha256 != space.sha256 and rae_space(seed=1).sha256 != space.sha256


def test_an_rae_checkpoint_writes_no_json_over_64_kib(tmp_path):
    """The record's JSON, a weight file's whole header and a preview's at 768x16x16, against the issue's limit."""
    from shared.sampling.previews import write_preview

    space = rae_space()
    assert len(space.text().encode()) <= LIMIT
    config = ModelConfig("DiT-T/2", input_size=16, in_channels=8)
    path = save_weights(tmp_path / "ema.safetensors", config.build().state_dict(), config, space, 3)
    preview = write_preview(tmp_path / "p.safetensors", torch.zeros(2, *RAE_SHAPE), torch.tensor([0, 1]), space, 3)
    for written in (path, preview):
        header = int.from_bytes(written.read_bytes()[:8], "little")  # the safetensors header: all of its JSON
        assert header <= LIMIT, (written, header)
    assert LatentSpace.read_file(path) == space and "latent_space.dit.mean" not in load_weights(path)[0]
    assert load_file(path)["latent_space.dit.mean"].shape == RAE_SHAPE


# ---------------------------------------------------------------------------------------------------------
# Files an earlier version wrote: refused in one paragraph naming the rebuild, never read as "no space"
# ---------------------------------------------------------------------------------------------------------

OLD_META = {"image_size": 16, "latent_shape": [4, 8, 8], "class_names": ["a", "b", "c"],
            "vae": {"source": "tiny", "class": "AutoencoderKL", "scaling_factor": 0.25}}


def test_an_export_of_an_earlier_version_is_refused_not_read_as_spaceless(tmp_path, capsys):
    config = ModelConfig("DiT-T/2", input_size=8, in_channels=4, num_classes=3)
    metadata = {"dit_config": json.dumps(config.to_dict()), "latents": json.dumps(OLD_META), "step": "5"}
    save_file(config.build().state_dict(), str(tmp_path / "old.safetensors"), metadata=metadata)
    with pytest.raises(UserError, match="written by an earlier version"):
        LatentSpace.read_file(tmp_path / "old.safetensors")
    code, _, err = run_main(sample_main, ["--ckpt", tmp_path / "old.safetensors", "--cpu", "--num-samples", 1,
                                          "--out", tmp_path / "out"], capsys)
    assert code == 2 and "written by an earlier version" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_a_folder_of_an_earlier_version_is_refused_and_extract_stats_makes_it_current(extracted, tmp_path, capsys):
    folder = shutil.copytree(extracted, tmp_path / "lat")
    index = json.loads((folder / "index.json").read_text())
    del index["latent_space"]  # what an index.json written before the record holds
    (folder / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    run = tmp_path / "run"
    code, _, err = run_main(train_main, train_args(folder, run, "--max-steps", "1"), capsys)
    assert code == 2 and "earlier version" in err and f"`python -m extract --stats --out {folder}`" in err, err
    assert not (run / "checkpoints").exists()
    code, _, err = run_main(extract_main, ["--stats", "--out", folder], capsys)  # the command the paragraph names
    assert code == 0, err
    assert LatentDataset(folder, progress=False).space == LatentDataset(extracted, progress=False).space


def test_a_checkpoint_from_before_the_record_is_refused_on_resume(tmp_path):
    dataset = LatentDataset(make_latents(tmp_path / "lat", n=8), progress=False)
    space = dataset.space.for_run(LatentNorm.scale_only(0.5))
    now = data_identity(dataset, space)
    assert _data_mismatch(now, now, space) is None
    old = {k: v for k, v in now.items() if k != "latent_space"}
    assert "start a fresh run" in _data_mismatch(old, now, space)


# ---------------------------------------------------------------------------------------------------------
# Bad input: a damaged record, through the real commands
# ---------------------------------------------------------------------------------------------------------

def _truncate(path):
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


def _edit_json(path):
    record = json.loads(path.read_text())
    record["norms"]["native"]["scale"] = 0.3  # a hand edit that keeps the file valid JSON
    path.write_text(json.dumps(record, indent=1))


DAMAGE = {"missing": lambda folder: (folder / SPACE_JSON).unlink(),
          "truncated": lambda folder: _truncate(folder / SPACE_TENSORS),
          "edited": lambda folder: _edit_json(folder / SPACE_JSON)}
WORDS = {"missing": "is missing", "truncated": "truncated", "edited": "edited by hand"}


@pytest.fixture(scope="module")
def extracted(tmp_path_factory, tiny_vae_dir):
    root = tmp_path_factory.mktemp("space")
    images = make_image_folder(root / "imgs", per_class=2, size=(16, 16))
    code, _, err = run_main(extract_main, ["--data-path", images, "--out", root / "lat", "--vae", tiny_vae_dir,
                                           "--image-size", 16, "--num-workers", 0])
    assert code == 0, err
    return root / "lat"


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_train_refuses_a_folder_whose_record_is_damaged_and_extract_stats_rebuilds_it(extracted, tmp_path, capsys,
                                                                                     damage):
    folder = shutil.copytree(extracted, tmp_path / "lat")
    index = (folder / "index.json").read_bytes()
    DAMAGE[damage](folder)
    kept = {p.name: p.read_bytes() for p in folder.iterdir() if p.name != VERIFIED_NAME}  # the hash cache may change
    run = tmp_path / "run"
    code, _, err = run_main(train_main, train_args(folder, run, "--max-steps", "1", "--model", "DiT-T/2"), capsys)
    assert code == 2 and WORDS[damage] in err and f"`python -m extract --stats --out {folder}`" in err, err
    assert "Traceback" not in err and err.count("the latent-space record") == 1
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.name != VERIFIED_NAME} == kept and not (run / "checkpoints").exists()
    code, out, err = run_main(extract_main, ["--stats", "--out", folder], capsys)  # the command the paragraph names
    assert code == 0, err
    assert LatentDataset(folder, progress=False).space == LatentDataset(extracted, progress=False).space
    assert (folder / "index.json").read_bytes() == index


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_vae_dir):
    """A run folder with one export whose space is a real tiny VAE's."""
    run = tmp_path_factory.mktemp("runs") / "run"
    config = ModelConfig("DiT-T/2", input_size=8, in_channels=4, num_classes=3)
    vae = load_tokenizer(tiny_vae_dir)
    space = LatentSpace.of_tokenizer(vae, 16, (4, 8, 8), ["a", "b", "c"]).for_run(vae.norm)
    save_weights(run / "exports" / "ema-step-0000002.safetensors", config.build().state_dict(), config, space, 2)
    return run


def _rewrite_metadata(path, change):
    """Write the weight file again with its metadata changed by `change(metadata) -> metadata`."""
    with safe_open(str(path), framework="pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(path), metadata=change(dict(metadata)))


def _edited_export(metadata):
    record = json.loads(metadata["latent_space"])
    record["norms"]["dit"]["scale"] = 0.3
    return {**metadata, "latent_space": json.dumps(record)}


EXPORT_DAMAGE = {"missing": lambda m: {k: v for k, v in m.items() if k != "latent_space"},
                 "truncated": lambda m: {**m, "latent_space": m["latent_space"][:200]},
                 "edited": _edited_export}


@pytest.mark.parametrize("damage", sorted(EXPORT_DAMAGE))
def test_sample_refuses_a_run_whose_record_is_damaged(run_dir, tiny_vae_dir, tmp_path, capsys, damage):
    run = shutil.copytree(run_dir, tmp_path / "run")
    export = run / "exports" / "ema-step-0000002.safetensors"
    _rewrite_metadata(export, EXPORT_DAMAGE[damage])
    kept = export.read_bytes()
    out = tmp_path / "samples"
    code, _, err = run_main(sample_main, ["--ckpt", run, "--vae", tiny_vae_dir, "--num-samples", 2,
                                          "--num-sampling-steps", 2, "--out", out, "--cpu"], capsys)
    assert code == 2 and WORDS[damage] in err and str(export) in err and "python -m train" in err, err
    assert "Traceback" not in err and not out.exists() and export.read_bytes() == kept


@pytest.mark.parametrize("streamed", [False, True])
def test_a_folder_read_from_a_url_brings_its_record(tmp_path, monkeypatch, http_folder, capsys, streamed):
    """A copied or streamed --latents URL fetches latent_space.json and .safetensors with the index."""
    from train import latents as remote

    folder = make_latents(tmp_path / "lat", n=8)
    assert run_main(extract_main, ["--stats", "--out", folder])[0] == 0  # the older folder gets its record
    monkeypatch.setenv(remote.CACHE_ENV, str(tmp_path / "cache"))
    limit = ["--cache-limit", str(10 ** 7)] if streamed else []
    code, _, err = run_main(train_main, train_args(http_folder(folder), tmp_path / "run", "--max-steps", "1",
                                                   *limit), capsys)
    assert code == 0, err
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    local = LatentDataset(folder, progress=False).space
    assert config["data"]["latent_space"] == local.for_run(local.native).sha256
