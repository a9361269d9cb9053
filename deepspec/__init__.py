"""DeepSpec: train and evaluate draft models for lossless speculative decoding."""

__version__ = "0.1.0"
