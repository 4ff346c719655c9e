"""A real-size run on CPU (issue 40, item 6): a Qwen2.5-0.5B-shaped checkpoint (random weights, the real config:
vocabulary 151,936, tied embeddings, hidden 896, MLP 4864, 24 layers, 14 heads / 2 KV heads, rope theta 1e6, 32,768
positions) built locally with transformers, then:
1. greedy parity: `load_hf` + `OfflineGenerator` greedy against transformers' greedy `generate` on a few prompts
   (token-exact, else the first divergence and transformers' top-2 logit margin there);
2. `--steps` GRPO steps end to end through `run_rl` (backend `local` in a process of one device, KL loss so a
   reference pass runs), with the time per stage, tokens/s and the peak RSS of the run beside the cost model's
   memory estimate (`hfjax.trainer.preflight.predict_memory`: per-device peak of the run's group, plus the KV cache
   of its slots);
3. a weight sync of a Qwen2.5-1.5B-shaped model (0.5B where under `--sync-min-free-gib` of memory is available):
   random float32 parameters under fsdp over fake devices 0-3 exported in bfloat16 (`weight_sync.export_shards`),
   checked and built straight into a generation layout on devices 4-7 (`check_blocks`, `place_param`), no Ray, no
   optimizer state, in a child process of 8 fake devices (`--parts sync` alone runs in this one); seconds and host
   peak against the memcpy floor (`bench_common.copy_times`: one copy out of the trainer's devices plus one per full
   copy the generation layout keeps).
The tokenizer is the small addition-task BPE (`hfjax.data.synthetic`): its ids are valid model ids, and the ids it
does not know decode to nothing. Peak RSS is the process's high-water mark since each part began (reset through
/proc/self/clear_refs where the kernel allows it). The GRPO part runs on one device: fake CPU devices share the
host's RAM, so 8 of them hold 8 sets of each program's buffers (an earlier version ran it on 8 and its RSS was twice
the cost model's one-device estimate). `--parts` runs a subset. Usage:
    python scripts/bench/bench_real_size.py [--parts parity,grpo,sync] [--prompts 8] [--samples 4] [--response-length
        128]
        [--sync-size 1.5b] [--out runs/bench/real_size.json] [--tiny]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _parts_from_argv(argv: list[str]) -> set[str]:
    """The `--parts` value of the command line, read before JAX starts (it decides the process's device count)."""
    for i, arg in enumerate(argv):
        if arg.startswith("--parts="):
            return set(arg.split("=", 1)[1].split(","))
        if arg == "--parts" and i + 1 < len(argv):
            return set(argv[i + 1].split(","))
    return {"parity", "grpo", "sync"}


SYNC_DEVICES = 8  # the sync runs alone in its process: trainer on devices 0-3, generation on 4-7
DEVICES = SYNC_DEVICES if _parts_from_argv(sys.argv) == {"sync"} else 1
# the last count given wins
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "scripts" / "bench"), str(ROOT / "scripts" / "bench" / "peers")]
from bench_common import copy_times, parse_args, report  # noqa: E402

GIB = 2**30
STARTED = time.perf_counter()
# transformers Qwen2Config arguments besides the vocabulary: Qwen2.5-0.5B's, and the --tiny ones
CHECKPOINT_SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
}
PARITY_TEXTS = ("What is 12+7?", "Count letters: plus equals")
SYNC_PRESETS = {"1.5b": "qwen2.5-1.5b", "0.5b": "qwen2.5-0.5b"}


def log(message: str) -> None:
    print(f"[{time.perf_counter() - STARTED:7.1f} s] {message}", flush=True)


def reset_peak_rss() -> bool:
    """Resets this process's RSS high-water mark (VmHWM); False where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def rss_gib(field: str = "VmHWM") -> float:
    """This process's `VmHWM` (peak RSS) or `VmRSS` from /proc/self/status, in GiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 2**20


