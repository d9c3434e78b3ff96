"""Released checkpoints by name (`--ckpt DiT-XL-2-256x256.pt`): each Release records what its bare file cannot say
(objective, paper, latents, sampling); a file is recognised by its name here or the one its URL writes (`wget` of
SiT's link saves SiT-XL-2-256.pt). Looked for as given, in ./pretrained_models/, in shared/runtime/download.py's
cache, else downloaded there from the release's URL ($DIT_DOWNLOAD_URL/NAME replaces them all: a mirror).
"""
from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from shared.generative.flow import auto_shift
from shared.generative.objectives import DEFAULT_OBJECTIVE
from shared.runtime.download import fetch, release_url

BASE_URL = "https://dl.fbaipublicfiles.com/DiT/models/"
HF_RAE = "https://huggingface.co/nyu-visionx/RAE-collections/resolve/main/"  # RAE's README: hf download this repo
RAE_SHIFT = auto_shift((768, 16, 16))  # --time-dist-shift auto of RAE's DINOv2-B tokens
# How each release samples for its paper's FID, in python -m sample's flag names (ModelConfig.sampling; a flag still
# wins). RAE's and REPA's apply to any file of their layouts; DiT's and SiT's are sample's defaults.
# RAE (bytetriper/RAE configs/stage2/sampling/ImageNet256/DiTDHXL-DINOv2-B.yaml, FID 1.51): `sampler: mode ODE,
# sampling_method euler, num_steps 50`: torchdiffeq's Euler over 50 grid points = 49 steps, on the grid shifted by
# time_dist_shift (the objective's); guidance `cfg scale 1.0, t-min 0, t-max 1`: none, so no interval is recorded.
RAE_SAMPLING = {"sampler": "euler", "num_sampling_steps": 49}
RAE_CFG_SCALE = 1.0  # its FID's guidance scale: a flag (as LightningDiT's), printed when the weights load
# REPA (its README's FID 1.42 command: --mode sde --num-steps 250 --cfg-scale 1.8 --guidance-high 0.7): SiT's
# SDE, 250 steps, guidance only at noise levels 0..0.7 (applies only with a --cfg-scale above 1).
REPA_SAMPLING = {"sampler": "sde", "num_sampling_steps": 250, "cfg_interval": [0.0, 0.7]}
REPA_CFG_SCALE = 1.8


@dataclass(frozen=True)
class Release:
    """A released checkpoint: where it downloads from, and what its bare state dict cannot say."""

    url: str
    objective: str = DEFAULT_OBJECTIVE
    paper: str = "DiT (Peebles & Xie 2023)"
    latent_meta: dict | None = None  # what the bare file cannot say about its latents (None: SD-VAE's, DiT's)
    layout: str = "dit"  # "lightningdit": its own record in shared/weights/checkpoint.py's FORMATS
    time_dist_shift: float = 1.0  # RAE's shift of the times (shared/generative/flow.py), recorded with the model
    sampling: dict | None = None  # how the release samples for its FID (ModelConfig.sampling), where not by layout
    cfg_scale: float | None = None  # its FID's guidance scale: a flag, printed when the weights load


