"""Vendor plugins shipped with moe-hal (cpu, cuda, ascend).

Each registers in the `hal.vendors` entry-point group exactly as a third-party
vendor would; `hal` never imports this package.
"""
