"""`python -m extract --check`: validate a source without a VAE (counts, first image, bad files)."""
from __future__ import annotations

from tqdm import tqdm

from shared.datasets.duplicates import apply_duplicates
from shared.datasets.imagefolder import ImageFolderScan
from shared.datasets.sources import SourceOptions, describe_source, open_source
from shared.datasets.images import ImageInfoDataset, make_loader, raise_fatal
from shared.runtime.cli import counted
from shared.runtime.distributed import default_workers


def check_report(scan: ImageFolderScan, records: list[dict], image_size: int, max_pixels) -> tuple[str, int]:
    """The text printed by --check and the number of bad files."""
    lines = [f"{scan.root} ({describe_source(scan)}): {counted(len(scan.classes), 'class', 'classes')}, "
             f"{counted(len(scan), 'image')}; {scan.skipped.describe()}",
             *scan.notes]
    width = max(len(name) for name in scan.classes)
    lines += [f"  {index:>5}  {name:<{width}}  {counted(count, 'image')}"
              for index, (name, count) in enumerate(zip(scan.classes, scan.counts()))]
    good = [r for r in records if not r["error"]]
    if good:
        first = good[0]
        lines.append(f"first image: {scan.files[first['pos']]} ({first['width']}x{first['height']}, mode "
                     f"{first['mode']})")
        small = sum(min(r["width"], r["height"]) < image_size for r in good)
        if small:
            lines.append(f"{counted(small, 'image')} {'has' if small == 1 else 'have'} a short side below "
                         f"--image-size {image_size} (they are upscaled)")
    bad = [r for r in records if r["error"]]
    lines.append(f"bad files: {len(bad)}")
    lines += [f"  {scan.files[r['pos']]}: {r['error']}" for r in bad]
    large = [r["width"] * r["height"] for r in bad if r.get("too_large")]
    if large:  # the line naming --max-image-pixels when images were refused for their size
        one, limit = len(large) == 1, "no limit" if max_pixels is None else f"{max_pixels:,} pixels"
        lines.append(f"{counted(len(large), 'image')} {'has' if one else 'have'} more pixels than --max-image-pixels "
                     f"allows ({limit}; the largest has {max(large):,}) and "
                     f"{'is' if one else 'are'} skipped as possible decompression bombs. If you trust this folder, "
                     f"pass --max-image-pixels {max(large)} (or none) to admit them; they are decoded at reduced size "
                     f"where the format allows (JPEG), else whole and reduced at once.")
    return "\n".join(lines), len(bad)


def run_check(data_path, image_size: int, num_workers: int | None, limit: int | None, max_pixels: int | None,
              duplicates: str, options: SourceOptions | None = None) -> int:
    """Print the dataset report; returns the number of bad files."""
    scan = apply_duplicates(open_source(data_path, options).limited(limit), duplicates)
    workers = default_workers(8) if num_workers is None else num_workers  # as extract's: one core for the main loop
    # every image opened and decoded as extraction would (in workers): one record per file in sorted order
    batches = [list(range(i, min(i + 64, len(scan)))) for i in range(0, len(scan), 64)]
    records = []
    with tqdm(total=len(scan), unit="img", desc="check", dynamic_ncols=True) as bar:
        for batch in make_loader(ImageInfoDataset(scan, image_size, max_pixels), batches, workers):
            raise_fatal(batch["fatal"])
            records += [{key: (v[k].item() if hasattr(v[k], "item") else v[k]) for key, v in batch.items()}
                        for k in range(len(batch["pos"]))]
            bar.update(len(batch["pos"]))
    text, num_bad = check_report(scan, records, image_size, max_pixels)
    print(text)
    return num_bad
