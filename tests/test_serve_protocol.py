"""The Tinker REST API of `hfjax serve` (`hfjax.serve.app`), driven only with the official `tinker` SDK over the
deterministic `FakeBackend` (tests/support/serve_fake_backend.py), whose values are functions of token ids and the
adapter's version: forward / forward_backward outputs and metrics round-trip exactly; calls run in order on one
thread; a sampler samples the version it saved; checkpoint paths load onto new clients and after a server restart;
two clients at once each see their own model; every bad input is refused with a message naming it, disturbing
nothing else."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import re
import time
from pathlib import Path

import numpy as np
import pytest
import tinker
from support.serve_fake_backend import BASE_MODEL, FakeBackend, logprob, loss, sampled
from tinker import types
from tinker._client import AsyncTinker

from hfjax.data.synthetic import build_addition_tokenizer
from hfjax.serve import futures
from hfjax.serve.app import create_app
from hfjax.serve.http_server import ServerThread

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")
PROMPT = [4, 9, 2]


@dataclasses.dataclass
class Served:
    url: str
    backend: FakeBackend
    thread: ServerThread


def serve(run_dir: Path, tokenizer_dir: Path, **options: float) -> Served:
    """A server on a fresh `FakeBackend` over `run_dir` (again on the same one: a restarted server)."""
    backend = FakeBackend(run_dir)
    thread = ServerThread(create_app(backend, run_dir=str(run_dir), tokenizer_id=str(tokenizer_dir), **options))
    return Served(thread.start(), backend, thread)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("serve_tokenizer")
    build_addition_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def served(tokenizer_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TINKER_TELEMETRY", "0")
        server = serve(tmp_path_factory.mktemp("serve_run"), tokenizer_dir)
        yield server
        server.thread.stop()


@pytest.fixture(scope="module")
def alice(served) -> tinker.ServiceClient:
    client = tinker.ServiceClient(base_url=served.url, api_key="tml-alice")
    yield client
    client.close("success").result()  # before the server stops: else its heartbeats fail, warning minutes later


OPENED: list[tinker.ServiceClient] = []  # by `service_client`: their heartbeats end with the test


def service_client(url: str, key: str) -> tinker.ServiceClient:
    """A client of the server at `url` as the user of `key`, whose session's heartbeats stop when the test ends (the
    SDK would otherwise keep sending them after the server stops, and warn about each failure minutes later in another
    test's output)."""
    OPENED.append(tinker.ServiceClient(base_url=url, api_key=key))
    return OPENED[-1]


@pytest.fixture(autouse=True)
def end_heartbeats():
    yield
    while OPENED:
        with contextlib.suppress(RuntimeError):  # "ServiceClient is closed": its heartbeats have ended already
            OPENED.pop().holder.close()


def trainer(client: tinker.ServiceClient, rank: int = 4, seed: int = 0) -> tinker.TrainingClient:
    return client.create_lora_training_client(base_model=BASE_MODEL, rank=rank, seed=seed).result()


def datum(tokens: list[int], targets: list[int], **inputs: list[float]) -> types.Datum:
    arrays = {name: np.asarray(values, np.float32) for name, values in inputs.items()}
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": np.asarray(targets, np.int64), **arrays},
    )


def want_logprobs(example: types.Datum, version: int) -> np.ndarray:
    tokens, targets = example.model_input.to_ints(), example.loss_fn_inputs["target_tokens"].tolist()
    return np.array([logprob(t, p, version) for t, p in zip(targets, tokens, strict=True)], np.float32)


def want_loss(examples: list[types.Datum], version: int, loss_fn: str, config: dict | None = None) -> float:
    def inputs(example: types.Datum) -> dict[str, np.ndarray]:
        out = {name: td.to_numpy() for name, td in example.loss_fn_inputs.items()}
        return {"weights": np.ones(len(out["target_tokens"]), np.float32), **out}

    return sum(loss(loss_fn, want_logprobs(e, version), inputs(e), config) for e in examples)


