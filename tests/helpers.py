"""Helpers several test modules share: the CLIs called in-process, tiny synthetic latents and runs, tiny DiTs.

Fixtures live in conftest.py; this module holds plain functions and constants, imported by name.
"""
import contextlib
import http.server
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from shared.network.models import DiT, DiT_models, ModelConfig
from shared.datasets.shards import ShardWriter, shard_name, write_index
from shared.tokenizers.tokenizer import LatentNorm
from shared.tokenizers.space import LatentSpace
from tests.conftest import ROOT
from train.__main__ import main as train_main


# ---------------------------------------------------------------------------------------------------------
# Any CLI in-process
# ---------------------------------------------------------------------------------------------------------

def run_main(main, argv, capsys=None) -> tuple[int, str, str]:
    """A CLI's main(argv) in-process -> (exit code, 0 on success; stdout; stderr joined into one line)."""
    try:
        main([str(a) for a in argv])
        code = 0
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr() if capsys is not None else None
    return code, captured.out if captured else "", " ".join(captured.err.split()) if captured else ""


def run_sample(argv, capsys=None) -> tuple[int, str]:
    """`python -m sample` in-process -> (exit code, stderr on one line)."""
    from sample.__main__ import main

    code, _, err = run_main(main, argv, capsys)
    return code, err


# ---------------------------------------------------------------------------------------------------------
# Training on tiny synthetic latents
# ---------------------------------------------------------------------------------------------------------

