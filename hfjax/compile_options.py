"""`MODEL_COMPILER_OPTIONS`: the XLA compile options of hfjax's jitted model programs (the gradient and forward steps
of training, the workers' log-prob passes, the generation engine's prefill and decode steps).

XLA:CPU hands dot products, and by default reductions too, to the YNNPACK library. Its reductions run slower than
XLA's own loops on our programs: the sampler's max and sums over the vocabulary, the softmax statistics of attention
and of the log-probs. With dots only, a 256-slot decode step of the reference model took 118 ms instead of 134 ms
(same process, interleaved); sampling alone from [256, 8192] logits took 3.5 ms instead of 4.9 ms. These are fields
of XLA's debug options that only its CPU compiler reads. Imports nothing.
"""

from __future__ import annotations

MODEL_COMPILER_OPTIONS: dict[str, str] = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}
