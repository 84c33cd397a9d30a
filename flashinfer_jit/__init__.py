"""flashinfer-jit: GPU kernels for LLM serving, specialized and compiled on first use."""

from ._version import __version__

__all__ = ["__version__"]
