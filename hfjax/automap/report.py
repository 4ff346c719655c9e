"""Presenting search results: a rich table of the top candidates and the per-role breakdown of one (the run
config a mapping becomes is `hfjax.automap.trainer_runs.run_config`).
"""

from __future__ import annotations

from collections.abc import Sequence

from hfjax.automap.search import Candidate
from hfjax.predict.cluster import GIB
from hfjax.predict.dataflow import STAGES


def _layouts(candidate: Candidate) -> str:
    parts = []
    for role, sizes in candidate.mapping.layouts.items():
        gen = candidate.prediction.roles[role].gen
        parts.append(f"{role} {sizes.describe()}" + (f" gen t{gen.tensor}" if gen else ""))
    rollout = candidate.prediction.roles.get("rollout")  # a disaggregated placement's generation group
    if rollout is not None:
        parts.append(f"rollout gen {rollout.sizes.describe()}")
    parts += [f"{key}={value}" for key, value in candidate.settings]
    return ", ".join(parts)


def print_candidates(candidates: Sequence[Candidate], title: str = "", top: int = 10) -> None:
    """A table of the `top` candidates: placement, layouts, seconds per stage and iteration, peak memory."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title or None)
    for col in ("#", "kind", "placement (devices)", "layouts", *STAGES, "iteration s", "peak GiB"):
        table.add_column(col, justify="right" if col in (*STAGES, "iteration s", "peak GiB", "#") else "left")
    for rank, c in enumerate(candidates[:top], 1):
        placement = " | ".join(f"{'+'.join(roles)}:{n}" for roles, n in c.mapping.groups)
        table.add_row(
            str(rank),
            c.kind,
            placement,
            _layouts(c),
            *(f"{c.prediction.stage_seconds[s]:.4g}" for s in STAGES),
            f"{c.iteration_seconds:.4g}",
            f"{max(c.prediction.group_peak_bytes) / GIB:.3g}",
        )
    Console(width=200).print(table)


def print_breakdown(candidate: Candidate) -> None:
    """Per role: its layout, seconds per stage, the terms behind them, and its bytes per device."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{candidate.kind}: {candidate.iteration_seconds:.4g} s per iteration")
    for col in ("role", "layout", *STAGES, "terms (s)", "memory (GiB per device)"):
        table.add_column(col)
    for role, cost in candidate.prediction.roles.items():
        layout = cost.sizes.describe() + (f" / gen {cost.gen.describe()}" if cost.gen else "")
        terms = ", ".join(f"{k} {v:.3g}" for k, v in cost.detail.items() if k not in ("gen_waves", "gen_kv_bytes"))
        if "gen_waves" in cost.detail:
            terms += f", waves {cost.detail['gen_waves']:.0f}"
        memory = ", ".join(f"{k} {v / GIB:.3g}" for k, v in cost.memory.items())
        table.add_row(role, layout, *(f"{cost.seconds[s]:.4g}" for s in STAGES), terms, memory)
    Console(width=220).print(table)