CLASSES = 4
LAUNCHER = [sys.executable, str(ROOT / "tests" / "train_launcher.py")]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(ROOT / "tests" / "train_launcher.py")]
CPU_DIST = {"ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}


def final_tensors(run: Path) -> dict:
    """Model, EMA and optimizer tensors of a run's newest checkpoint."""
    ckpt = run / "checkpoints" / checkpoints(run)[-1]
    out = {f"model.{k}": v for k, v in load_file(ckpt / "model.safetensors").items()}
    out.update({f"ema.{k}": v for k, v in load_file(ckpt / "ema.safetensors").items()})
    optim = torch.load(ckpt / "optimizer.pt", weights_only=True)
    for pid, state in optim["state"].items():
        out.update({f"opt.{pid}.{k}": v for k, v in state.items()})
    return out


MOMENTS_FP16 = {"mean": torch.float16, "std": torch.float16}  # the columns extract writes by default


def make_latents(root: Path, n=32, shape=(4, 4, 4), flips=2, per_shard=20, scaling_factor=0.5, image_size=8,
                 poison=False, seed=0, vae=None) -> Path:
    """A finished latent folder of class-dependent synthetic moments (shards + index.json); vae: extra VAE record keys."""
    root.mkdir(parents=True, exist_ok=True)
    rng, infos = np.random.default_rng(seed), []
    for first in range(0, n, per_shard):
        with ShardWriter(root / shard_name(first // per_shard), columns=MOMENTS_FP16) as writer:
            for i in range(first, min(n, first + per_shard)):
                mean = rng.normal(size=(flips, *shape)).astype(np.float32) * 0.5 + (i % CLASSES) - 1.5
                mean = np.full_like(mean, np.nan) if poison else mean
                writer.add(f"{i:06d}", {"mean": mean, "std": np.full_like(mean, 0.1)}, i % CLASSES)
        infos.append(writer.info)
    names = [f"c{c}" for c in range(CLASSES)]
    write_index(root, infos, {"image_size": image_size, "num_classes": CLASSES, "class_names": names,
                              "latent_space": write_space(root, shape, image_size, names, scaling_factor, vae=vae)})
    return root


def write_space(root: Path, shape, image_size: int, class_names, scaling_factor=1.0, source="synthetic",
                vae=None) -> str:
    """Write a latent folder's record of a synthetic VAE (its scale as its own norm) into root; its sha256."""
    vae = {"source": source, "scaling_factor": scaling_factor, "latent_channels": shape[0],
           "downsample_factor": image_size // shape[-1], **(vae or {})}
    norms = {"native": LatentNorm.scale_only(scaling_factor, source)}
    return LatentSpace(vae, shape, image_size, class_names, norms).write(root)


def copy_without_stats(folder: Path, copy: Path) -> dict:
    """Copy a latent folder with its space's statistics removed (as an older extract wrote it); return them."""
    import shutil

    from shared.datasets.shards import LatentDataset

    shutil.copytree(folder, copy)
    space = LatentDataset(copy, progress=False).space
    index = json.loads((copy / "index.json").read_text())
    index["latent_space"] = space.tokenizer_only().write(copy)
    (copy / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    return {name: norm for name, norm in space.norms.items() if name in ("channel", "element")}


def train_args(latents: Path, run: Path, *extra) -> list[str]:
    """Flags of a tiny CPU run (DiT-T/2 on 4x4x4 latents, batch 8)."""
    return ["--model", "DiT-T/2", "--latents", str(latents), "--results-dir", str(run), "--global-batch-size", "8",
            "--num-workers", "0", "--sample-every", "0", "--log-every", "1", *extra]


def run_inprocess(latents, run, *extra):
    """main() in this process; returns the run folder."""
    assert train_main(train_args(latents, run, *extra)) == 0
    return run


def expect_user_error(capsys, argv) -> str:
    """main(argv) must exit with status 2 and a one-paragraph message; returns it."""
    with pytest.raises(SystemExit) as info:
        train_main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "python -m train: error:" in err, err[-2000:]
    return " ".join(err[err.index("python -m train: error:"):].split())


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def cli(args, env_extra=None, **kw):
    """Start `python -m train` (or another launcher when args[0] is not a flag) as a real subprocess."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    cmd = [sys.executable, "-m", "train", *args] if args[0].startswith("--") else args
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def finish(proc) -> str:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return out


def wait_for(path: Path, proc, timeout=300):
    """Block until `path` exists (the launcher paused there); fail if the process ends first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the run ended before pausing: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"no {path} after {timeout} s"
        time.sleep(0.05)


def killed_and_resumed(latents: Path, tmp_path: Path, flags) -> tuple[dict, dict]:
    """(reference, resumed) final tensors: a run to --max-steps, and one killed -9 at its step-2 checkpoint, rerun."""
    reference, run, pauses = tmp_path / "reference", tmp_path / "run", tmp_path / "pause"
    finish(cli(train_args(latents, reference, *flags)))
    victim = cli(LAUNCHER + train_args(latents, run, *flags), {"TRACE_DIR": str(pauses), "PAUSE_AT": "checkpoint:2"})
    wait_for(pauses / "paused", victim)
    victim.kill()
    victim.communicate(timeout=60)
    assert victim.returncode == -9 and checkpoints(run) == ["step-0000002"]
    finish(cli(train_args(latents, run, *flags)))
    assert "resumed from" in (run / "log.txt").read_text()
    return final_tensors(reference), final_tensors(run)


def trace(folder: Path, rank=0) -> dict:
    return json.loads((folder / f"rank-{rank}.json").read_text())


# ---------------------------------------------------------------------------------------------------------
# Tiny DiTs
# ---------------------------------------------------------------------------------------------------------

NUM_CLASSES = 10  # classes of the sampling tests' random DiTs


def random_dit(config: ModelConfig, seed: int = 0) -> DiT:
    """A DiT whose zero-initialised (adaLN-Zero) layers are perturbed, so samples depend on the weights."""
    torch.manual_seed(seed)
    model = config.build()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return model


def pngs(folder: Path) -> dict:
    """Name -> bytes of every sample PNG in folder."""
    return {p.name: p.read_bytes() for p in sorted(folder.glob("0*.png"))}


def tiny(**kwargs):
    """DiT-T/2 cut to 2 blocks, on a 8x8x4 latent with 5 classes (kwargs override); keeps CPU tests fast."""
    args = dict(input_size=8, num_classes=5, depth=2)
    args.update(kwargs)
    return DiT_models["DiT-T/2"](**args)


def randomize(model, seed=0, scale=0.3):
    """Fill every parameter except the fixed pos_embed with random values (incl. zero-init ones)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "pos_embed":
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * scale)
    return model


def inputs(n=4, c=4, size=8, classes=5, seed=1, dtype=torch.float32):
    """Random latents, integer timesteps in [0, 1000) and labels."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, size, size, generator=gen, dtype=torch.float64).to(dtype)
    t = torch.randint(0, 1000, (n,), generator=gen)
    y = torch.randint(0, classes, (n,), generator=gen)
    return x, t, y


# ---------------------------------------------------------------------------------------------------------
# Releases served from 127.0.0.1 (no download leaves the machine)
# ---------------------------------------------------------------------------------------------------------

class FileServer(http.server.ThreadingHTTPServer):
    """Serves `files` (name -> bytes); `cut_next` > 0 sends only half the body of that many responses and closes."""

    daemon_threads = True

    def __init__(self, files: dict):
        super().__init__(("127.0.0.1", 0), Handler)
        self.files, self.cut_next, self.requests = files, 0, []


class Handler(http.server.BaseHTTPRequestHandler):
    """GET of a served name: a Content-Length announcing the whole file, then all of it (or half when cut)."""

    timeout = 10  # a stuck client cannot hold a server thread for longer

    def do_GET(self):  # noqa: N802 - http.server's name
        server = self.server
        server.requests.append(self.path)
        body = server.files.get(self.path.lstrip("/"))
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if server.cut_next > 0:
            server.cut_next -= 1
            self.wfile.write(body[:len(body) // 2])
            self.close_connection = True  # the connection drops mid-body
            return
        self.wfile.write(body)

    def log_message(self, *args):
        """Quiet: pytest shows the test's own output only."""


@contextlib.contextmanager
def serve_releases(files: dict, tmp_path, monkeypatch):
    """Serve `files` (name -> bytes) on 127.0.0.1 as the release URL base; download cache and cwd in tmp_path."""
    from shared.runtime.download import CACHE_ENV, URL_ENV

    httpd = FileServer(files)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    monkeypatch.setenv(URL_ENV, f"http://127.0.0.1:{httpd.server_address[1]}/")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # no release file of the same name in the working folder
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


def space_of(meta: dict):
    """The LatentSpace a test's run metadata describes ({"image_size", "latent_shape", "scaling_factor", "vae": the
    tokenizer identity dict or name, "class_names"}): the tokenizer's scale as its own norm and as what the DiT saw."""
    vae = meta.get("vae") or {}
    identity = dict(vae) if isinstance(vae, dict) else {"source": vae}
    shape, size = [int(n) for n in meta["latent_shape"]], int(meta.get("image_size") or 0)
    identity.setdefault("latent_channels", shape[0])
    if size:
        identity.setdefault("downsample_factor", size // shape[-1])
    if meta.get("scaling_factor") is not None:
        identity.setdefault("scaling_factor", float(meta["scaling_factor"]))
    native = identity.pop("norm", None)
    if native is None and identity.get("scaling_factor") is not None:
        native = LatentNorm.scale_only(identity["scaling_factor"], "the VAE's scaling_factor")
    norms = {"native": native} if native is not None else {}
    if meta.get("scaling_factor") is not None:
        norms["dit"] = LatentNorm.scale_only(float(meta["scaling_factor"]), "the run's scaling_factor")
    return LatentSpace(identity, shape, size, meta.get("class_names") or (), norms)
