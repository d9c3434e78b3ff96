"""The evaluate stage: FID, sFID, IS, precision and recall as the ADM evaluator defines them, a digits yardstick.

Modules: evaluation.py (`python -m evaluate SAMPLES.npz`: one evaluation), images.py (npz and image folders),
features.py (the feature networks behind one interface), inception.py (the FID Inception-v3 in pure torch),
metrics.py (the metric maths), stats.py (statistics files and reference batches), digits.py (the digits
yardstick), floor.py (`python -m evaluate.floor`: the digits FD of real digits), curve.py (`python -m evaluate
run`: quality over training), reference.py (`python -m evaluate reference`: real images cropped into a
reference at the samples' size).
"""
