"""The FID Inception-v3 in pure torch: the TF graph of 2015-12-05 that the ADM evaluator (and so DiT) measures with.

As pytorch-fid's port (torchvision's Inception3 with its FIDInception patches), written here since torchvision cannot
be imported beside the CPU torch: TF's padding-excluding average pools, a max pool in mixed_10, 1008 logits; input
resized by TF1's ResizeBilinear (no half-pixel centres), then (x - 128) / 128. Weights: pytorch-fid's file, layout and
sha256 prefix checked. Outputs as ADM: pool_3 (N, 2048); mixed_6/conv's first 7 channels in NHWC order (N, 2023);
logits = pool_3 @ W without the bias (N, 1008).
"""
from __future__ import annotations

import hashlib
import urllib.request
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from shared.runtime.errors import SettingError, UserError

WEIGHTS_NAME = "pt_inception-2015-12-05-6726825d.pth"
WEIGHTS_SHA256_PREFIX = "6726825d"  # torch hub's convention: the file name carries its hash's first 8 hex digits
WEIGHTS_URL = f"https://github.com/mseitzer/pytorch-fid/releases/download/fid_weights/{WEIGHTS_NAME}"
INPUT_SIZE = 299
NUM_LOGITS = 1008
POOL_DIM = 2048
SPATIAL_CHANNELS = 7  # ADM's sFID keeps mixed_6/conv[..., :7]
BN_EPS = 0.001        # TF's batch-norm epsilon in this graph (torchvision's BasicConv2d uses the same)


def _tf1_axis(in_size: int, out_size: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Source indices (lo, hi) and weights of hi along one axis for TF1 bilinear, align_corners=False."""
    src = torch.arange(out_size, device=device, dtype=torch.float64) * (in_size / out_size)  # TF1: no half-pixel offset
    lo = src.floor().long().clamp(max=in_size - 1)
    hi = (lo + 1).clamp(max=in_size - 1)
    return lo, hi, (src - lo).float()


def tf1_resize_bilinear(x: torch.Tensor, size: int) -> torch.Tensor:
    """Resize (N, C, H, W) to (N, C, size, size) as TF1 tf.image.resize_bilinear(align_corners=False)."""
    n, c, h, w = x.shape
    lo, hi, frac = _tf1_axis(h, size, x.device)
    x = x[:, :, lo, :] + (x[:, :, hi, :] - x[:, :, lo, :]) * frac[None, None, :, None]  # (N, C, size, W)
    lo, hi, frac = _tf1_axis(w, size, x.device)
    return x[:, :, :, lo] + (x[:, :, :, hi] - x[:, :, :, lo]) * frac[None, None, None, :]  # (N, C, size, size)


def preprocess(images: torch.Tensor, size: int = INPUT_SIZE) -> torch.Tensor:
    """uint8 (N, H, W, 3) -> float (N, 3, size, size): the graph's resize, then (x - 128) / 128."""
    x = images.permute(0, 3, 1, 2).float()  # (N, 3, H, W) in 0..255
    return (tf1_resize_bilinear(x, size) - 128.0) / 128.0


# ---- Blocks (names and shapes as torchvision's Inception3, so the pytorch-fid state dict loads as is) ----

class BasicConv2d(nn.Module):
    """Conv (no bias) -> BatchNorm (eps 0.001) -> ReLU."""
    def __init__(self, c_in: int, c_out: int, **conv):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, bias=False, **conv)
        self.bn = nn.BatchNorm2d(c_out, eps=BN_EPS)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


def tf_avg_pool(x: torch.Tensor) -> torch.Tensor:
    """3x3 stride-1 average pool whose border averages ignore the zero padding (TF's AvgPool with SAME)."""
    return F.avg_pool2d(x, kernel_size=3, stride=1, padding=1, count_include_pad=False)


