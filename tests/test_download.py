"""--ckpt DiT-XL-2-256x256.pt by name: downloaded from a local HTTP server on 127.0.0.1 into the checkpoint cache
(temp name, then rename), an interrupted download, a truncated cached file, and no server at all."""
import socket
from pathlib import Path

import pytest
import torch

from sample.__main__ import main
from shared.runtime.download import URL_ENV
from shared.network.models import ModelConfig
from tests.helpers import run_main, serve_releases

NAME = "DiT-XL-2-256x256.pt"
STEPS = ["--num-sampling-steps", "2", "--cpu", "--num-samples", "2"]


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """A small checkpoint in the release's layout (a bare state dict of DiT-T/2, 10 classes) and its bytes."""
    root = tmp_path_factory.mktemp("release")
    torch.manual_seed(0)
    model = ModelConfig("DiT-T/2", input_size=8, num_classes=10).build()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    path = root / "original.pt"
    torch.save(model.state_dict(), path)
    return {"path": path, "bytes": path.read_bytes()}


@pytest.fixture
def server(release, tmp_path, monkeypatch):
    """The file server on 127.0.0.1 serving the release (shut down after the test); cache and cwd in tmp."""
    with serve_releases({NAME: release["bytes"]}, tmp_path, monkeypatch) as httpd:
        yield httpd


def sample_by_name(out: Path, vae: Path, capsys):
    """`python -m sample --ckpt DiT-XL-2-256x256.pt ...` (the name, no such file here)."""
    return run_main(main, ["--ckpt", NAME, "--vae", vae, "--out", out, *STEPS], capsys)


def pngs(folder: Path) -> dict:
    """Name -> bytes of every sample PNG."""
    return {p.name: p.read_bytes() for p in sorted(Path(folder).glob("0*.png"))}


def leftovers(folder: Path) -> list:
    """Temp files a download left in the cache."""
    return sorted(p.name for p in folder.glob(".tmp-*")) if folder.exists() else []


def test_download_by_name_then_cached(server, release, tiny_vae_dir, tmp_path, capsys):
    """First run downloads into the cache and samples; the second reads the cache; pixels = the original file's."""
    code, out, err = sample_by_name(tmp_path / "a", tiny_vae_dir, capsys)
    assert code == 0, err
    cached = tmp_path / "cache" / NAME
    assert cached.read_bytes() == release["bytes"] and leftovers(cached.parent) == []
    assert server.requests == [f"/{NAME}"] and "downloaded from http://127.0.0.1" in out
    code, out, err = sample_by_name(tmp_path / "b", tiny_vae_dir, capsys)
    assert code == 0, err
    assert server.requests == [f"/{NAME}"] and "read from the checkpoint cache" in out  # no second download
    code, _, err = run_main(main, ["--ckpt", release["path"], "--vae", tiny_vae_dir, "--out", tmp_path / "c", *STEPS], capsys)
    assert code == 0, err
    assert len(pngs(tmp_path / "a")) == 2 and pngs(tmp_path / "a") == pngs(tmp_path / "b") == pngs(tmp_path / "c")


def test_interrupted_download_leaves_nothing_and_rerun_succeeds(server, release, tiny_vae_dir, tmp_path, capsys):
    """The server closes mid-body: a clear error, no final file, no temp file; the same command then works."""
    server.cut_next = 1
    code, _, err = sample_by_name(tmp_path / "out", tiny_vae_dir, capsys)
    half = len(release["bytes"]) // 2
    assert code == 2 and f"stopped after {half:,} of {len(release['bytes']):,} bytes" in err
    assert "Rerun the same command" in err and "Traceback" not in err
    assert not (tmp_path / "cache" / NAME).exists() and leftovers(tmp_path / "cache") == []
    assert not (tmp_path / "out").exists()
    code, _, err = sample_by_name(tmp_path / "out", tiny_vae_dir, capsys)
    assert code == 0, err
    assert (tmp_path / "cache" / NAME).read_bytes() == release["bytes"] and len(pngs(tmp_path / "out")) == 2


