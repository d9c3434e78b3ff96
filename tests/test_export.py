"""Slim weight files: exact round trip, rebuild from metadata, atomic writes, clear errors."""
import json

import pytest
import torch
from safetensors.torch import save_file

import shared.weights.export as tensorfiles
from shared.runtime.errors import UserError
from shared.weights.export import load_weights, save_weights
from shared.network.models import ModelConfig
from shared.tokenizers.space import LatentSpace
from tests.helpers import space_of

LATENT_META = {"image_size": 16, "scaling_factor": 0.5, "latent_shape": [4, 8, 8],
               "vae": {"source": "tiny", "config_sha256": "ab"}, "class_names": ["cat", "dog", "eel"]}
SPACE = space_of(LATENT_META)


@pytest.fixture(scope="module")
def trained():
    """A tiny DiT with non-trivial weights and its config."""
    config = ModelConfig(model="DiT-T/2", input_size=8, num_classes=3)
    torch.manual_seed(0)
    model = config.build()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval(), config


def test_round_trip_is_exact_and_rebuilds_the_model(tmp_path, trained):
    model, config = trained
    path = save_weights(tmp_path / "exports" / "ema-step-0000100.safetensors", model.state_dict(), config,
                        SPACE, 100)
    state_dict, config2, _, step = load_weights(path)
    assert (config2, LatentSpace.read_file(path), step) == (config, SPACE, 100)
    assert state_dict.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(state_dict[name], tensor), name
    rebuilt = config2.build()
    rebuilt.load_state_dict(state_dict, strict=True)
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([3, 900]), torch.tensor([0, 2])
    with torch.no_grad():
        assert torch.equal(rebuilt.eval()(x, t, y), model(x, t, y))
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp file left behind


def test_metadata_is_plain_json_strings(tmp_path, trained):
    model, config = trained
    path = save_weights(tmp_path / "w.safetensors", model.state_dict(), config.to_dict(), SPACE, 7)
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    assert set(metadata) == {"dit_config", "latent_space", "step"}
    assert json.loads(metadata["latent_space"])["sha256"] == SPACE.sha256
    assert json.loads(metadata["dit_config"]) == config.to_dict() and metadata["step"] == "7"
    with pytest.raises(UserError, match="unknown model preset"):
        bad = {"model": "DiT-Q/2", "input_size": 8}
        save_weights(tmp_path / "x.safetensors", model.state_dict(), bad, None, 0)
    assert not (tmp_path / "x.safetensors").exists()


def test_equal_content_gives_equal_bytes(tmp_path, trained):
    """Issue 38: safetensors writes its metadata in a random order per write; ours sorts it (and the JSON inside)."""
    import hashlib

    from shared.sampling.previews import write_preview

    model, config = trained
    metas = [space_of(LATENT_META), space_of(dict(reversed(LATENT_META.items())))]  # one record built in two orders
    digests, previews = set(), set()
    for i in range(8):
        path = save_weights(tmp_path / f"w{i}.safetensors", model.state_dict(), config, metas[i % 2], 7)
        digests.add(hashlib.sha256(path.read_bytes()).hexdigest())
        preview = write_preview(tmp_path / f"p{i}.safetensors", torch.ones(2, 4, 8, 8), torch.tensor([0, 2]),
                                metas[i % 2], 7)
        previews.add(hashlib.sha256(preview.read_bytes()).hexdigest())
    assert len(digests) == 1 and len(previews) == 1
    state_dict, config2, _, step = load_weights(tmp_path / "w1.safetensors")  # the rewritten header still reads
    assert (config2, LatentSpace.read_file(tmp_path / "w1.safetensors"), step) == (config, SPACE, 7)
    assert all(torch.equal(state_dict[k], v) for k, v in model.state_dict().items())
    header = (tmp_path / "w0.safetensors").read_bytes()
    assert header[8:70].startswith(b'{"__metadata__":{"dit_config":')


def test_views_and_shared_storage_are_saved(tmp_path):
    base = torch.arange(12.0).reshape(3, 4)
    state = {"a": base.t(), "b": base[1], "c": base}  # non-contiguous view and tensors sharing storage
    path = save_weights(tmp_path / "v.safetensors", state, ModelConfig("DiT-T/2", 8), None, 0)
    loaded, _, _, _ = load_weights(path)
    assert LatentSpace.read_file(path) is None and all(torch.equal(loaded[k], v) for k, v in state.items())


