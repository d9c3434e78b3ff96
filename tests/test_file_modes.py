"""Every file the stages write follows the umask (issue 38.6): exports, checkpoints and latent indexes alike
readable by the group when the umask says so, as a plain open() would make them."""
import os
import stat

import pytest

from tests.helpers import make_latents, run_inprocess

UMASK = 0o027  # group may read, others nothing: neither the 0600 of a private file nor the 0644 default


@pytest.fixture
def umask():
    """Run the test under UMASK, restoring the process's own afterwards."""
    saved = os.umask(UMASK)
    try:
        yield UMASK
    finally:
        os.umask(saved)


def _modes(root) -> dict:
    """Relative path -> permission bits of every regular file below root."""
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode)
            for p in root.rglob("*") if p.is_file() and not p.is_symlink()}


def test_latents_checkpoints_and_exports_follow_the_umask(tmp_path, umask):
    latents = make_latents(tmp_path / "latents", n=16)  # shards, arrays and index.json by the real writers
    run = run_inprocess(latents, tmp_path / "run", "--max-steps", "2", "--ckpt-every", "2")
    expected = 0o666 & ~umask
    files = {**{f"latents/{k}": v for k, v in _modes(latents).items()},
             **{f"run/{k}": v for k, v in _modes(run).items()}}
    assert any(k.endswith("index.json") for k in files)
    assert any("exports/" in k and k.endswith(".safetensors") for k in files)
    assert any("checkpoints/" in k for k in files)
    wrong = {k: oct(v) for k, v in files.items() if v != expected}
    assert wrong == {}, f"expected {oct(expected)} for every file"


def test_atomic_write_reads_the_umask_without_changing_it(tmp_path, umask):
    from safetensors.torch import save_file
    import torch

    from shared.runtime.fsio import atomic_write, current_umask

    assert current_umask() == umask
    path = atomic_write(tmp_path / "w.safetensors", lambda tmp: save_file({"x": torch.zeros(2)}, str(tmp)))
    assert stat.S_IMODE(path.stat().st_mode) == 0o640 and current_umask() == umask
