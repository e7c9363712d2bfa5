"""The papers' experiments: study (formats x scalings on one model), zoo (pass rates over many models),
FP8 training and its study."""