def test_truncated_cached_file_is_fetched_again(server, release, tiny_vae_dir, tmp_path, capsys):
    """A cached copy cut short is detected (its zip directory is missing), deleted and downloaded again."""
    cached = tmp_path / "cache" / NAME
    cached.parent.mkdir(parents=True)
    cached.write_bytes(release["bytes"][: len(release["bytes"]) * 3 // 4])
    code, out, err = sample_by_name(tmp_path / "out", tiny_vae_dir, capsys)
    assert code == 0, err
    assert "is not a whole checkpoint" in out and "downloaded again" in out
    assert cached.read_bytes() == release["bytes"] and server.requests == [f"/{NAME}"]


def test_truncated_cached_file_while_offline(server, release, tiny_vae_dir, tmp_path, capsys, monkeypatch):
    """Truncated in the cache and the server unreachable: one paragraph with the URL and where to put the file."""
    cached = tmp_path / "cache" / NAME
    cached.parent.mkdir(parents=True)
    cached.write_bytes(release["bytes"][:1000])
    with socket.socket() as probe:  # a port on 127.0.0.1 where nothing listens
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    monkeypatch.setenv(URL_ENV, f"http://127.0.0.1:{dead}/")
    code, _, err = sample_by_name(tmp_path / "out", tiny_vae_dir, capsys)
    assert code == 2 and f"could not be downloaded from http://127.0.0.1:{dead}/{NAME}" in err
    assert "damaged cached copy was deleted" in err and f"put it at {cached}" in err and "Traceback" not in err
    assert not cached.exists() and server.requests == []


def test_release_folder_copy_is_used_without_download(server, release, tiny_vae_dir, tmp_path, capsys):
    """./pretrained_models/NAME (where the release's scripts download) is read as is."""
    (tmp_path / "pretrained_models").mkdir()
    (tmp_path / "pretrained_models" / NAME).write_bytes(release["bytes"])
    code, out, err = sample_by_name(tmp_path / "out", tiny_vae_dir, capsys)
    assert code == 0, err
    assert server.requests == [] and "pretrained_models" in out and not (tmp_path / "cache" / NAME).exists()


def test_sit_release_by_name_is_a_flow_model(release, tiny_vae_dir, tmp_path, monkeypatch, capsys):
    """SiT-XL-2-256x256.pt (DiT's layout) is recorded as a flow model: SiT's SDE by default, DDPM refused by name."""
    import json

    name = "SiT-XL-2-256x256.pt"
    with serve_releases({name: release["bytes"]}, tmp_path, monkeypatch) as httpd:
        code, _, err = run_main(main, ["--ckpt", name, "--vae", tiny_vae_dir, "--out", tmp_path / "ddpm", "--sampler", "ddpm",
                                *STEPS], capsys)
        assert code == 2 and "trained with the flow objective" in err and not (tmp_path / "ddpm").exists()
        code, out, err = run_main(main, ["--ckpt", name, "--vae", tiny_vae_dir, "--out", tmp_path / "o", *STEPS], capsys)
        assert code == 0, err
        settings = json.loads((tmp_path / "o" / "settings.json").read_text())
        identity = settings["identity"]
        assert identity["sampler"] == "sde" and identity["model"]["objective"] == "flow"
        assert "objective flow (the SiT (Ma et al. 2024) release)" in settings["run"]["notes"]
        code, _, err = run_main(main, ["--ckpt", name, "--vae", tiny_vae_dir, "--out", tmp_path / "x", "--objective", "ddpm",
                                *STEPS], capsys)
        assert code == 2 and "contradicts SiT-XL-2-256x256.pt" in err


def test_sit_release_under_its_url_file_name_is_recognised(release, tiny_vae_dir, tmp_path, monkeypatch, capsys):
    """`wget` of SiT's link writes SiT-XL-2-256.pt: as a file or as a name to download, it is SiT's flow model."""
    import json

    from shared.weights.official import RELEASES, url_file_name

    assert url_file_name(RELEASES["SiT-XL-2-256x256.pt"].url) == "SiT-XL-2-256.pt"
    with serve_releases({"SiT-XL-2-256x256.pt": release["bytes"]}, tmp_path, monkeypatch) as httpd:
        code, out, err = run_main(main, ["--ckpt", "SiT-XL-2-256.pt", "--vae", tiny_vae_dir, "--out", tmp_path / "n",
                                         *STEPS], capsys)  # no such file here: downloaded as the release
        assert code == 0, err
        assert httpd.requests == ["/SiT-XL-2-256x256.pt"] and (tmp_path / "cache" / "SiT-XL-2-256x256.pt").is_file()
        local = tmp_path / "SiT-XL-2-256.pt"
        local.write_bytes(release["bytes"])
        code, out, err = run_main(main, ["--ckpt", local, "--vae", tiny_vae_dir, "--out", tmp_path / "f", *STEPS], capsys)
        assert code == 0, err
        settings = json.loads((tmp_path / "f" / "settings.json").read_text())
        assert settings["identity"]["model"]["objective"] == "flow" and settings["identity"]["sampler"] == "sde"
        assert any("under the name its URL writes (ours: SiT-XL-2-256x256.pt)" in n for n in settings["run"]["notes"])
        assert settings["identity"]["guide_channels"] == "3"  # auto: SiT's sampler keeps DiT's 3-of-4 rule
        assert "records no objective" not in out


def test_unrecognised_bare_state_dict_says_which_objective_it_assumed(release, tiny_vae_dir, tmp_path, capsys):
    """A bare .pt of no known name or layout: sampled as DDPM, and one line says so and names --objective flow."""
    from shared.weights.official import release_name

    assert release_name("last.pt") is None and release_name("stage2_model.pt") is None  # generic URL names
    path = tmp_path / "renamed.pt"
    path.write_bytes(release["bytes"])
    code, out, err = run_main(main, ["--ckpt", path, "--vae", tiny_vae_dir, "--out", tmp_path / "a", *STEPS], capsys)
    assert code == 0, err
    lines = [line for line in out.splitlines() if "records no objective" in line]
    assert lines == ["note: renamed.pt records no objective and is no known release: sampled as DiT's ddpm objective "
                     "(noise prediction); if it was trained with flow matching (SiT), pass --objective flow."]
    code, out, err = run_main(main, ["--ckpt", path, "--vae", tiny_vae_dir, "--out", tmp_path / "b", "--objective",
                                     "flow", *STEPS], capsys)
    assert code == 0 and "records no objective" not in out
