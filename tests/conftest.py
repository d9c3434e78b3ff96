"""Shared fixtures: tiny random VAEs saved with save_pretrained, tiny ImageFolder trees."""
import functools
import http.server
import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Keep CPU tests predictable on the 2-core CI machine. Under pytest-xdist (`-n 2`, PYTEST_XDIST_WORKER set) each
# worker and the subprocesses it starts take one thread: two workers of two threads each on two cores run many
# times slower than one (oversubscribed OpenMP spin-waits).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(min(2, os.cpu_count() or 1))


def make_tiny_vae(out_dir: Path, latent_channels: int = 4, levels: int = 2, seed: int = 0) -> Path:
    """Save a random AutoencoderKL (downsample factor 2**(levels-1)) into out_dir and return it."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    widths = tuple(8 * 2**i for i in range(levels))
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=widths,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=8,
        sample_size=32,
    )
    vae.save_pretrained(out_dir)
    return Path(out_dir)


@pytest.fixture(scope="session")
def tiny_vae_dir(tmp_path_factory) -> Path:
    """A tiny random AutoencoderKL folder: 4 latent channels, downsample factor 2."""
    return make_tiny_vae(tmp_path_factory.mktemp("vae") / "tiny-vae")


def make_tiny_dinov2(out_dir: Path, patch_size: int = 4, hidden_size: int = 16, image_size: int = 16,
                     seed: int = 0) -> Path:
    """Save a random transformers Dinov2Model (2 layers) into out_dir, as REPA's encoder, and return it."""
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(seed)
    config = Dinov2Config(hidden_size=hidden_size, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2,
                          patch_size=patch_size, image_size=image_size)
    Dinov2Model(config).save_pretrained(out_dir)
    return Path(out_dir)


@pytest.fixture(scope="session")
def tiny_dinov2_dir(tmp_path_factory) -> Path:
    """A tiny random DINOv2 folder: patch 4, 16 channels."""
    return make_tiny_dinov2(tmp_path_factory.mktemp("dinov2") / "tiny-dinov2")


def make_image_folder(root: Path, classes=("cat", "dog", "eel"), per_class: int = 3, size=(20, 24), seed: int = 0) -> Path:
    """Write an ImageFolder tree root/<class>/<i>.png of random RGB images and return root."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for name in classes:
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i:03d}.png")
    return root


@pytest.fixture
def image_folder(tmp_path) -> Path:
    """A 3-class ImageFolder with 3 random 20x24 PNGs per class."""
    return make_image_folder(tmp_path / "images")


@pytest.fixture(scope="module")
def private_digits_cache(tmp_path_factory):
    """The digits yardstick is fitted into a private cache folder (never the user's), once per session."""
    from evaluate import digits

    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.getbasetemp() / "evaluate-cache")
    digits._CACHE.clear()
    yield
    digits._CACHE.clear()
    if old is None:
        os.environ.pop("XDG_CACHE_HOME")
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture(scope="module")
def latents(tmp_path_factory) -> Path:
    """A finished latent folder of 32 synthetic 4x4x4 samples in 4 classes (tests.helpers.make_latents)."""
    from tests.helpers import make_latents

    return make_latents(tmp_path_factory.mktemp("latents") / "lat")


@pytest.fixture
def http_folder():
    """start(folder, handler) -> http://127.0.0.1:PORT serving `folder` from a thread with `handler` (a subclass of
    http.server's SimpleHTTPRequestHandler); every server is shut down after the test."""
    servers = []

    def start(folder: Path, handler=http.server.SimpleHTTPRequestHandler) -> str:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(folder)))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()
