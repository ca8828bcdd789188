"""Drop-ins that put `moe.MoELayer` into other frameworks' models.

Each integration is an optional extra and is imported on its own
(`import moe.integrations.transformers`); `moe` itself never imports them.
"""
