"""`hfjax serve` on a tiny local Llama, driven with the official `tinker` SDK only: supervised loss goes down over
20 forward_backward + optim_step calls; `forward` log probs of a fresh adapter equal the transformers model's own;
sampling after save_weights_for_sampler reflects the trained adapter and its log probs equal a teacher-forced pass;
save_state -> a restarted server -> load_state continues bitwise; two clients training at once get the adapters
each gets alone; the exported PEFT adapter loads in peft to the service's log probs; bad input is refused by name.
Beside the SDK: the models in a Ray worker (`backend: ray`) and under an fsdp x tensor layout train as in process on
one device."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from pathlib import Path

import numpy as np
import peft
import pytest
import tinker
import torch
import transformers as tf
from support.checkpoints import save_hf_model
from support.rl_setup import TINY
from tinker import types

from hfjax.serve.app import create_app
from hfjax.serve.backend import AdamStep, SampleRequest, ServeError, TrainDatum
from hfjax.serve.config import ServeConfig
from hfjax.serve.http_server import ServerThread
from hfjax.serve.worker_backend import start_backend

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
pytest_plugins = ["support.ray_cluster"]
VOCAB = 97
PROMPT = [5, 17, 33, 2]
TARGET = [40, 41, 42, 43, 44, 45]  # what training teaches after PROMPT


class Server:
    """A served tiny model and a `client` of it: `start` (again after `stop`: a restart over the same run directory).
    `stop` ends the client's session first (else its SDK keeps sending heartbeats to the stopped server, and warns
    about each failure minutes later in another test's output)."""

    def __init__(self, config: ServeConfig):
        self.config, self.thread, self.backend, self.client = config, None, None, None

    def start(self) -> None:
        self.backend = start_backend(self.config)
        app = create_app(self.backend, run_dir=self.config.run_dir, tokenizer_id=self.config.tokenizer)
        self.thread = ServerThread(app)
        self.client = tinker.ServiceClient(base_url=self.thread.start(), api_key="tml-hfjax-tests")

    def stop(self) -> None:
        self.client.close("success").result()
        self.thread.stop()
        self.backend.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # a head of larger weights than the default 0.02: the frozen head must be able to make peaked logits
    return save_hf_model(
        tmp_path_factory.mktemp("serve_model"), "llama", vocab_size=VOCAB, initializer_range=0.2, **TINY
    )[1]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory, monkeypatch_module):
    run_dir = str(tmp_path_factory.mktemp("serve_run"))
    config = ServeConfig(model_path=str(model_dir), run_dir=run_dir, max_prompt_tokens=16, max_new_tokens=8, slots=4,
                         max_train_tokens=64, max_lora_rank=16)  # fmt: skip
    served = Server(config)
    served.start()
    yield served
    served.stop()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TINKER_TELEMETRY", "0")
        yield patch