def check_outputs(result: types.ForwardBackwardOutput, examples: list[types.Datum], version: int) -> None:
    assert len(result.loss_fn_outputs) == len(examples)
    for output, example in zip(result.loss_fn_outputs, examples, strict=True):
        got = output["logprobs"].to_numpy()
        assert got.dtype == np.float32 and np.array_equal(got, want_logprobs(example, version))


def check_samples(client: tinker.SamplingClient, version: int, num_samples: int = 2, seed: int = 3) -> None:
    params = types.SamplingParams(max_tokens=5, stop=[], seed=seed)
    result = client.sample(types.ModelInput.from_ints(PROMPT), num_samples, params).result()
    assert len(result.sequences) == num_samples
    for index, sequence in enumerate(result.sequences):
        assert (sequence.tokens, sequence.logprobs, sequence.stop_reason) == sampled(
            PROMPT, version, 5, (), index, seed
        )


def test_startup_capabilities_health_and_info(served, alice, tokenizer_dir):
    capabilities = tinker.RestClient(base_url=served.url, api_key="tml-alice").get_server_capabilities().result()
    assert [model.model_name for model in capabilities.supported_models] == [BASE_MODEL]

    async def health_and_heartbeat() -> str:
        client = AsyncTinker(base_url=served.url, api_key="tml-alice")
        try:
            await client.service.session_heartbeat(session_id=alice.holder.get_session_id())
            return (await client.service.health_check()).status
        finally:
            await client.close()

    assert asyncio.run(health_and_heartbeat()) == "ok"
    client = trainer(alice, rank=8)
    info = client.get_info()
    assert (info.model_id, info.model_data.model_name, info.lora_rank) == (client.model_id, BASE_MODEL, 8)
    assert info.model_data.tokenizer_id == str(tokenizer_dir)
    assert client.get_tokenizer().decode(client.get_tokenizer().encode("12+3", add_special_tokens=False)) == "12+3"
    assert served.backend.adapters[client.model_id]["rank"] == 8


def test_forward_and_forward_backward_round_trip_in_order(served, alice):
    client = trainer(alice)
    data = [datum([1, 2, 3], [2, 3, 4], weights=[1.0, 0.5, 0.0]), datum([5, 6], [7, 8])]
    # submitted at once, run in order: the second forward sees the optimizer step before it
    futures = [
        client.forward(data, "cross_entropy"),
        client.forward_backward(data, "cross_entropy"),
        client.optim_step(types.AdamParams(learning_rate=1e-3)),
        client.forward(data, "cross_entropy"),
    ]
    forward, forward_backward, step, after = (future.result() for future in futures)
    for result, version in ((forward, 0), (forward_backward, 0), (after, 1)):
        check_outputs(result, data, version)
        assert result.metrics == {"loss:sum": pytest.approx(want_loss(data, version, "cross_entropy"), abs=1e-6)}
    assert step.metrics == {"version": 1.0, "learning_rate": 1e-3}

    rl = [datum([1, 2, 3], [2, 3, 4], logprobs=[-1.0, -0.5, -2.0], advantages=[1.0, -1.0, 0.5])]
    importance = client.forward_backward(rl, "importance_sampling").result()
    check_outputs(importance, rl, 1)
    assert importance.metrics["loss:sum"] == pytest.approx(want_loss(rl, 1, "importance_sampling"), abs=1e-6)
    config = {"clip_low_threshold": 0.1, "clip_high_threshold": 0.3}
    ppo = client.forward_backward(rl, "ppo", config).result()
    assert ppo.metrics["loss:sum"] == pytest.approx(want_loss(rl, 1, "ppo", config), abs=1e-6)
    assert ppo.metrics["loss:sum"] != pytest.approx(want_loss(rl, 1, "ppo"), abs=1e-6)  # the config arrived
    calls = [method for method, model_id in served.backend.calls if model_id == client.model_id]
    steps = ["forward", "forward_backward", "optim_step", "forward", "forward_backward", "forward_backward"]
    assert calls == ["create_adapter", *steps]


