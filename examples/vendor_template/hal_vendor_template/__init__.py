"""A minimal out-of-tree moe-hal vendor: copy this package to start your own.

It registers `TemplateVendor` in the `hal.vendors` entry-point group (see
pyproject.toml) and computes every op it declares with plain torch on the CPU.
"""

from hal_vendor_template.vendor import TemplateVendor

__all__ = ["TemplateVendor"]