def datum(tokens: list[int]) -> types.Datum:
    """Next-token prediction over `tokens` (every position weighted 1)."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(tokens[1:], np.int64),
            "weights": np.ones(len(tokens) - 1, np.float32),
        },
    )


def logprobs(client: tinker.TrainingClient, tokens: list[int]) -> np.ndarray:
    out = client.forward([datum(tokens)], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].to_numpy()


def train(client: tinker.TrainingClient, steps: int, data: list[list[int]], lr: float = 5e-3) -> list[float]:
    losses = []
    for _ in range(steps):
        fb = client.forward_backward([datum(t) for t in data], "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=lr)).result()
        losses.append(fb.result().metrics["loss:sum"])
    return losses


def test_supervised_training_lowers_the_loss_and_forward_equals_transformers(server, model_dir):
    client = server.client.create_lora_training_client(base_model=server.config.base_model, rank=8, seed=1).result()
    tokens = PROMPT + TARGET
    reference = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = reference(torch.tensor([tokens[:-1]])).logits[0]
    want = torch.log_softmax(logits, -1)[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].numpy()
    np.testing.assert_allclose(logprobs(client, tokens), want, atol=2e-5)  # a fresh adapter (B = 0) is the base
    losses = train(client, 20, [tokens], lr=1e-2)
    assert losses[-1] < 0.3 * losses[0], losses


def test_sampling_follows_the_saved_adapter_version(server):
    client = server.client.create_lora_training_client(base_model=server.config.base_model, rank=8, seed=2).result()
    greedy = types.SamplingParams(max_tokens=len(TARGET), temperature=0.0)
    prompt = types.ModelInput.from_ints(PROMPT)
    before = client.save_weights_and_get_sampling_client(name="before").result()
    untrained = before.sample(prompt=prompt, num_samples=1, sampling_params=greedy).result().sequences[0]
    train(client, 25, [PROMPT + TARGET], lr=2e-2)
    after = client.save_weights_and_get_sampling_client(name="after").result()
    trained = after.sample(prompt=prompt, num_samples=1, sampling_params=greedy).result().sequences[0]
    assert trained.tokens == TARGET and untrained.tokens != TARGET
    # the sampler's log probs are the teacher-forced pass's over the same adapter version
    teacher = logprobs(client, PROMPT + trained.tokens)[len(PROMPT) - 1 :]
    np.testing.assert_allclose(trained.logprobs, teacher, atol=1e-4)
    # a sampler keeps its version: the earlier one still samples what it did
    again = before.sample(prompt=prompt, num_samples=1, sampling_params=greedy).result().sequences[0]
    assert again.tokens == untrained.tokens and again.logprobs == untrained.logprobs
    computed = after.compute_logprobs(types.ModelInput.from_ints(PROMPT + trained.tokens)).result()
    assert computed[0] is None
    np.testing.assert_allclose(computed[len(PROMPT) :], teacher, atol=1e-4)


def test_save_state_restart_load_state_continues_bitwise(server):
    data = [PROMPT + TARGET, [9, 8, 7, 6, 5, 4]]
    client = server.client.create_lora_training_client(base_model=server.config.base_model, rank=4, seed=3).result()
    train(client, 3, data)
    path = client.save_state("mid").result().path
    train(client, 2, data)
    want = logprobs(client, PROMPT + TARGET)
    server.stop()
    server.start()
    resumed = server.client.create_training_client_from_state_with_optimizer(path).result()
    train(resumed, 2, data)
    np.testing.assert_array_equal(logprobs(resumed, PROMPT + TARGET), want)


def test_two_clients_at_once_train_what_each_trains_alone(server):
    data = {1: [PROMPT + TARGET], 2: [[3, 1, 4, 1, 5, 9, 2, 6]]}

    def trained(which: int) -> np.ndarray:
        client = server.client.create_lora_training_client(base_model=server.config.base_model, rank=4, seed=7).result()
        train(client, 5, data[which])
        return logprobs(client, PROMPT + TARGET)

    alone = {which: trained(which) for which in data}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        together = dict(zip(data, pool.map(trained, data), strict=True))
    for which in data:
        np.testing.assert_array_equal(together[which], alone[which])
    assert not np.array_equal(alone[1], alone[2])


def test_the_exported_adapter_loads_in_peft(server, model_dir):
    client = server.client.create_lora_training_client(base_model=server.config.base_model, rank=4, seed=4).result()
    train(client, 3, [PROMPT + TARGET])
    path = client.save_state("export").result().path
    directory = server.backend.checkpoint_directory(path) if hasattr(server.backend, "checkpoint_directory") else None
    peft_dir = next(Path(server.config.run_dir).rglob("export/peft")) if directory is None else Path(directory) / "peft"
    base = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, peft_dir).eval()
    tokens = PROMPT + TARGET
    with torch.no_grad():
        logits = adapted(torch.tensor([tokens[:-1]])).logits[0]
    want = torch.log_softmax(logits, -1)[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].numpy()
    np.testing.assert_allclose(logprobs(client, tokens), want, atol=2e-5)


@pytest.mark.parametrize(
    "case, match",
    [
        ("unknown_base", "base_model"),
        ("rank", "rank"),
        ("token_id", "token ids"),
        ("lengths", "values for"),
        ("loss", "loss_fn"),
    ],
)
def test_bad_input_is_refused_by_name(server, case, match):
    if case == "unknown_base":
        with pytest.raises(Exception, match=match):
            server.client.create_lora_training_client(base_model="no-such-model", rank=4).result()
        return
    if case == "rank":
        with pytest.raises(Exception, match=match):
            server.client.create_lora_training_client(base_model=server.config.base_model, rank=1024).result()
        return
    client = server.client.create_lora_training_client(base_model=server.config.base_model, rank=4, seed=5).result()
    bad = {
        "token_id": datum([1, 2, VOCAB + 5]),
        "lengths": types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": np.asarray([2, 3], np.int64), "weights": np.ones(2, np.float32)},
        ),
        "loss": datum([1, 2, 3]),
    }[case]
    with pytest.raises(Exception, match=match):
        client.forward_backward([bad], "dro" if case == "loss" else "cross_entropy").result()
    # nothing else was disturbed: the client still trains
    assert np.isfinite(train(client, 1, [[1, 2, 3, 4]])[0])


@pytest.mark.ray
def test_the_models_in_a_ray_worker_answer_as_in_process(server, ray_cluster, tmp_path):
    """`backend: ray` (the models in a worker process on the Ray cluster): the same adapter trains to bitwise the
    same log probs as in the server's process, and a refusal crosses the process boundary as the same error."""
    remote = start_backend(dataclasses.replace(server.config, backend="ray", device="cpu", run_dir=str(tmp_path)))
    try:
        outputs = []
        for backend in (server.backend, remote):
            backend.create_adapter("ray-check", server.config.base_model, 4, 9, True, True)
            data = [TrainDatum(np.asarray(PROMPT + TARGET[:-1]), {"target_tokens": np.asarray(PROMPT[1:] + TARGET)})]
            backend.forward_backward("ray-check", data, "cross_entropy", None, True)
            backend.optim_step("ray-check", AdamStep(learning_rate=1e-2))
            outputs.append(backend.forward_backward("ray-check", data, "cross_entropy", None, False)[0][0]["logprobs"])
            backend.unload("ray-check")
        np.testing.assert_array_equal(outputs[1], outputs[0])
        with pytest.raises(ServeError, match=r"lora_config\.rank") as refused:
            remote.create_adapter("ray-check", server.config.base_model, 1024, 0, True, True)
        assert refused.value.status == 400
    finally:
        remote.shutdown()


