"""An RL loop written against the Tinker SDK alone, run against `hfjax serve`: GRPO-style group sampling on the
quickstart's addition task, exact-match rewards, group-mean baselines and the `importance_sampling` loss on a LoRA
training client; held-out greedy accuracy before and after.

    hfjax quickstart run_dir=runs/qs rl.trainer.total_steps=1       # the SFT checkpoint and the task's data
    hfjax serve model_path=runs/qs/sft/hf name=addition-sft max_prompt_tokens=32 max_new_tokens=8 slots=256 &
    python examples/tinker_rl_addition.py --base-url http://127.0.0.1:8000 --base-model addition-sft \
        --data runs/qs/data

Uses only `tinker`, the tokenizer the service names (`get_tokenizer()`) and the task's parquet files.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence

import numpy as np
import pyarrow.parquet as pq
import tinker
from tinker import types


def load_prompts(path: str) -> list[tuple[list[dict], str]]:
    """(chat messages, the answer) of each row of a prompt-schema parquet file."""
    table = pq.read_table(path).to_pylist()
    return [(list(row["prompt"]), str(row["reward_model"]["ground_truth"])) for row in table]


def encode(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def reward(tokenizer, tokens: Sequence[int], answer: str) -> float:
    """1 where the response (its end-of-sequence token dropped) is exactly the answer, else 0."""
    return float(tokenizer.decode(list(tokens), skip_special_tokens=True).strip() == answer)


def accuracy(sampler: tinker.SamplingClient, tokenizer, rows, max_tokens: int, stop: list[int]) -> float:
    greedy = types.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop)
    futures = [sampler.sample(types.ModelInput.from_ints(encode(tokenizer, m)), 1, greedy) for m, _ in rows]
    return float(
        np.mean([reward(tokenizer, f.result().sequences[0].tokens, a) for f, (_, a) in zip(futures, rows, strict=True)])
    )


def rl_datum(prompt: list[int], tokens: list[int], logprobs: list[float], advantage: float) -> types.Datum:
    """The sampled sequence as a training datum: the loss sees only its response tokens."""
    full = prompt + tokens
    before = len(prompt) - 1  # targets that are prompt tokens: no advantage
    inputs = {
        "target_tokens": np.asarray(full[1:], np.int64),
        "logprobs": np.asarray([0.0] * before + list(logprobs), np.float32),
        "advantages": np.asarray([0.0] * before + [advantage] * len(tokens), np.float32),
    }
    return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs=inputs)


def run(args: argparse.Namespace) -> dict[str, float]:
    service = tinker.ServiceClient(base_url=args.base_url, api_key=os.environ.get("TINKER_API_KEY", "tml-local"))
    trainer = service.create_lora_training_client(base_model=args.base_model, rank=args.rank, seed=args.seed).result()
    tokenizer = trainer.get_tokenizer()
    stop = [tokenizer.eos_token_id]
    train_rows = load_prompts(os.path.join(args.data, "train.parquet"))
    test_rows = load_prompts(os.path.join(args.data, "test.parquet"))[: args.test_prompts]
    rng = np.random.default_rng(args.seed)
    sampler = trainer.save_weights_and_get_sampling_client(name="step-0").result()
    before = accuracy(sampler, tokenizer, test_rows, args.max_tokens, stop)
    print(f"held-out accuracy before RL: {before:.1%}")
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, stop=stop)
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = [train_rows[i] for i in rng.choice(len(train_rows), args.batch, replace=False)]
        prompts = [encode(tokenizer, m) for m, _ in batch]
        futures = [sampler.sample(types.ModelInput.from_ints(p), args.group_size, params) for p in prompts]
        data, rewards = [], []
        for prompt, (_, answer), future in zip(prompts, batch, futures, strict=True):
            group = future.result().sequences
            scores = np.asarray([reward(tokenizer, s.tokens, answer) for s in group])
            rewards.extend(scores)
            for seq, advantage in zip(group, scores - scores.mean(), strict=True):
                if advantage != 0 and seq.tokens:
                    data.append(rl_datum(prompt, list(seq.tokens), list(seq.logprobs), float(advantage)))
        if data:
            trainer.forward_backward(data, "importance_sampling")
            trainer.optim_step(types.AdamParams(learning_rate=args.lr)).result()
        sampler = trainer.save_weights_and_get_sampling_client(name=f"step-{step}").result()
        if step % 10 == 0 or step == args.steps:
            print(f"step {step}: mean reward {np.mean(rewards):.3f}, {time.perf_counter() - started:.0f} s")
    after = accuracy(sampler, tokenizer, test_rows, args.max_tokens, stop)
    print(f"held-out accuracy after RL: {after:.1%} ({100 * (after - before):+.1f} points)")
    return {"before": before, "after": after, "gain_points": 100 * (after - before), "steps": args.steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--base-model", required=True, help="the served base model's name")
    parser.add_argument("--data", required=True, help="directory with the task's train.parquet and test.parquet")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--test-prompts", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the accuracies as JSON here")
    args = parser.parse_args()
    result = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
