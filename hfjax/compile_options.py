"""XLA compile options of hfjax's jitted model programs: `GRADIENT_COMPILER_OPTIONS` for training's gradient step,
`FORWARD_COMPILER_OPTIONS` for forward-only programs (training's forward step, the workers' log-prob passes, the
generation engine's prefill and decode steps).

XLA:CPU hands dot products, and by default reductions too, to the YNNPACK library; its reductions run slower than
XLA's own loops on these programs, so neither set allows them. The gradient step fuses the elementwise work around
each dot into the library call (`DOT`); forward programs make each dot its own call (`INDIVIDUAL_DOT`), keeping the
small batched dots of decode attention in XLA's loops. The measurements behind both choices are in
docs/benchmarks.md ("XLA:CPU compile options"). These are fields of XLA's debug options that only its CPU compiler
reads.
"""

from __future__ import annotations

_LIBRARY_FUSIONS = "xla_cpu_experimental_ynn_fusion_type"
GRADIENT_COMPILER_OPTIONS: dict[str, str] = {_LIBRARY_FUSIONS: "LIBRARY_FUSION_TYPE_DOT"}
FORWARD_COMPILER_OPTIONS: dict[str, str] = {_LIBRARY_FUSIONS: "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
