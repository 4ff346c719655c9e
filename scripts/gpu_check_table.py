"""The Python half of `scripts/gpu_check.sh`: each check of the GPU check as a subcommand that writes one JSON result
file, and the table that gathers them. Every subcommand is run by the shell script in its own process (with a time
limit), so that a check that crashes, hangs or runs out of device memory leaves the others standing.

Subcommands:
    env OUT.json                      jax/jaxlib versions, backend, device kind and count, flax/transformers/torch
    pytest JUNIT.xml OUT.json FILE..  passed/failed/skipped counts per test file from pytest's JUnit XML
    generate OUT.json -- ARGS         scripts/bench/bench_generate.py with ARGS, the transformers side on the GPU when
    JAX
                                      runs on one (torch's default device and the reference model moved there)
    grpo OUT.json [--tiny] [--prompts 256 --group 5 --response-lengths 512,256,128 --steps 2 ...]
                                      GRPO iterations at verl's quickstart workload (Qwen2.5-0.5B shape, random weights,
                                      bf16, `trainer.backend=local`, no Ray); on running out of memory, the next
                                      (smaller) response length in a fresh process
    table OUT_DIR                     the table of every check (OUT_DIR/*.status + results), printed and written to
                                      OUT_DIR/gpu_check.json; exit status 1 when any check failed
Imports hfjax only inside the subcommands that need it, never Ray itself; with GPU_CHECK_BLOCK_RAY=1
(`gpu_check.sh --block-ray`) `import ray` fails in `generate` and `grpo`, as on a machine without Ray.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts" / "bench"
GRPO_CONFIG = ROOT / "configs" / "gsm8k" / "qwen2.5-0.5b-grpo-1gpu.yaml"  # verl's 1-GPU GRPO recipe, in hfjax keys
REWARD = f"{SCRIPTS / 'peers' / 'reward.py'}:compute_score"
OOM_MARKERS = ("RESOURCE_EXHAUSTED", "out of memory", "Out of memory", "OutOfMemory", "rollout.slots=")
TAIL_LINES = 12
# (check id, label) in table order; the shell script writes OUT_DIR/<id>.status (exit code and seconds) and .log
CHECKS = (
    ("env", "environment"),
    ("parity", "parity tests"),
    ("generate", "generation vs transformers"),
    ("grpo", "GRPO step (local backend)"),
)
# The tiny GRPO model: the Qwen2 family of the full shape (q/k/v bias, tied embeddings, a vocabulary larger than the
# tokenizer's), small enough for a CPU.
TINY_QWEN = dict(
    vocab_size=2304,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    sliding_windows=(),
)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str))


# ------------------------------------------------------------------------------------------------------------ env
def cmd_env(args: argparse.Namespace) -> None:
    import importlib.metadata as md

    import jax

    versions = {}
    for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "transformers", "torch"):
        with contextlib.suppress(md.PackageNotFoundError):
            versions[name] = md.version(name)
    devices = jax.devices()
    info = {
        "commit": _commit(),
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "versions": versions,
        "ray_importable": _importable("ray"),
    }
    print(json.dumps(info, indent=2))
    expected = args.expect_backend
    if expected and info["backend"] != expected:
        raise SystemExit(
            f"JAX runs on {info['backend']!r}, expected {expected!r} (JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')})"
        )
    write_json(args.out, info)


def _commit() -> str:
    """The checkout's commit (with `+ local changes` when its tracked files differ from it); a copy without git
    history gives `GPU_CHECK_COMMIT` (set it where the tree was copied from), else "unknown"."""

    def git(*command: str) -> str:
        try:
            done = subprocess.run(["git", *command], capture_output=True, text=True, cwd=ROOT, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    sha = git("rev-parse", "--short", "HEAD")
    if not sha:
        return os.environ.get("GPU_CHECK_COMMIT", "unknown")
    return sha + (" + local changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# --------------------------------------------------------------------------------------------------------- pytest
def cmd_pytest(args: argparse.Namespace) -> None:
    """Counts per test file from a JUnit XML (each testcase's `file` attribute, else its class name)."""
    counts: dict[str, dict[str, int]] = {f: {"passed": 0, "failed": 0, "skipped": 0} for f in args.files}
    failures: list[str] = []
    if args.junit.is_file():
        for case in ET.parse(args.junit).getroot().iter("testcase"):
            file = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
            key = next((f for f in counts if file.endswith(f) or f.endswith(file)), file)
            entry = counts.setdefault(key, {"passed": 0, "failed": 0, "skipped": 0})
            if case.find("failure") is not None or case.find("error") is not None:
                entry["failed"] += 1
                failures.append(f"{key}::{case.get('name')}")
            elif case.find("skipped") is not None:
                entry["skipped"] += 1
            else:
                entry["passed"] += 1
    # nothing printed: the end of the check's log stays pytest's summary (what the table shows for a failure)
    write_json(args.out, {"files": counts, "failures": failures, "junit": str(args.junit)})


# ------------------------------------------------------------------------------------------------------- generate
def cmd_generate(args: argparse.Namespace) -> None:
    """Runs scripts/bench/bench_generate.py's `main` in this process; when JAX runs on a GPU (and torch sees one), the
    transformers reference runs on that GPU too: torch's default device becomes CUDA (the prompt tensors) and the
    reference model is moved there after `from_pretrained`. TF32 matmuls on both sides (JAX's GPU default)."""
    import jax

    bench_args = [a for a in args.bench_args if a != "--"]
    torch_device = "cpu"
    if jax.default_backend() == "gpu":
        import torch
        import transformers

        if not torch.cuda.is_available():
            raise SystemExit("JAX runs on a GPU but torch sees no CUDA device: transformers would run on the CPU")
        torch_device = "cuda"
        torch.set_default_device("cuda")
        torch.set_float32_matmul_precision("high")  # TF32, as JAX's default precision for float32 on GPUs
        loader = transformers.AutoModelForCausalLM.from_pretrained

        def on_gpu(*a: Any, **kw: Any) -> Any:
            return loader(*a, **kw).to("cuda")

        transformers.AutoModelForCausalLM.from_pretrained = on_gpu
    sys.path.insert(0, str(SCRIPTS))
    import bench_generate

    sys.argv = ["bench_generate.py", *bench_args]
    bench_generate.main()
    out_flag = bench_args.index("--out") + 1 if "--out" in bench_args else None
    bench_json = Path(bench_args[out_flag]) if out_flag else Path("runs/bench/generate.json")
    bench = json.loads(bench_json.read_text())
    rates = {row["system"]: row["output tokens/s"] for row in bench["rows"]}
    summary = {
        "torch_device": torch_device,
        "jax_backend": jax.default_backend(),
        "title": bench["title"],
        "tokens_per_s": rates,
        "bench_json": str(bench_json),
    }
    for mode in ("sampled", "greedy"):
        ours = next((v for k, v in rates.items() if k.startswith("hfjax") and mode in k), None)
        theirs = next((v for k, v in rates.items() if k.startswith("transformers") and mode in k), None)
        summary[mode] = {"hfjax": ours, "transformers": theirs}
    write_json(args.out, summary)


# ----------------------------------------------------------------------------------------------------------- grpo
def build_qwen_checkpoint(out: Path, tiny: bool) -> Path:
    """A random-weight Hugging Face Qwen2 checkpoint of `NAMED_CONFIGS["qwen2.5-0.5b"]`'s shape (tiny: `TINY_QWEN`)
    in bfloat16, with a local byte-level BPE tokenizer (vocabulary 8192, tiny 2048: enough merges for the
    workload's words; the reference checkpoint's corpus) whose ids 0-2 are pad/bos/eos. Built once: an existing
    `out/config.json` is reused."""
    if (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file():
        return out
    import torch
    import transformers

    sys.path.insert(0, str(SCRIPTS))
    from make_reference_ckpt import tokenizer_corpus

    from hfjax.models.local_tokenizer import build_bpe_tokenizer
    from hfjax.models.presets import NAMED_CONFIGS

    shape = NAMED_CONFIGS["qwen2.5-0.5b"]
    shape = (
        dataclasses.replace(shape, **TINY_QWEN) if tiny else dataclasses.replace(shape, max_position_embeddings=32768)
    )
    tokenizer = build_bpe_tokenizer(tokenizer_corpus(), 2048 if tiny else 8192)
    hf = shape.to_hf_dict("causal_lm", "bfloat16")
    hf.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    config = transformers.Qwen2Config(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    params = sum(p.numel() for p in model.parameters())
    print(f"random Qwen2 checkpoint at {out}: {params / 1e6:.1f}M parameters, vocabulary {config.vocab_size}")
    return out


def grpo_config(args: argparse.Namespace, ckpt: Path, workload: Path, response_length: int, run_dir: Path) -> dict:
    """configs/gsm8k/qwen2.5-0.5b-grpo-1gpu.yaml (verl's 1-GPU GRPO recipe: bf16 compute, float32 master weights,
    KL loss, micro-batches of 16) with this check's model, prompts, lengths and steps, the local backend, and
    responses of exactly `response_length` tokens (eos ignored, so the work is fixed)."""
    import yaml

    cfg = yaml.safe_load(GRPO_CONFIG.read_text())
    rows = args.prompts * args.group
    cfg["model_path"] = str(ckpt)
    cfg["data"] = {"train_files": [str(workload)], "max_prompt_length": args.max_prompt_length,
                   "train_batch_size": args.prompts}  # fmt: skip
    cfg["actor"].update(
        ppo_mini_batch_size=min(args.mini_batch or rows, rows), micro_batch_size=args.micro_batch, remat=args.remat
    )
    cfg["rollout"].update(
        n=args.group, response_length=response_length, slots=min(args.slots or rows, rows), ignore_eos=True
    )
    cfg["reward"] = {"function": REWARD}
    cfg["trainer"] = {
        "run_dir": str(run_dir),
        "total_steps": args.steps,
        "backend": "local",
        "device": "cpu" if args.tiny else "gpu",
        "hosts": 1,
        "devices_per_host": 1,
        "resume": "never",
        "logger": ["console", "jsonl"],
        "plot": False,
        "progress": False,
    }
    return cfg


def cmd_grpo(args: argparse.Namespace) -> None:
    """Builds the checkpoint and prompts, then runs one attempt per response length (each in a fresh process, so
    that device memory starts empty) until one finishes; a failure other than running out of memory stops."""
    from hfjax.xla_settings import enable_compilation_cache

    enable_compilation_cache()  # as the hfjax command line
    work = args.out.parent / "grpo"
    ckpt = build_qwen_checkpoint(args.ckpt or work / ("qwen2-tiny-random" if args.tiny else "qwen2.5-0.5b-random"),
                                 args.tiny)  # fmt: skip
    sys.path[:0] = [str(SCRIPTS), str(SCRIPTS / "peers")]
    from workload import write_workload

    workload = write_workload(ckpt, work / f"prompts-{args.prompts}.parquet", args.prompts, args.max_prompt_length)
    attempts = []
    for length in [int(x) for x in args.response_lengths.split(",")]:
        result = work / f"attempt-{length}.json"
        result.unlink(missing_ok=True)
        run_dir = work / f"run-{length}"  # trainer.resume=never: a fresh directory for every attempt
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = [sys.executable, __file__, "grpo-once", str(result), str(ckpt), str(workload), str(run_dir), str(length)]
        cmd += _forward(args)
        print(f"GRPO attempt: responses of {length} tokens", flush=True)
        started = time.perf_counter()
        code, output = _run_streamed(cmd)
        attempt = {"response_length": length, "exit_code": code, "seconds": time.perf_counter() - started}
        if code == 0 and result.is_file():
            summary = json.loads(result.read_text())
            summary["attempts"] = [*attempts, attempt]
            summary["fallback"] = len(attempts) > 0
            write_json(args.out, summary)
            return
        attempt["error_tail"] = output.splitlines()[-TAIL_LINES:]
        attempts.append(attempt)
        if not any(marker in output for marker in OOM_MARKERS):
            break
        print(f"responses of {length} tokens ran out of memory; trying the next length", flush=True)
    write_json(args.out, {"attempts": attempts})
    raise SystemExit(f"GRPO failed at every response length tried: {[a['response_length'] for a in attempts]}")


def _run_streamed(cmd: list[str]) -> tuple[int, str]:
    """Runs `cmd`, echoing its output line by line as it comes (so a check stopped at its time limit still shows
    how far the attempt got, and where it hung); returns its exit code and output."""
    lines = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            lines.append(line)
    return proc.returncode, "".join(lines)


def _forward(args: argparse.Namespace) -> list[str]:
    out = ["--prompts", str(args.prompts), "--group", str(args.group), "--steps", str(args.steps)]
    out += ["--max-prompt-length", str(args.max_prompt_length), "--micro-batch", str(args.micro_batch)]
    out += ["--mini-batch", str(args.mini_batch), "--slots", str(args.slots), "--remat", args.remat]
    out += ["--save" if args.save else "--no-save"]
    return out + (["--tiny"] if args.tiny else [])


def cmd_grpo_once(args: argparse.Namespace) -> None:
    """One GRPO run of `args.steps` iterations at one response length (`run_rl`, as scripts/bench/bench_rl_step.py
    drives it); writes the per-step times and token rates. The first step includes compiles; the summary takes the
    steps after it (all of them when there is one)."""
    import statistics

    from hfjax.config.rl import load_rl_config
    from hfjax.trainer import rl
    from hfjax.trainer.launch import run_rl

    if not args.save:  # a benchmark: no final checkpoint (the 0.5B actor's state is ~6 GB of writes)
        rl.RLTrainer.save = lambda self: None
    cfg = grpo_config(args, args.ckpt, args.workload, args.response_length, args.run_dir)
    history = run_rl(load_rl_config(cfg))
    steady = history[1:] or history
    step_s = statistics.median(h["timing_s/step"] for h in steady)
    rate = sum(h["perf/total_num_tokens"] for h in steady) / sum(h["timing_s/step"] for h in steady)
    responses = args.prompts * args.group * args.response_length
    stages = {k.removeprefix("timing_s/"): v for k, v in history[-1].items() if k.startswith("timing_s/")}
    write_json(
        args.out,
        {
            "seconds_per_step": step_s,
            "tokens_per_s": rate,
            "response_tokens_per_s": responses / step_s,
            "first_step_s": history[0]["timing_s/step"],
            "device_peak_gib": max(h.get("perf/device_peak_bytes", 0) for h in history) / 2**30,
            "step_s": [h["timing_s/step"] for h in history],
            "last_step_stages_s": stages,
            "workload": {
                "prompts": args.prompts,
                "group": args.group,
                "response_length": args.response_length,
                "max_prompt_length": args.max_prompt_length,
                "ppo_mini_batch_size": cfg["actor"]["ppo_mini_batch_size"],
                "micro_batch_size": args.micro_batch,
                "remat": args.remat,
                "slots": cfg["rollout"]["slots"],
                "dtype": cfg["actor"]["dtype"],
                "backend": "local",
            },
            "checkpoint": str(args.ckpt),
            "run_dir": str(args.run_dir),
        },
    )


# ---------------------------------------------------------------------------------------------------------- table
def _status(out_dir: Path, check: str) -> tuple[int | None, float | None]:
    path = out_dir / f"{check}.status"
    if not path.is_file():
        return None, None
    fields = path.read_text().split()
    return int(fields[0]), float(fields[1]) if len(fields) > 1 else None


def _tail(out_dir: Path, check: str) -> str:
    log = out_dir / f"{check}.log"
    if not log.is_file():
        return ""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return "\n".join(lines[-TAIL_LINES:])


def _load(out_dir: Path, check: str) -> dict[str, Any] | None:
    path = out_dir / f"{check}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def table_rows(out_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One row per reported quantity: (check, item, status ok/FAILED/skipped, result text, seconds, error tail)."""
    rows: list[dict[str, Any]] = []
    env = _load(out_dir, "env") or {}
    for check, label in CHECKS:
        code, seconds = _status(out_dir, check)
        result = _load(out_dir, check)
        if code is None:
            rows.append({"check": label, "item": "", "status": "skipped", "result": "not run", "seconds": None})
            continue
        failed = code != 0 or result is None
        if check == "parity" and code == 1 and result and result["failures"]:
            failed = False  # pytest's "some tests failed": the rows of the files with failures say FAILED
        error = None
        if failed:
            why = "timed out" if code in (124, 137) else f"exit code {code}"
            error = f"{why}\n{_tail(out_dir, check)}".strip()
        items = _items(check, result or {}, env)
        if not items:
            items = [("", "")]
        for item, text, *item_failed in items:
            bad = failed or bool(item_failed and item_failed[0])
            row = {"check": label, "item": item, "status": "FAILED" if bad else "ok", "result": text}
            row["seconds"] = seconds
            if bad:
                row["error"] = error or text
            rows.append(row)
    return rows, env


def _items(check: str, result: dict[str, Any], env: dict[str, Any]) -> list[tuple]:
    """(item, result text[, failed]) of one check's result JSON."""
    if check == "env" and result:
        versions = ", ".join(f"{k} {v}" for k, v in env.get("versions", {}).items())
        return [("commit", env.get("commit", "unknown")),
                ("jax / device", f"jax {env['jax_version']}, {env['backend']} x{env['device_count']}: "
                 f"{env['device_kind']}"),
                ("packages", versions or "none found")]  # fmt: skip
    if check == "parity" and result:
        out = []
        for file, c in result["files"].items():
            text = f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"
            out.append((file, text, c["failed"] > 0 or c["passed"] == 0))
        return out
    if check == "generate" and result:
        out = []
        for mode in ("sampled", "greedy"):
            ours, theirs = result[mode]["hfjax"], result[mode]["transformers"]
            if ours is None or theirs is None:
                out.append((mode, "no tokens/s in bench_generate's JSON", True))
                continue
            text = f"hfjax {ours:,.0f} tok/s vs transformers ({result['torch_device']}) {theirs:,.0f} tok/s"
            out.append((mode, f"{text} = {ours / theirs:.2f}x"))
        return out
    if check == "grpo" and result.get("workload"):
        w = result["workload"]
        fallback = " (fallback: the longer ones ran out of memory)" if result.get("fallback") else ""
        remat = f", remat {w['remat']}" if w.get("remat", "none") != "none" else ""
        item = f"{w['prompts']} prompts x {w['group']} x {w['response_length']} tokens{remat}{fallback}"
        peak = f"; peak {result['device_peak_gib']:.2f} GiB/device" if result.get("device_peak_gib") else ""
        text = (
            f"{result['seconds_per_step']:.2f} s/step, {result['tokens_per_s']:,.0f} tok/s "
            f"({result['response_tokens_per_s']:,.0f} response tok/s; first step {result['first_step_s']:.1f} s{peak})"
        )
        return [(item, text)]
    return []


def cmd_table(args: argparse.Namespace) -> None:
    rows, env = table_rows(args.out_dir)
    wall = float(os.environ["GPU_CHECK_WALL_S"]) if os.environ.get("GPU_CHECK_WALL_S") else None
    title = (
        f"hfjax GPU check ({args.mode}): jax {env.get('jax_version', '?')}, {env.get('backend', '?')}, "
        f"{env.get('device_kind', '?')}" + (f", {wall:.0f} s wall" if wall is not None else "")
    )
    print_table(title, rows)
    failed = [r for r in rows if r["status"] == "FAILED"]
    for row in failed:
        print(f"\n--- {row['check']} {row['item']}: {row['status']}\n{row.get('error', row['result'])}")
    summary = {
        "title": title,
        "mode": args.mode,
        "ok": not failed,
        "wall_s": wall,
        "jax_version": env.get("jax_version"),
        "backend": env.get("backend"),
        "device_kind": env.get("device_kind"),
        "environment": env,
        "rows": rows,
        "details": {check: _load(args.out_dir, check) for check, _ in CHECKS},
    }
    write_json(args.out_dir / "gpu_check.json", summary)
    print(f"\nwrote {args.out_dir / 'gpu_check.json'}")
    if failed:
        raise SystemExit(1)


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    """A plain-text table (no terminal width assumed)."""
    columns = ("check", "item", "status", "result", "seconds")
    cells = [[str(r[c]) if c != "seconds" else (f"{r[c]:.0f}" if r[c] is not None else "") for c in columns]
             for r in rows]  # fmt: skip
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = "+".join("-" * (w + 2) for w in widths)
    print(f"\n{title}\n+{line}+")
    print("| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)) + " |")
    print(f"+{line}+")
    for row in cells:
        print("| " + " | ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) + " |")
    print(f"+{line}+")


# ----------------------------------------------------------------------------------------------------------- main
def _grpo_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiny", action="store_true", help="the tiny Qwen2 model on the CPU")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--group", type=int, default=5, help="rollout.n: samples per prompt")
    parser.add_argument("--steps", type=int, default=2, help="GRPO iterations (the first includes compiles)")
    parser.add_argument("--max-prompt-length", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--mini-batch", type=int, default=0, help="actor.ppo_mini_batch_size (0: the whole batch)")
    parser.add_argument("--slots", type=int, default=0, help="rollout.slots (0: every sample at once)")
    parser.add_argument("--remat", default="none", choices=("none", "full", "dots"), help="actor.remat")
    parser.add_argument("--save", action=argparse.BooleanOptionalAction, default=False, help="final checkpoint")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("env")
    p.add_argument("out", type=Path)
    p.add_argument("--expect-backend", help="fail unless JAX's default backend is this (gpu, cpu)")
    p = sub.add_parser("pytest")
    p.add_argument("junit", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("files", nargs="+")
    p = sub.add_parser("generate")
    p.add_argument("out", type=Path)
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p = sub.add_parser("grpo")
    p.add_argument("out", type=Path)
    p.add_argument("--ckpt", type=Path, help="a Qwen2 checkpoint to use instead of building the random one")
    p.add_argument("--response-lengths", default="512,256,128", help="tried in order until one fits")
    _grpo_flags(p)
    p = sub.add_parser("grpo-once")
    for name in ("out", "ckpt", "workload", "run_dir"):
        p.add_argument(name, type=Path)
    p.add_argument("response_length", type=int)
    _grpo_flags(p)
    p = sub.add_parser("table")
    p.add_argument("out_dir", type=Path)
    p.add_argument("--mode", default="full")
    args = parser.parse_args()
    block = os.environ.get("GPU_CHECK_BLOCK_RAY") == "1"
    if block and args.command in ("generate", "grpo", "grpo-once") and "ray" not in sys.modules:
        sys.modules["ray"] = None  # as on the GPU machine (no Ray): an `import ray` on these paths fails here too
    commands = {"env": cmd_env, "pytest": cmd_pytest, "generate": cmd_generate, "grpo": cmd_grpo,
                "grpo-once": cmd_grpo_once, "table": cmd_table}  # fmt: skip
    commands[args.command](args)


if __name__ == "__main__":
    main()