def test_overwrite_replaces_and_a_failed_write_keeps_the_old_file(tmp_path, trained, monkeypatch):
    model, config = trained
    path = tmp_path / "w.safetensors"
    save_weights(path, model.state_dict(), config, SPACE, 1)
    save_weights(path, model.state_dict(), config, SPACE, 2)
    assert load_weights(path)[3] == 2

    def crash(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(tensorfiles, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        save_weights(path, model.state_dict(), config, SPACE, 3)
    assert load_weights(path)[3] == 2  # the old file is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]


def test_missing_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_weights(tmp_path / "nope.safetensors")


@pytest.mark.parametrize("content", [b"", b"not a safetensors file" * 10])
def test_unreadable_file_is_a_user_error(tmp_path, content):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(UserError, match="cannot read"):
        load_weights(path)


def test_truncated_file_is_a_user_error(tmp_path, trained):
    model, config = trained
    path = save_weights(tmp_path / "w.safetensors", model.state_dict(), config, SPACE, 1)
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(UserError, match="cannot read"):
        load_weights(path)


def test_file_without_dit_config_is_a_user_error(tmp_path):
    path = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, str(path), metadata={"step": "3"})
    with pytest.raises(UserError, match="dit_config"):
        load_weights(path)
    save_file({"x": torch.zeros(2)}, str(path))  # no metadata at all
    with pytest.raises(UserError, match="dit_config"):
        load_weights(path)


def test_corrupt_metadata_is_a_user_error(tmp_path):
    path = tmp_path / "corrupt.safetensors"
    save_file({"x": torch.zeros(2)}, str(path), metadata={"dit_config": "{oops", "step": "1"})
    with pytest.raises(UserError, match="corrupt"):
        load_weights(path)


def test_run_layout_finds_newest_complete_checkpoint_and_export(tmp_path):
    """Steps sort numerically; a checkpoint folder without state.json (half-written) is ignored."""
    from shared.runtime.rundir import (CHECKPOINTS, STATE_FILE, export_path, latest_checkpoint, list_checkpoints,
                               list_exports, list_partial, staging_path, step_name)

    assert latest_checkpoint(tmp_path) is None and list_exports(tmp_path) == []
    for step in (900, 10000, 12000):
        folder = tmp_path / CHECKPOINTS / step_name(step)
        folder.mkdir(parents=True)
        if step != 12000:
            (folder / STATE_FILE).write_text("{}")
        export_path(tmp_path, step).parent.mkdir(exist_ok=True)
        export_path(tmp_path, step).write_bytes(b"")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-0000900", "step-0010000"]
    assert latest_checkpoint(tmp_path).name == "step-0010000"
    assert list_exports(tmp_path)[-1].name == "ema-step-0012000.safetensors"
    staging_path(tmp_path, 13000).mkdir()
    assert [p.name for p in list_partial(tmp_path)] == [".tmp-step-0013000"]
    assert latest_checkpoint(tmp_path).name == "step-0010000"  # a staging folder is never a checkpoint


# --------------------------------------------------------------------------------------------------------
# Checks every weight load needs
# --------------------------------------------------------------------------------------------------------

class _Evil:
    """A pickle that would call os.system if it were loaded without weights_only."""

    def __reduce__(self):
        import os
        return (os.system, ("echo PWNED",))


def test_load_torch_file_names_the_blocked_global_and_never_advises_unsafe_loading(tmp_path):
    from shared.runtime.errors import SettingError, advise
    from shared.weights.export import load_torch_file

    torch.save({"w": _Evil()}, tmp_path / "evil.pt")
    with pytest.raises(SettingError) as caught:
        load_torch_file(tmp_path / "evil.pt", "Pass another {vae}.")
    text = str(advise(caught.value, {"vae": "--vae"}))
    assert "tried to run code" in text and "`posix.system`" in text and "nothing in it was run" in text
    assert text.endswith("Pass another --vae.") and "weights_only=False" not in text and "False" not in text
    (tmp_path / "junk.pt").write_bytes(b"\x00junk" * 20)
    with pytest.raises(SettingError, match="cannot read .* as a PyTorch weight file .*truncated"):
        load_torch_file(tmp_path / "junk.pt", "")
    torch.save({"w": torch.ones(2)}, tmp_path / "ok.ckpt")
    assert torch.equal(load_torch_file(tmp_path / "ok.ckpt", "")["w"], torch.ones(2))


def test_safetensors_problem_and_nonfinite_tensors(tmp_path, trained):
    from shared.weights.export import safetensors_problem
    from shared.weights.checkpoint import nonfinite_tensors

    model, config = trained
    path = save_weights(tmp_path / "w.safetensors", model.state_dict(), config, SPACE, 1)
    assert safetensors_problem(path) is None
    path.write_bytes(path.read_bytes()[:-10])
    assert "incomplete" in safetensors_problem(path) or "header" in safetensors_problem(path)
    state = {"a": torch.ones(3), "i": torch.tensor([1, 2]), "b": torch.tensor([1.0, float("inf"), float("nan")])}
    assert list(nonfinite_tensors(state)) == [("b", 2, 3)]
    assert list(nonfinite_tensors({"a": torch.ones(2)})) == []