RELEASES = {
    "DiT-XL-2-256x256.pt": Release(BASE_URL + "DiT-XL-2-256x256.pt"),
    "DiT-XL-2-512x512.pt": Release(BASE_URL + "DiT-XL-2-512x512.pt"),
    # SiT's README link (its download.py); DiT-XL/2's layout with 8 output channels, of which SiT uses the first 4.
    "SiT-XL-2-256x256.pt": Release("https://www.dl.dropboxusercontent.com/scl/fi/as9oeomcbub47de5g4be0/SiT-XL-2-256.pt"
                                   "?rlkey=uxzxmpicu46coq3msb17b9ofa&dl=0", objective="flow",
                                   paper="SiT (Ma et al. 2024)"),
    # REPA's README / utils.download_model: a SiT-XL/2 with its projector, time 0 = data.
    "REPA-SiT-XL-2-256x256.pt": Release("https://www.dl.dropboxusercontent.com/scl/fi/cxedbs4da5ugjq5wg3zrg/last.pt"
                                        "?rlkey=8otgrdkno0nd89po3dpwngwcc&st=apcc645o&dl=0", objective="flow",
                                        paper="REPA (Yu et al. 2024)"),
    # RAE's DiT^DH-XL on DINOv2-B (registers) tokens, ImageNet 256 (the path its DiTDHXL-DINOv2-B.yaml loads): flow in
    # RAE's time (1 = noise, REPA's convention), shift sqrt(768 * 16 * 16 / 4096); decoded by RAE's decoder.
    "RAE-DiTDH-XL-DINOv2-B-256.pt": Release(HF_RAE + "DiTs/Dinov2/wReg_base/ImageNet256/DiTDH-XL/stage2_model.pt",
                                            objective="flow", paper="RAE (Zheng et al. 2025)",
                                            time_dist_shift=RAE_SHIFT),
}
# LightningDiT's releases (hustvl/LightningDiT, MIT; its README's links): LightningDiT-XL/1 on VA-VAE f16d32 latents
# (32x16x16 at 256 px, its latents_stats.pt normalisation), SiT's flow (0 = noise). Sampled as its
# configs/reproductions/*.yaml: Euler, 250 steps, shift 0.3, guidance where its time is at least 0.125 (800 epochs,
# FID 1.35 at scale 6.7) or 0.10 (64 epochs, FID 2.11 at scale 10), i.e. our noise levels 0 .. 1 - start.
_HF = "https://huggingface.co/hustvl/{0}/resolve/main/{0}.pt"
_VAVAE_LATENTS = {"vae": "vavae", "image_size": 256, "latent_shape": [32, 16, 16]}
for _name, _start, _scale in (("lightningdit-xl-imagenet256-800ep.pt", 0.125, 6.7),
                               ("lightningdit-xl-imagenet256-64ep.pt", 0.10, 10.0)):
    RELEASES[_name] = Release(
        _HF.format(_name.removesuffix(".pt")), objective="flow", paper="LightningDiT (Yao et al. 2025)",
        latent_meta=_VAVAE_LATENTS, layout="lightningdit", cfg_scale=_scale,
        sampling={"sampler": "euler", "time_shift": 0.3, "cfg_interval": [0.0, round(1.0 - _start, 6)]})
OFFICIAL_NAMES = tuple(RELEASES)
# Names REPA's and RAE's URLs write that any run may write: those files are recognised by their layouts instead.
GENERIC_NAMES = ("last.pt", "stage2_model.pt")


def url_file_name(url: str) -> str:
    """The file name `wget URL` writes: the last segment of the URL's path (its query dropped)."""
    return Path(urllib.parse.urlparse(url).path).name


# Each release also under the name its URL writes (SiT's link saves SiT-XL-2-256.pt), unless that is generic.
URL_NAMES = {url_file_name(r.url): name for name, r in RELEASES.items()
             if url_file_name(r.url) not in RELEASES and url_file_name(r.url) not in GENERIC_NAMES}


def release_name(file_name: str) -> str | None:
    """The release a file name identifies (its name here, or the one its URL writes), else None."""
    return file_name if file_name in RELEASES else URL_NAMES.get(file_name)


RELEASE_DIR = "pretrained_models"  # the release's scripts download into ./pretrained_models/


def is_official_name(text: str) -> bool:
    """Whether --ckpt is the bare file name of a released checkpoint (ours or its URL's)."""
    return release_name(str(text)) is not None


def checkpoint_url(name: str) -> str:
    """The release's URL of `name` ($DIT_DOWNLOAD_URL/NAME when that is set)."""
    name = release_name(name) or name  # a release under its URL's file name downloads as itself
    return release_url(name, RELEASES[name].url if name in RELEASES else BASE_URL + name)


def find_official(name: str) -> tuple[Path, list[str]]:
    """(path, notes) of a released checkpoint: ./pretrained_models/, else the cache, else downloaded into it."""
    for local in dict.fromkeys((name, release_name(name))):  # as asked, then under the release's name here
        release = Path(RELEASE_DIR) / local
        if release.is_file():
            return release, [f"{local} found in ./{RELEASE_DIR}/ (where the DiT release's scripts put it)"]
    name = release_name(name)  # the cache and the download use the release's name here
    return fetch(name, checkpoint_url(name), f"or in ./{RELEASE_DIR}/, or pass its path as --ckpt")
