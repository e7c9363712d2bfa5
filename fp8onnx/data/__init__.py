"""Data in: npz layouts and feeds, text tokenized for the model's inputs, images and audio, the bundled
text sample, and ``as_data``, the one entry every data path goes through."""