def build_checkpoint(out: Path, shape: str, vocab: int) -> Any:
    """Writes a random Qwen2 checkpoint of `shape` and `vocab` (seed 0, float32) with the addition tokenizer to
    `out`; returns the transformers model (kept for the parity check)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hfjax.data.synthetic import build_addition_tokenizer

    tokenizer = build_addition_tokenizer()
    config = Qwen2Config(
        vocab_size=vocab,
        tie_word_embeddings=True,
        rope_theta=1e6,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **CHECKPOINT_SHAPES[shape],
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return model


def parity_prompts(tokenizer: Any, vocab: int) -> list[list[int]]:
    """The chat-rendered `PARITY_TEXTS`, then two prompts of random ids over the whole vocabulary (seed 0)."""
    import numpy as np

    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
        for t in PARITY_TEXTS
    ]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    rng = np.random.default_rng(0)
    return prompts + [rng.integers(3, vocab, n).tolist() for n in (9, 31)]


def greedy_parity(ckpt: Path, reference: Any, prompts: list[list[int]], new_tokens: int) -> list[dict[str, Any]]:
    """Per prompt: hfjax's and transformers' greedy tokens, whether they agree, and at the first divergence the
    position, both picks and transformers' logits margin between its top two and between the two picks."""
    import torch
    from flax import nnx

    from hfjax.models import load_hf
    from hfjax.rollout import JaxEngine, OfflineGenerator, SamplingParams

    model = load_hf(ckpt)
    width = max(len(p) for p in prompts)
    engine = JaxEngine(model, max_concurrent_decodes=len(prompts), max_prefill_length=width, max_new_tokens=new_tokens)
    generator = OfflineGenerator(engine, nnx.split(model, nnx.Param, ...)[1], progress=False)
    outs = generator.generate(prompts, SamplingParams(max_new_tokens=new_tokens, temperature=0.0))
    results = []
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            ref = reference.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False
            )
        expected, got = ref[0, len(prompt) :].tolist(), out.tokens.tolist()
        row: dict[str, Any] = {"prompt_tokens": len(prompt), "hfjax": got, "transformers": expected}
        row["exact"] = got == expected
        if not row["exact"]:
            k = next(
                (i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), min(len(got), len(expected))
            )
            row["first_divergence"] = k
            if k < min(len(got), len(expected)):
                with torch.inference_mode():
                    logits = reference(torch.tensor([prompt + expected[:k]])).logits[0, -1]
                top2 = torch.topk(logits, 2).values
                row["top2_margin"] = float(top2[0] - top2[1])
                row["picks_margin"] = float(logits[expected[k]] - logits[got[k]])
        results.append(row)
    del generator, engine, model
    return results


def grpo_config(ckpt: Path, workload: Path, run_dir: Path, args: argparse.Namespace) -> Any:
    from hfjax.config.rl import load_rl_config

    samples = args.prompts * args.samples
    return load_rl_config(
        {
            "model_path": str(ckpt),
            "data": {
                "train_files": [str(workload)],
                "max_prompt_length": args.prompt_tokens,
                "train_batch_size": args.prompts,
            },
            "actor": {"ppo_mini_batch_size": samples, "micro_batch_size": args.micro_batch, "use_kl_loss": True},
            "rollout": {
                "n": args.samples,
                "response_length": args.response_length,
                "slots": samples,
                "ignore_eos": True,
            },
            "reward": {"function": f"{ROOT / 'scripts' / 'bench' / 'peers' / 'reward.py'}:compute_score"},
            "algorithm": {"name": "grpo"},
            "trainer": {
                "run_dir": str(run_dir),
                "total_steps": args.steps,
                "backend": "local",
                "devices_per_host": 1,
                "resume": "never",
                "logger": ["console", "jsonl"],
                "plot": False,
            },
        }
    )


def cost_model_gib(cfg: Any) -> dict[str, Any]:
    """The cost model's per-device memory for `cfg` (its one group), plus the KV cache of `rollout.slots` (as the
    preflight memory check adds it), in GiB; the reason instead where the model does not cover the run."""
    import psutil

    from hfjax.models.hf import read_config
    from hfjax.predict.cost import InfeasibleError
    from hfjax.trainer.preflight import ITEMSIZE, kv_cache_bytes, predict_memory

    try:
        prediction = predict_memory(cfg, psutil.virtual_memory().total)
    except (InfeasibleError, ValueError) as exc:
        return {"unavailable": str(exc)}
    actor, _ = read_config(cfg.model_path)
    tokens = cfg.data.max_prompt_length + cfg.rollout.response_length
    kv = kv_cache_bytes(actor, cfg.rollout.slots, tokens, ITEMSIZE[cfg.actor.dtype])
    roles = {
        name: {"static": c.static_bytes / GIB, "transient": c.transient_bytes / GIB}
        for name, c in prediction.roles.items()
    }
    peak = max(prediction.group_peak_bytes)
    return {"peak_gib": peak / GIB, "kv_cache_gib": kv / GIB, "total_gib": (peak + kv) / GIB, "roles": roles}