def test_sampler_samples_the_version_it_saved(served, alice):
    client = trainer(alice)
    client.optim_step(types.AdamParams()).result()
    path = client.save_weights_for_sampler("v1").result().path
    assert path == f"tinker://{client.model_id}/sampler_weights/v1"
    saved = alice.create_sampling_client(model_path=path).result()
    assert saved.get_base_model() == BASE_MODEL
    check_samples(saved, 1)
    client.optim_step(types.AdamParams()).result()
    check_samples(saved, 1)  # a later step leaves an existing sampler as it was
    check_samples(client.save_weights_and_get_sampling_client().result(), 2)
    check_samples(alice.create_sampling_client(base_model=BASE_MODEL).result(), 0, num_samples=1)

    tokens, logprobs, _ = sampled(PROMPT, 1, 5)  # a stop token ends its sample, kept as the last token
    result = saved.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=5, stop=[tokens[1]]))
    sequence = result.result().sequences[0]
    assert (sequence.tokens, sequence.logprobs, sequence.stop_reason) == (tokens[:2], logprobs[:2], "stop")
    tokenizer = client.get_tokenizer()
    saved.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=2)).result()
    assert served.backend.last_requests[0].stop_token_ids == (tokenizer.eos_token_id,)  # stop=None: end of sequence
    saved.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=2, stop="+")).result()
    assert served.backend.last_requests[0].stop_token_ids == tuple(tokenizer.encode("+", add_special_tokens=False))
    filters = types.SamplingParams(max_tokens=3, temperature=0.7, top_k=5, top_p=0.9, seed=4)
    saved.sample(types.ModelInput.from_ints(PROMPT), 1, filters).result()
    request = served.backend.last_requests[0]
    assert (request.max_tokens, request.temperature, request.top_k, request.top_p, request.seed) == (
        3,
        pytest.approx(0.7),
        5,
        pytest.approx(0.9),
        4,
    )


def test_samples_of_one_version_run_in_one_backend_call(served, alice):
    sampler = alice.create_sampling_client(base_model=BASE_MODEL).result()
    first_call = len(served.backend.sample_batches)
    served.backend.delay_s = 0.05
    try:
        blocker = trainer(alice)  # occupies the backend thread while the samples queue up
        blocking = blocker.forward([datum([1], [2])], "cross_entropy")
        futures = [
            sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=3, seed=s))
            for s in range(4)
        ]
        results = [future.result() for future in futures]
        blocking.result()
    finally:
        served.backend.delay_s = 0.0
    for seed, result in enumerate(results):
        assert result.sequences[0].tokens == sampled(PROMPT, 0, 3, seed=seed)[0]
    assert max(served.backend.sample_batches[first_call:]) > 1


def test_compute_logprobs_and_prompt_logprobs(alice):
    client = trainer(alice)
    client.optim_step(types.AdamParams()).result()
    sampler = client.save_weights_and_get_sampling_client().result()
    prompt = [3, 8, 1, 6]
    want = [None] + [logprob(t, p, 1) for p, t in itertools.pairwise(prompt)]
    assert sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result() == want
    forward = client.forward([datum(prompt[:-1], prompt[1:])], "cross_entropy").result()
    assert forward.loss_fn_outputs[0]["logprobs"].tolist() == want[1:]  # the sampler's and the trainer's agree
    params = types.SamplingParams(max_tokens=2, stop=[])
    sample = sampler.sample(types.ModelInput.from_ints(prompt), 1, params, include_prompt_logprobs=True).result()
    assert sample.prompt_logprobs == want and len(sample.sequences[0].tokens) == 2
    last_two = sampler.compute_logprobs(types.ModelInput.from_ints(prompt), prompt_logprobs_last_n=2).result()
    assert last_two == [None, None, *want[2:]]


