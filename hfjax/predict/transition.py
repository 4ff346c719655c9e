"""Bytes a train -> generation transition of the HybridEngine moves per device: HybridFlow's Table 2 formula and
the figure the cost model prices (what each device receives, and what `to_train` fetches back)."""

from __future__ import annotations

from hfjax.parallel.layout import Layout


def table2_moved_bytes(total_bytes: int, train: Layout, gen: Layout) -> int:
    """HybridFlow's per-device bytes moved, M/(f_g t_g) - M/(f t) (pipeline size 1; data replicates)."""
    train_shards = train.axis_size("fsdp") * train.axis_size("tensor")
    gen_shards = gen.axis_size("fsdp") * gen.axis_size("tensor")
    return total_bytes // gen_shards - total_bytes // train_shards


def transition_bytes(total_bytes: int, train: Layout, gen: Layout) -> tuple[int, int]:
    """Per-device bytes a train -> gen transition receives, and that `to_train` must fetch back, for a model of
    `total_bytes` whose weights fsdp shards on one dimension and tensor parallelism on the other (fsdp f, tensor t in
    training; fsdp f_g, tensor t_g in generation), in the device order that keeps the most in place: each device keeps
    M / (max(f, f_g) max(t, t_g)) of its training shard. Where f_g divides f and t_g divides t that is the whole
    training shard: Table 2's M/(f_g t_g) - M/(f t) in and nothing back."""
    f, t = train.axis_size("fsdp"), train.axis_size("tensor")
    f_g, t_g = gen.axis_size("fsdp"), gen.axis_size("tensor")
    kept = total_bytes // (max(f, f_g) * max(t, t_g))
    return total_bytes // (f_g * t_g) - kept, total_bytes // (f * t) - kept