class InceptionA(nn.Module):
    """35x35 block (mixed, mixed_1, mixed_2): 1x1, 5x5, double 3x3, TF-average-pooled 1x1."""
    def __init__(self, c_in: int, pool_features: int):
        super().__init__()
        self.branch1x1 = BasicConv2d(c_in, 64, kernel_size=1)
        self.branch5x5_1 = BasicConv2d(c_in, 48, kernel_size=1)
        self.branch5x5_2 = BasicConv2d(48, 64, kernel_size=5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(c_in, 64, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, kernel_size=3, padding=1)
        self.branch_pool = BasicConv2d(c_in, pool_features, kernel_size=1)

    def forward(self, x):
        b5 = self.branch5x5_2(self.branch5x5_1(x))
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([self.branch1x1(x), b5, b3, self.branch_pool(tf_avg_pool(x))], 1)


class InceptionB(nn.Module):
    """35 -> 17 reduction (mixed_3): strided 3x3, strided double 3x3, max pool."""
    def __init__(self, c_in: int):
        super().__init__()
        self.branch3x3 = BasicConv2d(c_in, 384, kernel_size=3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(c_in, 64, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, kernel_size=3, stride=2)

    def forward(self, x):
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([self.branch3x3(x), b3, F.max_pool2d(x, kernel_size=3, stride=2)], 1)


class InceptionC(nn.Module):
    """17x17 block (mixed_4..mixed_7): factorised 7x7 convolutions, TF-average-pooled 1x1."""
    def __init__(self, c_in: int, c7: int):
        super().__init__()
        self.branch1x1 = BasicConv2d(c_in, 192, kernel_size=1)
        self.branch7x7_1 = BasicConv2d(c_in, c7, kernel_size=1)
        self.branch7x7_2 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7_3 = BasicConv2d(c7, 192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = BasicConv2d(c_in, c7, kernel_size=1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = BasicConv2d(c7, 192, kernel_size=(1, 7), padding=(0, 3))
        self.branch_pool = BasicConv2d(c_in, 192, kernel_size=1)

    def forward(self, x):
        b7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        d = self.branch7x7dbl_3(self.branch7x7dbl_2(self.branch7x7dbl_1(x)))
        d = self.branch7x7dbl_5(self.branch7x7dbl_4(d))
        return torch.cat([self.branch1x1(x), b7, d, self.branch_pool(tf_avg_pool(x))], 1)


class InceptionD(nn.Module):
    """17 -> 8 reduction (mixed_8): strided 3x3, 7x7-then-strided-3x3, max pool."""
    def __init__(self, c_in: int):
        super().__init__()
        self.branch3x3_1 = BasicConv2d(c_in, 192, kernel_size=1)
        self.branch3x3_2 = BasicConv2d(192, 320, kernel_size=3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(c_in, 192, kernel_size=1)
        self.branch7x7x3_2 = BasicConv2d(192, 192, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(192, 192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(192, 192, kernel_size=3, stride=2)

    def forward(self, x):
        b3 = self.branch3x3_2(self.branch3x3_1(x))
        b7 = self.branch7x7x3_4(self.branch7x7x3_3(self.branch7x7x3_2(self.branch7x7x3_1(x))))
        return torch.cat([b3, b7, F.max_pool2d(x, kernel_size=3, stride=2)], 1)


class InceptionE(nn.Module):
    """8x8 block (mixed_9, mixed_10): split 1x3/3x1 branches; the pool branch TF-average or max (a 2015 graph quirk)."""
    def __init__(self, c_in: int, max_pool: bool):
        super().__init__()
        self.max_pool = max_pool
        self.branch1x1 = BasicConv2d(c_in, 320, kernel_size=1)
        self.branch3x3_1 = BasicConv2d(c_in, 384, kernel_size=1)
        self.branch3x3_2a = BasicConv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(c_in, 448, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(448, 384, kernel_size=3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch_pool = BasicConv2d(c_in, 192, kernel_size=1)

    def forward(self, x):
        b3 = self.branch3x3_1(x)
        b3 = torch.cat([self.branch3x3_2a(b3), self.branch3x3_2b(b3)], 1)
        d = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        d = torch.cat([self.branch3x3dbl_3a(d), self.branch3x3dbl_3b(d)], 1)
        pooled = F.max_pool2d(x, kernel_size=3, stride=1, padding=1) if self.max_pool else tf_avg_pool(x)
        return torch.cat([self.branch1x1(x), b3, d, self.branch_pool(pooled)], 1)


class FIDInceptionV3(nn.Module):
    """The FID Inception-v3: preprocessed (N, 3, 299, 299) -> pool (N, 2048), spatial (N, 2023), logits (N, 1008)."""
    def __init__(self):
        super().__init__()
        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, kernel_size=3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, kernel_size=3)
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, kernel_size=3, padding=1)
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, kernel_size=1)
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, kernel_size=3)
        self.Mixed_5b = InceptionA(192, pool_features=32)   # mixed
        self.Mixed_5c = InceptionA(256, pool_features=64)   # mixed_1
        self.Mixed_5d = InceptionA(288, pool_features=64)   # mixed_2
        self.Mixed_6a = InceptionB(288)                     # mixed_3
        self.Mixed_6b = InceptionC(768, c7=128)             # mixed_4
        self.Mixed_6c = InceptionC(768, c7=160)             # mixed_5
        self.Mixed_6d = InceptionC(768, c7=160)             # mixed_6: its 1x1 branch is sFID's mixed_6/conv
        self.Mixed_6e = InceptionC(768, c7=192)             # mixed_7
        self.Mixed_7a = InceptionD(768)                     # mixed_8
        self.Mixed_7b = InceptionE(1280, max_pool=False)    # mixed_9
        self.Mixed_7c = InceptionE(2048, max_pool=True)     # mixed_10
        self.fc = nn.Linear(POOL_DIM, NUM_LOGITS)           # softmax/logits (ADM uses its weight, not its bias)

    def forward(self, x: torch.Tensor) -> dict:
        """x (N, 3, S, S) normalised -> {"pool": (N, 2048), "spatial": (N, s*s*7), "logits": (N, 1008)}."""
        x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))
        x = F.max_pool2d(x, kernel_size=3, stride=2)         # (N, 64, 73, 73) at 299
        x = self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x))
        x = F.max_pool2d(x, kernel_size=3, stride=2)         # (N, 192, 35, 35)
        for block in (self.Mixed_5b, self.Mixed_5c, self.Mixed_5d, self.Mixed_6a, self.Mixed_6b, self.Mixed_6c):
            x = block(x)                                      # (N, 768, 17, 17) after Mixed_6a
        spatial = self.Mixed_6d.branch1x1(x)[:, :SPATIAL_CHANNELS]  # (N, 7, 17, 17): mixed_6/conv[..., :7]
        spatial = spatial.permute(0, 2, 3, 1).flatten(1)     # (N, 17*17*7) in TF's NHWC order, as ADM's mu_s
        for block in (self.Mixed_6d, self.Mixed_6e, self.Mixed_7a, self.Mixed_7b, self.Mixed_7c):
            x = block(x)                                      # (N, 2048, 8, 8) at the end
        pool = x.mean(dim=(2, 3))                             # pool_3: (N, 2048)
        logits = pool @ self.fc.weight.T                      # (N, 1008); no bias, as ADM
        return {"pool": pool, "spatial": spatial, "logits": logits}


def hub_checkpoints() -> Path:
    """torch hub's checkpoints folder ($TORCH_HOME/hub/checkpoints), where pytorch-fid itself caches the file."""
    return Path(torch.hub.get_dir()) / "checkpoints"


def missing_weights_text(path: Path, reason: str) -> str:
    """The one paragraph for weights that are neither given, cached, nor downloadable."""
    return (f"The FID Inception weights are not on this machine and could not be downloaded ({reason}). Download "
            f"{WEIGHTS_NAME} (pytorch-fid's port of the TF Inception graph of 2015-12-05, 91 MB) from {WEIGHTS_URL} "
            f"on a machine with internet access and either put it at {path} (found there automatically) or pass "
            f"--inception-weights FILE.")


def download_weights(path: Path, url: str | None = None, timeout: float = 30.0) -> Path:
    """Fetch the weights into `path` under a temp name, check the hash prefix, rename; UserError when offline."""
    from shared.runtime.fsio import atomic_write
    url = url or WEIGHTS_URL
    def fetch(tmp: Path) -> None:  # stream the URL into tmp, check its sha256 against the name's prefix
        digest = hashlib.sha256()
        with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, "wb") as f:
            for chunk in iter(lambda: response.read(1 << 20), b""):
                digest.update(chunk)
                f.write(chunk)
        if not digest.hexdigest().startswith(WEIGHTS_SHA256_PREFIX):
            raise UserError(f"the file downloaded from {url} has sha256 {digest.hexdigest()[:16]}..., not "
                            f"{WEIGHTS_SHA256_PREFIX}...: it is not {WEIGHTS_NAME} (a proxy page or a partial "
                            f"download). {missing_weights_text(path, 'bad download')}")
    print(f"downloading the FID Inception weights from {url} to {path}", flush=True)
    try:
        return atomic_write(path, fetch)
    except OSError as err:  # urllib's URLError and socket timeouts are OSErrors
        raise UserError(missing_weights_text(path, f"{type(err).__name__}: {getattr(err, 'reason', err)}")) from None


