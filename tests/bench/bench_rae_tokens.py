"""RAE tokens on the CPU: what extraction stores per image and how fast it runs, through the real `python -m extract`.

Run: python tests/bench/bench_rae_tokens.py [--images 16] [--threads 1] [--skip-b]

Two random AutoencoderRAE folders (diffusers' own class, save_pretrained; random weights cost what trained ones do):
  tiny      tests/tiny_tokenizers.py's RAE: 1-layer width-64 encoder, 64x4x4 tokens of 32 px images
  dinov2-b  DINOv2-B with registers as RAE uses it (12 layers, width 768, patch 14 at 224 px: 768x16x16 tokens of
            256 px images) with a 1-block decoder (extraction never runs the decoder)
Each is extracted in bf16 without flips (RAE trains without them) from a random ImageFolder; printed per tokenizer:
the extraction's own rate line (decode + resize + encode + write, the model load excluded), the payload bytes per
image from index.json's tensor shapes and dtype, and the shard bytes per image (tar headers included). Numbers
depend on the machine and its load; the bytes do not.
"""
import argparse
import contextlib
import io
import json
import re
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from extract.__main__ import main as extract_main  # noqa: E402
from tests.conftest import make_image_folder  # noqa: E402
from tests.tiny_tokenizers import rae  # noqa: E402

DINOV2_B = dict(encoder_hidden_size=768, encoder_patch_size=14, encoder_num_hidden_layers=12, encoder_input_size=224,
                decoder_hidden_size=64, decoder_num_hidden_layers=1, decoder_num_attention_heads=2,
                decoder_intermediate_size=128, patch_size=16)
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=16, help="images in the random ImageFolder (per tokenizer)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--skip-b", action="store_true", help="only the tiny RAE (the DINOv2-B one takes a minute)")
    return p.parse_args(argv)


def extract(images: Path, vae: Path, out: Path, size: int) -> tuple[float, str]:
    """Run python -m extract (bf16, no flips); return its images/s and its dry-run storage line."""
    common = [str(a) for a in ("--data-path", images, "--out", out, "--vae", vae, "--image-size", size,
                               "--num-workers", 0, "--batch-size", 8, "--dtype", "bf16", "--flip", "none")]
    lines = []
    for extra in (["--dry-run"], []):
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            try:
                extract_main(common + extra)
            except SystemExit as stop:
                if stop.code:
                    raise
        lines.append(buffer.getvalue())
    storage = next(line for line in lines[0].splitlines() if line.startswith("storage: moments"))
    return float(re.search(r"\(([\d.]+) images/s", lines[1]).group(1)), storage


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rows = [("tiny", rae(tmp / "tiny", stats=False), 32)]
        if not args.skip_b:
            rows.append(("dinov2-b", rae(tmp / "dinov2-b", stats=False, **DINOV2_B), 256))
        for name, vae, size in rows:
            per_class = -(-args.images // 3)
            images = make_image_folder(tmp / f"images-{size}", per_class=per_class, size=(size + size // 8, size))
            out = tmp / f"latents-{name}"
            rate, storage = extract(images, vae, out, size)
            index = json.loads((out / "index.json").read_text())
            n = sum(s["num_samples"] for s in index["shards"])
            payload = sum(BYTES[t["dtype"]] * int(torch.tensor(t["shape"]).prod()) for t in index["tensors"])
            tar = sum((out / s["name"]).stat().st_size for s in index["shards"]) / n
            shape = index["tensors"][0]["shape"]
            print(f"{name:9s} tokens {'x'.join(map(str, shape[1:]))} at {size} px: {rate:7.2f} images/s "
                  f"({args.threads} thread(s)); payload {payload:,} bytes/image (bf16, 1 flip); shards "
                  f"{tar:,.0f} bytes/image; {n} images\n          dry run: {storage}")


if __name__ == "__main__":
    main()