def test_adapters_under_fsdp_and_tensor_parallelism_train_as_on_one_device(server, tmp_path):
    """The config's `layout` (here fsdp 4 x tensor 2 over the 8 fake devices) shards the base and the adapters: three
    Adam steps give one device's log probs, and greedy samples of the saved version are one device's."""
    layout = {"mesh": {"fsdp": 4, "tensor": 2}, "rules": "fsdp_tp"}
    sharded = start_backend(dataclasses.replace(server.config, layout=layout, run_dir=str(tmp_path)))
    data = [TrainDatum(np.asarray(PROMPT + TARGET[:-1]), {"target_tokens": np.asarray(PROMPT[1:] + TARGET)}),
            TrainDatum(np.asarray([9, 8, 7, 6]), {"target_tokens": np.asarray([8, 7, 6, 5])})]  # fmt: skip
    greedy = SampleRequest(np.asarray(PROMPT), num_samples=1, max_tokens=6, temperature=0.0, stop_token_ids=())
    results = []
    try:
        for backend in (server.backend, sharded):
            backend.create_adapter("layout-check", server.config.base_model, 4, 11, True, True)
            for _ in range(3):
                backend.forward_backward("layout-check", data, "cross_entropy", None, True)
                backend.optim_step("layout-check", AdamStep(learning_rate=1e-2))
            outputs = backend.forward_backward("layout-check", data, "cross_entropy", None, False)[0]
            version = backend.save_for_sampler("layout-check", "v")
            sample = backend.sample(version, server.config.base_model, [greedy])[0].sequences[0]
            results.append((np.concatenate([o["logprobs"] for o in outputs]), sample.tokens))
            backend.unload("layout-check")
    finally:
        sharded.shutdown()
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    assert results[1][1] == results[0][1]
