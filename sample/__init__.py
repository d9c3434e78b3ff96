"""The sample stage: DiT weights (run folder, export, official .pt or diffusers DiT) -> CFG sampling -> VAE -> PNGs.

Commands over shared/: `python -m sample` (shared.sampling.generate.run_sample, also what `python -m evaluate run`
draws with), decode.py (`python -m sample decode`), watch.py (`python -m sample watch`), to_diffusers.py (`python -m
sample export`: a diffusers DiTPipeline folder). The weights --ckpt names are found and read by shared/weights/,
the images drawn and written by shared/sampling/.
"""
