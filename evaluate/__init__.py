"""The evaluate stage: FID, sFID, IS, precision and recall as the ADM evaluator defines them, a digits yardstick.

Modules: evaluation.py (one evaluation, its feature network), images.py, inception.py, metrics.py (statistics and
metrics), digits.py (the digits yardstick), floor.py (its real-digits floor), curve.py (`run`: quality over training), reference.py.
"""
