"""The digits demo: the whole pipeline on scikit-learn's handwritten digits, on the CPU (shared/datasets/digits.py).

Modules: demo.py (`python -m data.demo`), make_vae.py (its tiny AutoencoderKL), judge.py (does an image show the
digit asked for?), make_encoder.py (a tiny DINOv2-shaped encoder, for REPA), make_rae.py (a digits RAE).
"""
