"""Load time and peak host RSS of `load_hf` on a locally built ~0.5B-parameter bfloat16 checkpoint (sharded
safetensors), beside transformers' `from_pretrained` of the same files. Each load runs in a fresh process so that
its RSS high-water mark is its own. Usage:
    python scripts/bench/bench_load.py [--ckpt DIR] [--layouts ";fsdp=8"] [--out runs/bench/load.json] [--tiny]
With `--tiny` the checkpoint has a tiny shape of the same family (`TINY_SHAPE`, a few shards).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import parse_args, report

# Qwen2.5-0.5B's shape with a random init: 494M parameters, tied embeddings.
SHAPE = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    rope_theta=1e6,
)
TINY_SHAPE = {**SHAPE, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip

MEASURE = r"""
import json, os, sys, time
import psutil
which, ckpt, mesh = sys.argv[1], sys.argv[2], sys.argv[3]
if mesh:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=" + str(eval("*".join(
        s.split("=")[1] for s in mesh.split(","))))
if which == "hfjax":
    import jax
    from hfjax.models import load_hf
    sizes = {k: int(v) for k, v in (s.split("=") for s in mesh.split(","))} if mesh else None
    layout = {"mesh": sizes, "rules": "fsdp"} if mesh else None
    load = lambda: jax.block_until_ready(load_hf(ckpt, dtype="bfloat16", layout=layout))
else:
    import torch, transformers as tf
    load = lambda: tf.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
proc = psutil.Process()
base = proc.memory_info().rss
start = time.perf_counter()
model = load()
seconds = time.perf_counter() - start
# VmHWM is this process image's RSS high-water mark (ru_maxrss would inherit the parent's at fork).
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"seconds": seconds, "baseline_rss": base, "peak_rss": peak, "final_rss": proc.memory_info().rss}))
"""


def build_checkpoint(out: Path, shape: dict, shard_bytes: int) -> Path:
    """Writes random bf16 tensors of a Qwen2 `shape` in transformers' names and sharded layout (index + numbered
    files of at most `shard_bytes` each)."""
    if (out / "config.json").is_file():
        return out
    import torch
    import transformers as tf
    from safetensors.torch import save_file

    torch.manual_seed(0)
    config = tf.Qwen2Config(**shape)
    config.architectures = ["Qwen2ForCausalLM"]
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in tf.Qwen2ForCausalLM(config).state_dict().items() if n != "lm_head.weight"}
    groups: list[list[str]] = [[]]
    used = 0
    for name, shape in shapes.items():
        nbytes = 2 * shape.numel()
        if groups[-1] and used + nbytes > shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += nbytes
    out.mkdir(parents=True)
    weight_map = {}
    for i, names in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {
            n: (torch.randn(shapes[n]) * 0.02 if len(shapes[n]) > 1 else torch.ones(shapes[n])).to(torch.bfloat16)
            for n in names
        }
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    total = sum(2 * s.numel() for s in shapes.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    config.save_pretrained(out)
    return out


def measure(which: str, ckpt: Path, mesh: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", MEASURE, which, str(ckpt), mesh], capture_output=True, text=True, check=False
    )
    if result.returncode:
        raise SystemExit(f"{which} load failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, default=Path(tempfile.gettempdir()) / "hfjax-bench-0.5b-bf16")
    parser.add_argument("--shard-mib", type=int, default=300, help="safetensors shard size when building")
    parser.add_argument("--layouts", default=";fsdp=8", help="';'-separated meshes for hfjax ('' = one device)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/load.json"))
    tiny_ckpt = Path(tempfile.gettempdir()) / "hfjax-bench-tiny-bf16"
    args = parse_args(parser, tiny={"ckpt": tiny_ckpt, "shard_mib": 0, "layouts": ";fsdp=2"})
    ckpt = build_checkpoint(args.ckpt, TINY_SHAPE if args.tiny else SHAPE, args.shard_mib * 2**20)
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    files = len(list(ckpt.glob("*.safetensors")))
    runs = [("transformers from_pretrained", "torch", "")] + [
        (f"hfjax load_hf ({mesh or 'one device'})", "hfjax", mesh) for mesh in args.layouts.split(";")
    ]
    rows, raw = [], {}
    mib = 2**20
    for label, which, mesh in runs:
        m = measure(which, ckpt, mesh)
        raw[label] = m
        rows.append(
            [
                label,
                m["seconds"],
                size / m["seconds"] / 2**30,
                m["baseline_rss"] / mib,
                m["peak_rss"] / mib,
                (m["peak_rss"] - m["baseline_rss"]) / mib,
                (m["peak_rss"] - m["baseline_rss"]) / size,
            ]
        )
    report(
        f"load of a {size / 2**30:.2f} GiB bf16 checkpoint ({files} safetensors files)",
        ["loader", "seconds", "GiB/s", "RSS before MiB", "peak RSS MiB", "peak - before MiB", "(peak - before) / size"],
        rows,
        args.out,
        {"checkpoint_bytes": size, "files": files, "raw": raw},
    )


if __name__ == "__main__":
    main()
