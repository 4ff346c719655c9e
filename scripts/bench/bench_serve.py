"""The overhead of `hfjax serve`: `forward_backward` (+ `optim_step`) and `sample` calls through the service,
driven with the official `tinker` SDK by 1, 2 and 4 concurrent clients, beside the same calls made on the service's
worker group directly (no HTTP, no futures), in one process on the reference checkpoint.

Workload: each training call is `--batch` sequences of `--length` tokens (cross_entropy, LoRA rank `--rank`), then
one Adam step; each sampling call is `--samples` samples of `--new-tokens` tokens (temperature 1, no stop token)
for a 32-token prompt. Clients run their calls back to back; the service runs every client's calls on one queue, so
calls/s of n clients against 1 shows what the queue adds or hides. Each client samples its own adapter version (one
engine call per request); the `sample, one version` rows send n requests at once to one version, which the service
gathers into shared engine calls. Usage:
    python scripts/bench/bench_serve.py [--ckpt DIR] [--calls 4] [--clients 1,2,4] [--out runs/bench/serve.json]
        [--tiny]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import default_checkpoint, parse_args, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, help="reference checkpoint (built under a temp dir when omitted)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--calls", type=int, default=4, help="calls of each kind per client")
    parser.add_argument("--clients", default="1,2,4")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/serve.json"))
    args = parse_args(
        parser, tiny={"batch": 2, "length": 16, "samples": 2, "new_tokens": 4, "calls": 2, "clients": "1,2"}
    )
    ckpt = default_checkpoint(args.ckpt, args.tiny)
    os.environ.setdefault("TINKER_TELEMETRY", "0")

    import numpy as np
    import tinker
    from tinker import types

    from hfjax.serve.app import create_app
    from hfjax.serve.backend import AdamStep, SampleRequest, TrainDatum
    from hfjax.serve.config import ServeConfig
    from hfjax.serve.http_server import ServerThread
    from hfjax.serve.worker_backend import start_backend

    clients = [int(c) for c in args.clients.split(",")]
    config = ServeConfig(model_path=str(ckpt), run_dir=tempfile.mkdtemp(prefix="bench_serve-"),
                         max_train_tokens=args.length, max_prompt_tokens=32, max_new_tokens=args.new_tokens,
                         slots=args.samples * max(clients), max_lora_rank=args.rank,
                         max_adapters=sum(clients) + 1)  # fmt: skip
    backend = start_backend(config)
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    sequences = rng.integers(3, vocab, (args.batch, args.length + 1))
    prompt = rng.integers(3, vocab, 32).tolist()
    train_tokens, sample_tokens = args.batch * args.length, args.samples * args.new_tokens
    step = AdamStep(learning_rate=1e-4)

    def direct_data() -> list[TrainDatum]:
        return [TrainDatum(s[:-1], {"target_tokens": s[1:], "weights": np.ones(args.length)}) for s in sequences]

    def sdk_data() -> list[types.Datum]:
        return [types.Datum(model_input=types.ModelInput.from_ints(s[:-1].tolist()),
                            loss_fn_inputs={"target_tokens": s[1:], "weights": np.ones(args.length, np.float32)})
                for s in sequences]  # fmt: skip

    request = SampleRequest(np.asarray(prompt), args.samples, args.new_tokens, temperature=1.0, seed=0)
    params = types.SamplingParams(max_tokens=args.new_tokens, temperature=1.0, seed=0, stop=[])  # as direct: no stop

    def timed(fn, n: int) -> float:
        fn()  # warm-up: compiles
        started = time.perf_counter()
        for _ in range(n):
            fn()
        return time.perf_counter() - started

    rows = []
    backend.create_adapter("direct", config.base_model, args.rank, 0, True, True)
    key = backend.save_for_sampler("direct", "v0")
    data = direct_data()
    direct = {
        "forward_backward": timed(
            lambda: (
                backend.forward_backward("direct", data, "cross_entropy", None, True),
                backend.optim_step("direct", step),
            ),
            args.calls,
        ),
        "sample": timed(lambda: backend.sample(key, config.base_model, [request]), args.calls),
    }
    tokens = {"forward_backward": train_tokens, "sample": sample_tokens, "sample, one version": sample_tokens}
    for op, seconds in direct.items():
        rows.append(["worker group, direct", 1, op, args.calls, seconds, args.calls / seconds,
                     args.calls * tokens[op] / seconds, 1.0])  # fmt: skip

    server = ServerThread(create_app(backend, run_dir=config.run_dir, tokenizer_id=config.tokenizer))
    service = tinker.ServiceClient(base_url=server.start(), api_key="tml-bench")
    try:
        for n in clients:
            trainers = [
                service.create_lora_training_client(base_model=config.base_model, rank=args.rank, seed=i).result()
                for i in range(n)
            ]
            samplers = [t.save_weights_and_get_sampling_client(name="v0").result() for t in trainers]
            sdk = sdk_data()

            def train(client: tinker.TrainingClient, sdk: list[types.Datum] = sdk) -> None:
                fb = client.forward_backward(sdk, "cross_entropy")
                client.optim_step(types.AdamParams(learning_rate=1e-4)).result()
                fb.result()

            def sample(client: tinker.SamplingClient) -> None:
                client.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=args.samples,
                              sampling_params=params).result()  # fmt: skip

            # each client samples its own adapter version; then n requests on one version (batched in the engine)
            runs = [("forward_backward", train, trainers), ("sample", sample, samplers)]
            if n > 1:
                runs.append(("sample, one version", sample, [samplers[0]] * n))
            for op, fn, targets in runs:
                with concurrent.futures.ThreadPoolExecutor(n) as pool:
                    list(pool.map(fn, targets))  # warm-up
                    started = time.perf_counter()
                    list(pool.map(lambda c, fn=fn: [fn(c) for _ in range(args.calls)], targets))
                    seconds = time.perf_counter() - started
                calls = n * args.calls
                rate = calls / seconds
                direct_rate = args.calls / direct[op.partition(",")[0]]
                rows.append([f"service, {n} client(s)", n, op, calls, seconds, rate, rate * tokens[op],
                             rate / direct_rate])  # fmt: skip
            for trainer in trainers:
                backend.unload(trainer.model_id)
    finally:
        server.stop()
        backend.shutdown()
    columns = ["path", "clients", "call", "calls", "seconds", "calls/s", "tokens/s", "x direct calls/s"]
    report("hfjax serve: the service beside its worker group", columns, rows, args.out,
           {"batch": args.batch, "length": args.length, "rank": args.rank, "samples": args.samples,
            "new_tokens": args.new_tokens, "checkpoint": str(ckpt)})  # fmt: skip


if __name__ == "__main__":
    main()
