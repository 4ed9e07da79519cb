"""strata-ray: Mixture-of-Experts GGUF models larger than one GPU, exact and fast, on Ray."""

__version__ = "0.1.0"
