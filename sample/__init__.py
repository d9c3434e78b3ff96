"""The sample stage: DiT weights (run folder, export or official .pt) -> CFG DDPM/DDIM -> VAE -> PNGs, grid, npz.

Entry points: `python -m sample` (sample.generate.run_sample) and `python -m sample decode`
(sample.decode.run_decode). Image i's label and noise depend only on (--seed, i).
"""
