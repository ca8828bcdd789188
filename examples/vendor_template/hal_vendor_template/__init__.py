"""A minimal out-of-tree moe-hal vendor: copy this package to start your own.

It registers `TemplateVendor` in the `hal.vendors` entry-point group (see
pyproject.toml), computes three ops with its own plain-torch code on the CPU
(`TemplateOps`) and leaves the others to `hal.ReferenceOps`.
"""

from hal_vendor_template.vendor import TemplateVendor

__all__ = ["TemplateVendor"]
