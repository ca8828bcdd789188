"""Where the repository and the test support files are."""

from pathlib import Path

#: The support folder (helpers and the worker scripts that tests launch).
SUPPORT = Path(__file__).resolve().parent
#: The repository root.
REPO = SUPPORT.parent.parent


def release_device_memory() -> None:
    """Give the CUDA caching allocator's free blocks back before a test starts GPU subprocesses: earlier
    tests of the same pytest process (real model sizes) may hold most of a GPU, which the subprocesses'
    communication buffers then cannot have."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
