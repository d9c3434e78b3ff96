"""The digits demo: the whole pipeline on scikit-learn's handwritten digits, on the CPU (the dataset: shared/datasets/digits.py).

Modules: demo.py (`python -m data.demo`), make_vae.py (the demo's tiny AutoencoderKL), judge.py (does an image
show the digit it was asked for?), make_encoder.py (a tiny DINOv2-shaped encoder fitted to the digits, for the
REPA benchmark), make_rae.py (a digits RAE: that encoder's shape inside diffusers' AutoencoderRAE, frozen, with
a trained ViT decoder, for the RAE arm of the recipes benchmark).
"""
