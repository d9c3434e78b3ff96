"""Run-folder plumbing every stage shares: command lines and flag families, errors, atomic writes, locks, run folders, ranks, precisions, seeds."""
