"""How close FP8 stays: compare (metrics, evaluation, results, generation fidelity), per-node
sensitivity, and the accuracy-target search (candidates, fallback)."""