def resolve_weights(weights=None) -> Path:
    """--inception-weights FILE, else the torch hub cache, else a download into that cache."""
    if weights is not None:
        path = Path(weights)
        if not path.is_file():
            raise UserError(f"--inception-weights {path} does not exist; pass the path of {WEIGHTS_NAME} "
                            f"(download: {WEIGHTS_URL}).")
        return path
    path = hub_checkpoints() / WEIGHTS_NAME
    return path if path.is_file() else download_weights(path)


def file_sha256(path: Path) -> str:
    """The sha256 of a file, in hex."""
    from shared.datasets.integrity import sha256_file
    return sha256_file(path)


def load_inception(weights=None, device="cpu") -> FIDInceptionV3:
    """The FID Inception with its weights (weights-only load, layout and sha256 checked), in eval mode on `device`."""
    return load_checked_inception(resolve_weights(weights), device)[0]


def load_checked_inception(path: Path, device="cpu") -> tuple[FIDInceptionV3, str]:
    """(network, sha256) of the weights file at `path`: layout checked first (naming another network), then hash."""
    from shared.weights.export import load_torch_file
    try:
        state = load_torch_file(path, f"Pass {WEIGHTS_NAME} from {WEIGHTS_URL}.")
    except SettingError as err:
        raise UserError(str(err)) from None
    # the FID Inception's keys and shapes, else a UserError naming the differences
    expected = {k: v.shape for k, v in FIDInceptionV3().state_dict().items() if not k.endswith("num_batches_tracked")}
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{path} is not a state dict of tensors, so it is not {WEIGHTS_NAME}; pass pytorch-fid's "
                        f"FID Inception weights ({WEIGHTS_URL}).")
    state = {k: v for k, v in state.items() if not k.endswith("num_batches_tracked")}
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(expected) & set(state) if tuple(state[k].shape) != tuple(expected[k]))
    if missing or extra or wrong:
        facts = "; ".join(f"{label}: {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''} ({len(keys)})"
                          for label, keys in (("missing", missing), ("unexpected", extra), ("other shapes", wrong))
                          if keys)
        hint = (" torchvision's ImageNet inception_v3 weights (1000 classes, AuxLogits) are another network: FID needs "
                "the TF 2015-12-05 graph's weights." if any(k.startswith("AuxLogits") for k in extra) else "")
        raise UserError(f"{path} is not the FID Inception state dict ({facts}).{hint} Pass {WEIGHTS_NAME} from "
                        f"{WEIGHTS_URL}.")
    hexdigest = file_sha256(path)  # the released file's, whether given, cached or copied by hand
    if not hexdigest.startswith(WEIGHTS_SHA256_PREFIX):  # all that is published of the released file's sha256
        raise UserError(f"the Inception weights {path} have sha256 {hexdigest[:16]}..., not {WEIGHTS_SHA256_PREFIX}... "
                        f"(the hash pytorch-fid's {WEIGHTS_NAME} carries in its name): the tensors have the FID "
                        f"Inception's names and shapes but other values (another port or conversion, retrained or "
                        f"fine-tuned weights, or a damaged copy), so FID, sFID and IS from them would not be "
                        f"comparable to published numbers. Download {WEIGHTS_NAME} from {WEIGHTS_URL} (91 MB) where "
                        f"the network allows and pass it with --inception-weights FILE, or put it at "
                        f"{hub_checkpoints() / WEIGHTS_NAME}.")
    net = FIDInceptionV3()
    net.load_state_dict(state, strict=False)  # strict on everything but BN step counters
    return net.eval().to(device), hexdigest


class InceptionFeatures:
    """The FID Inception behind the feature-network interface (evaluate/evaluation.py build_features)."""
    name = "inception"
    outputs = ("pool", "spatial", "logits")

    def __init__(self, device="cpu", weights=None, input_size: int = INPUT_SIZE):
        self.path = resolve_weights(weights)
        self.device = torch.device(device)
        self.net, self._sha = load_checked_inception(self.path, self.device)
        self.input_size = input_size  # 299 for FID; tests use smaller inputs for speed

    def identity(self) -> dict:
        """Name, weights file and hash, input size: recorded with every result and statistics file."""
        return {"name": self.name, "weights": Path(self.path).name, "weights_sha256": self._sha[:16],
                "input_size": self.input_size, "resize": "tf1-bilinear"}

    @torch.no_grad()
    def __call__(self, images: np.ndarray) -> dict:
        """uint8 (b, H, W, 3) -> {"pool": (b, 2048), "spatial": (b, 2023), "logits": (b, 1008)} float32."""
        x = preprocess(torch.from_numpy(np.array(images, np.uint8)).to(self.device), self.input_size)
        return {k: v.float().cpu().numpy() for k, v in self.net(x).items()}
