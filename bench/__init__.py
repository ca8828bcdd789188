"""`hal bench`: the MoE layer on a vendor, timed against the device's measured roofline.

Imports `hal` and `moe`, never a vendor: it drives whatever vendor is selected, through
the same layer an engine uses.
"""
