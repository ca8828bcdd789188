"""The CPU reference vendor: real torch implementations of every hal op, runs anywhere."""

from vendors.cpu.vendor import CpuVendor

__all__ = ["CpuVendor"]
