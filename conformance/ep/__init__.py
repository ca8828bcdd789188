"""The expert-parallel (EP) section of the conformance suite, run with several ranks.

`hal conformance --vendor NAME --ep-ranks N` spawns N local ranks of `python -m conformance.ep`
(`conformance.ep.launch`); under a launcher, `torchrun --nproc-per-node N -m conformance.ep
--vendor NAME` runs the same section. Every rank runs the same cases in the same order
(`conformance.ep.cases`): the torch.distributed dispatcher and the vendor's own ones, in normal,
low-latency and auto mode, for bf16 / fp8 / int8 dispatch (and the requests the vendor falls back
from), on several shapes; each case compares the EP layer's output with the single-rank layer and
a float64 MoE (`conformance.ep.check`). The ranks agree on every case's outcome before the next
(`conformance.ep.world`), and rank 0 writes the matrix (`conformance.ep.report`).

Importing this package imports nothing heavy.
"""