def test_slow_calls_are_polled_until_done(tokenizer_dir, tmp_path, monkeypatch, caplog):
    """A call longer than a retrieve_future long poll is answered try_again, and the SDK polls again; the server's
    log says the call is still running while it runs."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setattr(futures, "PROGRESS_EVERY_S", 0.05)
    caplog.set_level(logging.INFO, logger="hfjax.serve")
    server = serve(tmp_path, tokenizer_dir, poll_s=0.02)
    try:
        client = trainer(service_client(server.url, "tml-erin"))
        server.backend.delay_s = 0.15
        example = [datum([1, 2], [3, 4])]
        check_outputs(client.forward(example, "cross_entropy").result(), example, 0)
    finally:
        server.thread.stop()
    assert any("because of try_again" in record.getMessage() for record in caplog.records)
    assert any(re.fullmatch(r"forward \S+ still running after \d+ s", r.getMessage()) for r in caplog.records)


def test_forward_backward_custom_runs_its_loss_client_side(served, alice):
    torch = pytest.importorskip("torch")
    client = trainer(alice)
    example = [datum([1, 2, 3], [2, 3, 4])]

    def negative_log_likelihood(data: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        total = -sum(lp.sum() for lp in logprobs)
        return total, {"nll:sum": float(total.detach())}

    result = client.forward_backward_custom(example, negative_log_likelihood).result()
    want = -float(want_logprobs(example[0], 0).sum())
    assert result.metrics["nll:sum"] == result.metrics["surrogate_loss:sum"] == pytest.approx(want)
    assert [m for m, model_id in served.backend.calls if model_id == client.model_id][-2:] == [
        "forward",
        "forward_backward",
    ]


def test_save_state_loads_onto_new_clients(served, alice):
    client = trainer(alice, rank=4)
    for _ in range(2):
        client.optim_step(types.AdamParams()).result()
    path = client.save_state("ckpt").result().path
    assert path == f"tinker://{client.model_id}/weights/ckpt"
    example = [datum([1, 2], [3, 4])]
    other = trainer(alice, rank=4)
    other.load_state(path).result()
    check_outputs(other.forward(example, "cross_entropy").result(), example, 2)
    assert served.backend.adapters[other.model_id]["steps"] == 0
    other.load_state_with_optimizer(path).result()
    assert served.backend.adapters[other.model_id]["steps"] == 2
    resumed = alice.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.model_id not in (client.model_id, other.model_id) and resumed.get_info().lora_rank == 4
    check_outputs(resumed.forward(example, "cross_entropy").result(), example, 2)
    assert served.backend.adapters[resumed.model_id]["steps"] == 2
    with pytest.raises(tinker.RequestFailedError, match="already exists"):
        client.save_state("ckpt").result()
    client.save_state("ckpt", overwrite=True).result()
    listed = tinker.RestClient(base_url=served.url, api_key="tml-alice").list_checkpoints(client.model_id).result()
    assert [(c.checkpoint_id, c.tinker_path) for c in listed.checkpoints] == [("weights/ckpt", path)]


def test_a_restarted_server_resumes_from_checkpoint_paths(tokenizer_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    first = serve(tmp_path, tokenizer_dir)
    service = service_client(first.url, "tml-dave")
    client = trainer(service, rank=8)
    for _ in range(3):
        client.optim_step(types.AdamParams()).result()
    state = client.save_state("step3").result().path
    sampler_path = client.save_weights_for_sampler("step3").result().path
    service.close("success").result()  # ends the session: its adapters are freed
    deadline = time.monotonic() + 5
    while client.model_id in first.backend.adapters and time.monotonic() < deadline:
        time.sleep(0.01)
    assert first.backend.calls[-1] == ("unload", client.model_id)
    first.thread.stop()

    second = serve(tmp_path, tokenizer_dir)
    try:
        service = service_client(second.url, "tml-dave")
        example = [datum([5, 1], [2, 7])]
        resumed = service.create_training_client_from_state(state).result()
        assert resumed.get_info().lora_rank == 8
        check_outputs(resumed.forward(example, "cross_entropy").result(), example, 3)
        assert second.backend.adapters[resumed.model_id]["steps"] == 0
        with_optimizer = service.create_training_client_from_state_with_optimizer(state).result()
        assert second.backend.adapters[with_optimizer.model_id]["steps"] == 3
        check_samples(service.create_sampling_client(model_path=sampler_path).result(), 3)
        stale = tinker.TrainingClient(service.holder, model_seq_id=99, model_id=client.model_id, info=client.get_info())
        with pytest.raises(tinker.NotFoundError, match="unknown model id"):
            stale.forward(example, "cross_entropy").result()
        service.close("success").result()
    finally:
        second.thread.stop()


def test_two_clients_at_once_each_see_their_own_model(served):
    first_event = len(served.backend.events)
    served.backend.delay_s = 0.002
    example = [datum([1, 2, 3], [4, 5, 6], weights=[1.0, 1.0, 1.0])]

    def work(name: str, steps: int) -> tuple[np.ndarray, tinker.SamplingClient]:
        client = trainer(service_client(served.url, f"tml-{name}"))
        futures = []
        for _ in range(steps):
            futures += [client.forward_backward(example, "cross_entropy"), client.optim_step(types.AdamParams())]
        for future in futures:
            future.result()
        forward = client.forward(example, "cross_entropy").result()
        return forward.loss_fn_outputs[0]["logprobs"].to_numpy(), client.save_weights_and_get_sampling_client().result()

    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            results = list(pool.map(work, ["bob", "carol"], [3, 5]))
    finally:
        served.backend.delay_s = 0.0
    for (logprobs, sampler), steps in zip(results, [3, 5], strict=True):
        assert np.array_equal(logprobs, want_logprobs(example[0], steps))
        check_samples(sampler, steps)
    events = served.backend.events[first_event:]
    assert [kind for kind, _, _ in events] == ["start", "end"] * (len(events) // 2)  # no call overlapped another
    assert len({thread for _, _, thread in events}) == 1


def test_a_model_or_sampler_is_only_its_callers(served, alice):
    client = trainer(alice)
    example = [datum([1, 2], [3, 4])]
    mallory = service_client(served.url, "tml-mallory")
    intruder = tinker.TrainingClient(mallory.holder, model_seq_id=7, model_id=client.model_id, info=client.get_info())
    with pytest.raises(tinker.NotFoundError, match="unknown model id"):
        intruder.forward(example, "cross_entropy").result()
    with pytest.raises(tinker.NotFoundError, match="unknown model id"):
        intruder.optim_step(types.AdamParams()).result()
    ghost = tinker.TrainingClient(alice.holder, model_seq_id=8, model_id="session-none:train:0", info=client.get_info())
    with pytest.raises(tinker.NotFoundError, match="unknown model id 'session-none:train:0'"):
        ghost.forward(example, "cross_entropy").result()
    handle = client.save_weights_and_get_sampling_client().result().get_sampler_handle()
    stolen = tinker.SamplingClient.from_sampler_handle(handle, api_key="tml-mallory")
    with pytest.raises(tinker.NotFoundError, match="unknown sampling session"):
        stolen.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=2)).result()
    shared = tinker.SamplingClient.from_sampler_handle(handle, api_key="tml-alice")  # joins as client 1
    shared_sample = shared.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=2))
    assert len(shared_sample.result().sequences[0].tokens) == 2
    check_outputs(client.forward(example, "cross_entropy").result(), example, 0)


@dataclasses.dataclass
class Victim:
    """What the bad-input cases act through: alice's service client, a training client (never stepped), its
    sampler, and a sampler checkpoint path."""

    service: tinker.ServiceClient
    client: tinker.TrainingClient
    sampler: tinker.SamplingClient
    sampler_path: str

    def sample(self, prompt: list[int] | types.ModelInput = PROMPT, max_tokens: int = 2, **kw) -> object:
        prompt = types.ModelInput.from_ints(prompt) if isinstance(prompt, list) else prompt
        params = types.SamplingParams(max_tokens=max_tokens, **{k: kw.pop(k) for k in ("stop",) if k in kw})
        return self.sampler.sample(prompt, 1, params, **kw).result()


@pytest.fixture(scope="module")
def victim(alice) -> Victim:
    client = trainer(alice)
    sampler = client.save_weights_and_get_sampling_client().result()
    return Victim(alice, client, sampler, client.save_weights_for_sampler("s").result().path)


GOOD = datum([1, 2, 3], [2, 3, 4])
IMAGE = types.ModelInput(chunks=[types.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=4)])
BAD_INPUTS = {  # what the exception says: the call
    "unknown base_model": lambda v: v.service.create_lora_training_client(base_model="no/such", rank=4).result(),
    "rank 1024 is above": lambda v: v.service.create_lora_training_client(base_model=BASE_MODEL, rank=1024).result(),
    "rank must be >= 1": lambda v: v.service.create_lora_training_client(base_model=BASE_MODEL, rank=0).result(),
    "has 2 values for 3 input tokens": lambda v: v.client.forward([datum([1, 2, 3], [2, 3])], "cross_entropy").result(),
    "loss_fn 'dro' is not supported": lambda v: v.client.forward_backward([GOOD], "dro").result(),
    "loss_fn 'custom'": lambda v: v.client.forward_backward([GOOD], "custom", {"loss_id": "x"}).result(),
    "model_input: token ids must be >= 0": lambda v: v.client.forward([datum([1, -2, 3], [2, 3, 4])], "ppo").result(),
    r"target_tokens'\]: token ids must be >= 0": lambda v: v.client.forward(
        [datum([1], [-4])], "cross_entropy"
    ).result(),
    r"needs loss_fn_inputs \['advantages'\]": lambda v: v.client.forward(
        [datum([1], [3], logprobs=[0.0])], "ppo"
    ).result(),
    "not supported by loss 'cross_entropy'": lambda v: v.client.forward(
        [datum([1], [3], advantages=[0.0])], "cross_entropy"
    ).result(),
    "datum 0: token ids must be < 64": lambda v: v.client.forward([datum([1, 70], [3, 4])], "cross_entropy").result(),
    "optimizer 'dimuon' is not supported": lambda v: v.client.optim_step(
        types.DimuonParams(learning_rate=0.1)
    ).result(),
    "learning_rate must be >= 0": lambda v: v.client.optim_step(types.AdamParams(learning_rate=-1.0)).result(),
    "name '../up' is not valid": lambda v: v.client.save_state("../up").result(),
    "kind='inflight'": lambda v: v.client.save_weights_and_get_sampling_client(kind="inflight").result(),
    "image chunks are not supported": lambda v: v.sample(IMAGE),
    r"stop string '12\+3' is 4 tokens": lambda v: v.sample(stop="12+3"),
    "topk_prompt_logprobs is not supported": lambda v: v.sample(topk_prompt_logprobs=2),
    "max_tokens must be >= 1": lambda v: v.sample(max_tokens=0),
    "prompt: token ids must be >= 0": lambda v: v.sample([1, -1]),
    "prompt: token ids must be < 64": lambda v: v.sample([1, 99]),
    "unknown checkpoint path": lambda v: v.service.create_sampling_client(
        model_path="tinker://a/sampler_weights/b"
    ).result(),
    "is a sampler checkpoint": lambda v: v.client.load_state(v.sampler_path).result(),
}


@pytest.mark.parametrize("problem", BAD_INPUTS)
def test_bad_input_is_refused_by_name(victim, problem):
    with pytest.raises(tinker.TinkerError, match=problem):
        BAD_INPUTS[problem](victim)
    # nothing else was disturbed: the client still trains and samples
    example = [datum([1, 2], [3, 4])]
    check_outputs(victim.client.forward(example, "cross_entropy").result(), example, 0)
    check_samples(victim.sampler, 0, num_samples=1)
