"""XLA compile options of hfjax's jitted model programs: `GRADIENT_COMPILER_OPTIONS` for training's gradient step,
`FORWARD_COMPILER_OPTIONS` for forward-only programs (training's forward step, the workers' log-prob passes, the
generation engine's prefill and decode steps).

XLA:CPU hands dot products, and by default reductions too, to the YNNPACK library. Its reductions run slower than
XLA's own loops on our programs (the sampler's max and sums over the vocabulary, the softmax statistics of attention
and of the log-probs), so neither set allows them. With dots only, a 256-slot decode step of the reference model took
118 ms instead of 134 ms (same process, interleaved); sampling alone from [256, 8192] logits took 3.5 ms instead of
4.9 ms. The two sets differ in what goes with a dot:
- gradient step: the elementwise work around each dot is fused into the library call (`DOT`). Against one call per
  dot, a 32 x 176 loss-and-grad of the reference model was faster in 9 of 12 interleaved pairs.
- forward programs: each dot is its own library call (`INDIVIDUAL_DOT`), the elementwise work and the small batched
  dots of decode attention stay in XLA's loops. Generating 64 prompts x 128 tokens took 4.91 s and 5.58 s (medians of
  two runs) against 5.23 s and 5.91 s with `DOT`, faster in 10 of 12 pairs; 256 slots (64 prompts x 4 samples) took
  21.7 s against 22.8 s; a 32 x 176 forward took 2.39-2.47 s against 2.53-2.60 s.
Without the library, dots run about 2x slower here. These are fields of XLA's debug options that only its CPU compiler
reads.
"""

from __future__ import annotations

_LIBRARY_FUSIONS = "xla_cpu_experimental_ynn_fusion_type"
GRADIENT_COMPILER_OPTIONS: dict[str, str] = {_LIBRARY_FUSIONS: "LIBRARY_FUSION_TYPE_DOT"}
FORWARD_COMPILER_OPTIONS: dict[str, str] = {_LIBRARY_FUSIONS: "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
