"""Float8 numerics: the formats and their rounding, amax -> scale (the one place), streaming |x|
histograms."""
