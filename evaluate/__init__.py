"""The evaluation stage: FID, sFID, IS, precision and recall as the ADM evaluator defines them, a digits yardstick."""