def grpo_run(ckpt: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Runs `args.steps` GRPO steps; returns the per-step stage times, tokens/s, peak RSS and the cost model's."""
    from workload import write_workload

    from hfjax.trainer.launch import run_rl

    work = Path(tempfile.mkdtemp(prefix="hfjax-bench-real-"))
    workload = write_workload(ckpt, work / "workload.parquet", n=args.prompts, max_prompt_tokens=args.prompt_tokens)
    cfg = grpo_config(ckpt, workload, work / "run", args)
    estimate = cost_model_gib(cfg)
    before = rss_gib("VmRSS")
    reset_peak_rss()
    history = run_rl(cfg)
    steps = []
    for record in history:
        seconds = {k.removeprefix("timing_s/"): v for k, v in record.items() if k.startswith("timing_s/")}
        tokens = record["perf/total_num_tokens"]
        response_tokens = args.prompts * args.samples * args.response_length
        steps.append(
            {
                "seconds": seconds,
                "tokens": tokens,
                "tokens_per_s": tokens / seconds["step"],
                "generated_tokens_per_s": response_tokens / seconds["gen"],
            }
        )
    workload_keys = ("prompts", "samples", "prompt_tokens", "response_length", "micro_batch", "steps")
    return {
        "steps": steps,
        "rss_before_gib": before,
        "peak_rss_gib": rss_gib(),
        "cost_model": estimate,
        "workload": {k: getattr(args, k) for k in workload_keys},
    }


def sync_model(size: str, tiny: bool) -> Any:
    """The `ModelConfig` of the synced model: the named preset of `size`, shrunk to the tiny checkpoint's shape."""
    from hfjax.models.presets import named_config

    cfg = named_config(SYNC_PRESETS[size])
    if not tiny:
        return cfg
    shape = CHECKPOINT_SHAPES["tiny"]
    return dataclasses.replace(
        cfg,
        vocab_size=2048,
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_layers=shape["num_hidden_layers"],
        num_heads=shape["num_attention_heads"],
        num_kv_heads=shape["num_key_value_heads"],
        head_dim=shape["hidden_size"] // shape["num_attention_heads"],
        sliding_windows=(),
    )


def sync_host_gib(model_cfg: Any, gen_mesh: dict[str, int]) -> float:
    """Host memory a sync of `model_cfg` needs on CPU devices: the float32 trainer copy, the bfloat16 blocks and the
    bfloat16 rollout copy once per `data` replica, plus 1 GiB for the process."""
    from flax import nnx

    from hfjax.models.hf import abstract_model

    abstract = nnx.state(abstract_model(model_cfg, "causal_lm", "float32"), nnx.Param)
    n_params = sum(var.size for _, var in nnx.to_flat_state(abstract))
    return n_params * (4 + 2 + 2 * gen_mesh.get("data", 1)) / GIB + 1


def weight_sync(model_cfg: Any, gen_mesh: dict[str, int], repeats: int) -> dict[str, Any]:
    """Random float32 parameters of the `model_cfg` model under fsdp on devices 0-3, synced in bfloat16 into `gen_mesh`
    on devices 4-7 once to warm up, then `repeats` times (export, check, place); seconds, host peak and the memcpy
    floor; the placed weights are checked bitwise against the trainer's cast."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from hfjax.models.hf import abstract_model
    from hfjax.parallel import Layout
    from hfjax.workers.weight_sync import check_blocks, export_shards, param_paths, place_param

    abstract = nnx.state(abstract_model(model_cfg, "causal_lm", "float32"), nnx.Param)
    train = Layout.from_config({"mesh": {"fsdp": 4}, "rules": "fsdp", "devices": [0, 1, 2, 3]})
    gen = Layout.from_config({"mesh": gen_mesh, "rules": "dp_tp_gen", "devices": [4, 5, 6, 7]})
    train_shardings = dict(nnx.to_flat_state(train.shardings(abstract)))
    gen_shardings = dict(nnx.to_flat_state(gen.shardings(abstract)))
    rng = np.random.default_rng(0)
    params, rollout = {}, {}  # by parameter path, as the trainer's and the rollout's trees
    for path, var in nnx.to_flat_state(abstract):
        name = "/".join(map(str, path))
        params[name] = jax.device_put(rng.standard_normal(var.shape, np.float32), train_shardings[path])
        rollout[name] = jax.ShapeDtypeStruct(var.shape, jnp.bfloat16, sharding=gen_shardings[path])
    n_params = sum(x.size for x in jax.tree.leaves(params))
    log(f"sync: {n_params / 1e9:.2f}B float32 parameters on devices 0-3 ({rss_gib('VmRSS'):.1f} GiB RSS)")
    nbytes = 2 * n_params
    probe = min(nbytes, GIB)
    copy_s = statistics.median(copy_times(probe, 5)) * nbytes / probe
    gc.collect()
    base = rss_gib("VmRSS")
    reset_peak_rss()
    runs, placed = [], {}
    for attempt in range(repeats + 1):  # the first warms up (compiles the casts)
        placed.clear()
        started = time.perf_counter()
        shards = export_shards(params, "bfloat16")
        exported = time.perf_counter()
        leaves = param_paths(rollout)
        blocks = check_blocks([shards], {p: (tuple(v.shape), np.dtype(v.dtype).name) for p, v in leaves})
        for path, like in leaves:
            placed[path] = place_param(blocks[path], like)
        jax.block_until_ready(list(placed.values()))
        done = time.perf_counter()
        run = {"export_s": exported - started, "place_s": done - exported, "sync_s": done - started}
        runs += [run] if attempt else []
        del shards, blocks
        log(f"sync{'' if attempt else ' (warm-up)'}: {run['sync_s']:.1f} s (export {run['export_s']:.1f} s)")
    peak = rss_gib()
    for path, leaf in param_paths(params):
        want = np.asarray(leaf.astype(jnp.bfloat16))
        if not np.array_equal(np.asarray(placed[path]).view(np.uint16), want.view(np.uint16)):
            raise SystemExit(f"weight sync check failed: {path} differs from the trainer's bfloat16 cast")
    copies = 1 + gen_mesh.get("data", 1)
    return {
        "params": n_params,
        "bytes": nbytes,
        "gen_mesh": gen_mesh,
        "runs": runs,
        "sync_s": statistics.median(r["sync_s"] for r in runs),
        "rss_before_gib": base,
        "peak_rss_gib": peak,
        "peak_above_before_gib": peak - base,
        "floor_copies": copies,
        "floor_s": copies * copy_s,
    }


def table_rows(parity: dict | None, grpo: dict | None, sync: dict | None, args: argparse.Namespace) -> list[list]:
    """The report's rows of the parts that ran: parity, each GRPO step with its stages and the cost model's
    estimate, the sync."""
    rows = []
    if parity:
        prompts = parity["prompts"]
        exact = f"{sum(r['exact'] for r in prompts)}/{len(prompts)} token-exact"
        name = f"greedy parity, {len(prompts)} prompts x {args.parity_tokens} tokens"
        rows.append([name, parity["seconds"], "", parity["peak_rss_gib"], exact])
    if grpo:
        for i, step in enumerate(grpo["steps"]):
            stages = ", ".join(f"{k} {v:.1f}" for k, v in step["seconds"].items() if k != "step")
            name = f"GRPO step {i + 1}" + (" (compiles)" if i == 0 else "")
            rows.append([name, step["seconds"]["step"], step["tokens_per_s"], grpo["peak_rss_gib"], stages])
        cost = grpo["cost_model"]
        what = cost.get("unavailable", "its per-device peak (params, optimizer, activations) + KV cache")
        rows.append(["cost model (GRPO, 1 device)", "", "", cost.get("total_gib", ""), what])
    if sync:
        floor = f"floor {sync['floor_s']:.2f} s ({sync['floor_copies']} copies)"
        above = f"host peak +{sync['peak_above_before_gib']:.2f} GiB over the trainer's copy"
        name = f"weight sync {sync['model']}, bfloat16, fsdp=4 -> {args.gen_mesh}"
        rows.append([name, sync["sync_s"], "", sync["peak_rss_gib"], f"{floor}; {above}"])
    return rows


def sync_in_child(args: argparse.Namespace) -> dict[str, Any]:
    """The sync part run by this script in a process of its own (`SYNC_DEVICES` fake devices); its JSON's result."""
    out = Path(tempfile.mkdtemp(prefix="hfjax-real-size-sync-")) / "sync.json"
    command = [sys.executable, __file__, "--parts", "sync", "--out", str(out), "--sync-size", args.sync_size]
    command += ["--gen-mesh", args.gen_mesh, "--sync-repeats", str(args.sync_repeats)]
    command += ["--sync-min-free-gib", str(args.sync_min_free_gib)] + (["--tiny"] if args.tiny else [])
    log("weight sync: in a child process of 8 devices")
    subprocess.run(command, check=True)
    return json.loads(out.read_text())["weight_sync"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(CHECKPOINT_SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--parity-tokens", type=int, default=16, help="greedy tokens compared per prompt")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4, help="rollout.n")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="data.max_prompt_length")
    parser.add_argument("--response-length", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--sync-size", choices=sorted(SYNC_PRESETS), default="1.5b")
    parser.add_argument("--sync-min-free-gib", type=float, default=14.0, help="below it the sync runs at 0.5B")
    parser.add_argument(
        "--gen-mesh",
        default="data=2,tensor=2",
        help="generation mesh of the sync over devices 4-7 (2 KV heads: tensor <= 2)",
    )
    parser.add_argument("--sync-repeats", type=int, default=2)
    parser.add_argument("--parts", default="parity,grpo,sync", help="which parts to run (comma-separated)")
    parser.add_argument("--note", default="", help="a remark stored in the JSON (e.g. a shared machine)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/real_size.json"))
    tiny = {"shape": "tiny", "vocab": 2048, "parity_tokens": 4, "prompts": 2, "samples": 2, "response_length": 8}
    args = parse_args(parser, tiny=tiny | {"micro_batch": 4, "steps": 1, "sync_repeats": 1, "sync_min_free_gib": 0.0})
    gen_mesh = {axis: int(size) for axis, size in (item.split("=") for item in args.gen_mesh.split(","))}

    import psutil
    from transformers import AutoTokenizer

    parts = set(args.parts.split(","))
    if not parts or parts - {"parity", "grpo", "sync"}:
        raise SystemExit(f"--parts {args.parts}: expected a comma-separated subset of parity, grpo, sync")
    parity = grpo = sync = None
    ckpt = Path(tempfile.mkdtemp(prefix="hfjax-real-size-")) / args.shape
    n_params = 0
    if parts & {"parity", "grpo"}:
        log(f"building a random {args.shape} checkpoint (vocabulary {args.vocab}) at {ckpt}")
        reference = build_checkpoint(ckpt, args.shape, args.vocab)
        n_params = sum(p.numel() for p in reference.parameters())
        log(f"{n_params / 1e6:.1f}M parameters")
        if "parity" in parts:
            prompts = parity_prompts(AutoTokenizer.from_pretrained(ckpt), args.vocab)
            log(f"greedy parity on {len(prompts)} prompts x {args.parity_tokens} tokens")
            reset_peak_rss()
            started = time.perf_counter()
            compared = greedy_parity(ckpt, reference, prompts, args.parity_tokens)
            parity = {"prompts": compared, "seconds": time.perf_counter() - started, "peak_rss_gib": rss_gib()}
            log(f"parity: {sum(r['exact'] for r in compared)}/{len(compared)} prompts token-exact")
        del reference
        gc.collect()
    if "grpo" in parts:
        log(
            f"GRPO: {args.steps} steps, {args.prompts} prompts x {args.samples} samples x {args.response_length} tokens"
        )
        grpo = grpo_run(ckpt, args)
        gc.collect()
    if "sync" in parts and DEVICES != SYNC_DEVICES:
        sync = sync_in_child(args)
    elif "sync" in parts:
        available = psutil.virtual_memory().available / GIB
        need = sync_host_gib(sync_model(args.sync_size, args.tiny), gen_mesh)
        size = args.sync_size if available >= max(need, args.sync_min_free_gib) else "0.5b"
        log(f"weight sync at {size}: {available:.1f} GiB available, {args.sync_size} needs {need:.1f} GiB")
        label = SYNC_PRESETS[size] + (" (tiny shapes)" if args.tiny else "")
        sync = weight_sync(sync_model(size, args.tiny), gen_mesh, args.sync_repeats) | {"model": label}

    rows = table_rows(parity, grpo, sync, args)
    ran = [f"{args.shape} ({n_params / 1e6:.0f}M, vocabulary {args.vocab})"] if n_params else []
    if grpo:
        ran.append(f"GRPO {args.prompts} prompts x {args.samples} samples x {args.response_length} tokens, 1 device")
    if sync:
        ran.append(f"sync of {sync['params'] / 1e9:.2f}B parameters")
    report(
        f"real size on CPU: {'; '.join(ran)}",
        ["part", "seconds", "tokens/s", "peak RSS GiB", "detail"],
        rows,
        args.out,
        {
            "checkpoint": {"shape": args.shape, "vocab": args.vocab, "params": n_params},
            "parity": parity,
            "grpo": grpo,
            "weight_sync": sync,
            "note": args.note,
        },
    )


if __name__ == "__main__":
    main()
