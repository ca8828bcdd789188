"""The generic MoE layer (route -> dispatch -> experts -> combine), built on `hal` only.

This package imports `hal` and torch, never a vendor; it arrives with the MoE-layer issue.
"""
