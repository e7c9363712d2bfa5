"""The graph before and around quantization: loading and writing models, path guards, graph
preparation, and the plan (per node: what to quantize, or why not)."""
