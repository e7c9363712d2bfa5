"""Techniques beyond plain amax that change the weights or their rounding: GPTQ, SmoothQuant-style
smoothing, bias correction."""
