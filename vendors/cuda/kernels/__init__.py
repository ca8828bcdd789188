"""Triton kernels of the CUDA vendor (imported only where Triton is installed)."""
