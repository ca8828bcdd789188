"""The CUDA vendor: NVIDIA GPUs, capabilities chosen from the compute capability."""

from vendors.cuda.vendor import CudaVendor

__all__ = ["CudaVendor"]
