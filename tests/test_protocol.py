"""DataProto: construction checks, every row and key operation against hand-computed numpy references,
pad/unpad over 2, 3 and 4 processes, and pickling with out-of-band (zero-copy) buffers."""

import pickle

import numpy as np
import pytest

from hfjax.protocol import DataProto, DataProtoItem, pad_to_divisor, unpad


def make(n: int, seed: int = 0, **meta) -> DataProto:
    rng = np.random.default_rng(seed)
    return DataProto.from_dict(
        tensors={"ids": rng.integers(1, 1000, (n, 5)), "logp": rng.standard_normal((n, 5)).astype(np.float32)},
        non_tensors={
            "prompt": [f"p{seed}-{i}-{rng.integers(1 << 30)}" for i in range(n)],
            "extra": [{"i": i} for i in range(n)],
        },
        meta_info=meta,
    )


def rows_equal(data: DataProto, ref: DataProto, index) -> bool:
    """data's rows equal ref's rows at `index` (a list of ints) in every key."""
    index = np.asarray(index, dtype=int)
    return all(np.array_equal(data.batch[k], ref.batch[k][index]) for k in ref.batch) and all(
        list(data.non_tensor_batch[k]) == [ref.non_tensor_batch[k][i] for i in index] for k in ref.non_tensor_batch
    )


def test_from_dict_and_validation():
    data = make(6)
    assert len(data) == 6 and data.non_tensor_batch["prompt"].dtype == object
    nested = DataProto.from_dict(non_tensors={"tokens": [[1, 2], [3, 4], [5, 6]]})
    assert nested.non_tensor_batch["tokens"].shape == (3,) and nested.non_tensor_batch["tokens"][1] == [3, 4]
    assert len(DataProto(meta_info={"a": 1})) == 0
    with pytest.raises(ValueError, match="share the first dimension"):
        DataProto.from_dict({"a": np.ones((3, 2)), "b": np.ones(4)})
    with pytest.raises(TypeError, match=r"batch\['s'\] has dtype object"):
        DataProto.from_dict({"s": np.array(["x", {}], dtype=object)})
    with pytest.raises(TypeError, match=r"batch\['x'\]: expected a numpy array with a batch dimension"):
        DataProto.from_dict({"x": 3.0})
    with pytest.raises(ValueError, match="in both batch and non_tensor_batch"):
        DataProto({"a": np.ones(2)}, {"a": np.array(["x", "y"], dtype=object)})


def test_select_shares_arrays_and_pop_removes():
    data = make(5, meta_sentinel=7)
    data.meta_info["temperature"] = 0.7
    picked = data.select(["ids"], [], ["temperature"])
    assert list(picked.batch) == ["ids"] and not picked.non_tensor_batch and picked.meta_info == {"temperature": 0.7}
    assert np.shares_memory(picked.batch["ids"], data.batch["ids"])
    with pytest.raises(KeyError, match=r"batch has no keys \['nope'\]"):
        data.select(["nope"])
    logp = data.batch["logp"]
    popped = data.pop(batch_keys=["logp"], non_tensor_batch_keys=["extra"])
    assert popped.batch["logp"] is logp and list(popped.non_tensor_batch) == ["extra"]
    assert list(data.batch) == ["ids"] and list(data.non_tensor_batch) == ["prompt"]


def test_union_merges_and_rejects_conflicts():
    data = make(4, step=1)
    left, right = data.select(["ids"], ["prompt"]), data.select(["ids", "logp"], ["extra"])
    merged = left.union(right)
    assert set(merged.batch) == {"ids", "logp"} and set(merged.non_tensor_batch) == {"prompt", "extra"}
    assert rows_equal(merged, data, range(4))
    changed = DataProto.from_dict({"ids": data.batch["ids"] + 1})
    with pytest.raises(ValueError, match=r"union: batch\['ids'\] differs"):
        left.union(changed)
    with pytest.raises(ValueError, match=r"union: meta_info\['step'\] differs"):
        data.union(DataProto(meta_info={"step": 2}))
    with pytest.raises(ValueError, match=r"batch sizes differ \(4 vs 3\)"):
        data.union(make(3))
    assert data.union(DataProto(meta_info={"step": 1, "lr": 0.1})).meta_info == {"step": 1, "lr": 0.1}


def test_chunk_split_concat_round_trip():
    data = make(12)
    chunks = data.chunk(3)
    assert [len(c) for c in chunks] == [4, 4, 4]
    assert all(np.shares_memory(c.batch["logp"], data.batch["logp"]) for c in chunks)
    assert rows_equal(DataProto.concat(chunks), data, range(12))
    parts = data.split(5)
    assert [len(p) for p in parts] == [5, 5, 2]
    assert rows_equal(parts[2], data, [10, 11])
    assert rows_equal(DataProto.concat(parts), data, range(12))
    with pytest.raises(ValueError, match="12 rows cannot be split into 5 equal chunks"):
        data.chunk(5)
    with pytest.raises(ValueError, match="split_size must be a positive int"):
        data.split(0)


def test_concat_merges_metrics_and_checks_meta_info():
    parts = [make(2, seed=s, step=3) for s in range(3)]
    parts[0].meta_info["metrics"] = {"loss": 0.5, "grad_norm": [1.0, 2.0]}
    parts[1].meta_info["metrics"] = {"loss": 0.25}
    parts[2].meta_info["metrics"] = {"loss": [0.125, 0.0625], "grad_norm": 3.0}
    merged = DataProto.concat(parts)
    assert merged.meta_info == {
        "step": 3,
        "metrics": {"loss": [0.5, 0.25, 0.125, 0.0625], "grad_norm": [1.0, 2.0, 3.0]},
    }
    ref = {k: np.concatenate([p.batch[k] for p in parts]) for k in parts[0].batch}
    assert all(np.array_equal(merged.batch[k], ref[k]) for k in ref)
    assert list(merged.non_tensor_batch["prompt"]) == [x for p in parts for x in p.non_tensor_batch["prompt"]]
    parts[2].meta_info["step"] = 4
    with pytest.raises(ValueError, match=r"meta_info\['step'\] of part 2 differs"):
        DataProto.concat(parts)
    with pytest.raises(ValueError, match="part 1 has keys"):
        DataProto.concat([make(2), make(2).select(["ids"])])


@pytest.mark.parametrize("interleave", [True, False])
def test_repeat(interleave):
    data = make(3)
    out = data.repeat(2, interleave=interleave)
    expected = [0, 0, 1, 1, 2, 2] if interleave else [0, 1, 2, 0, 1, 2]
    assert len(out) == 6 and rows_equal(out, data, expected)


def test_reorder_in_place():
    data, ref = make(7), make(7)
    perm = np.random.default_rng(3).permutation(7)
    data.reorder(perm)
    assert rows_equal(data, ref, perm)
    with pytest.raises(ValueError, match="permutation of range"):
        data.reorder([0, 0, 1, 2, 3, 4, 5])


def test_indexing():
    data = make(6)
    item = data[-2]
    assert isinstance(item, DataProtoItem)
    assert np.array_equal(item.batch["ids"], data.batch["ids"][4]) and item.non_tensor_batch["extra"] == {"i": 4}
    assert rows_equal(data[1:4], data, [1, 2, 3]) and np.shares_memory(data[1:4].batch["ids"], data.batch["ids"])
    mask = np.array([True, False, True, False, False, True])
    assert rows_equal(data[mask], data, [0, 2, 5])
    assert rows_equal(data[[5, 0, 3]], data, [5, 0, 3])
    with pytest.raises(IndexError, match="row 6 out of range"):
        data[6]
    with pytest.raises(TypeError, match="expected an int, slice"):
        data[np.array([0.5])]


@pytest.mark.parametrize("divisor", [2, 3, 4])
def test_pad_unpad_every_size(divisor):
    for n in range(1, 20):
        data = make(n, seed=n)
        padded, pad_size = pad_to_divisor(data, divisor)
        assert len(padded) % divisor == 0 and 0 <= pad_size < divisor and len(padded) == n + pad_size
        assert rows_equal(padded, data, [i % n for i in range(n + pad_size)])
        if pad_size == 0:
            assert padded is data
        chunks = padded.chunk(divisor)
        assert len({len(c) for c in chunks}) == 1
        assert rows_equal(unpad(DataProto.concat(chunks), pad_size), data, range(n))
    with pytest.raises(ValueError, match="cannot pad an empty DataProto"):
        pad_to_divisor(DataProto(), divisor)
    with pytest.raises(ValueError, match=r"pad_size must be in \[0, 3\]"):
        unpad(make(3), 4)


def test_pickles_arrays_out_of_band():
    rng = np.random.default_rng(5)
    big = {f"k{i}": rng.standard_normal((256, 1024)).astype(np.float32) for i in range(3)}
    data = DataProto.from_dict(big, {"prompt": ["a", "b"] * 128}, {"step": 1})
    buffers = []
    payload = pickle.dumps(data, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 3 and all(b.raw().nbytes == 256 * 1024 * 4 for b in buffers)
    assert len(payload) < 16_000  # only the object column and the structure travel in-band
    back = pickle.loads(payload, buffers=buffers)
    assert all(np.array_equal(back.batch[k], big[k]) for k in big) and back.meta_info == {"step": 1}
    assert list(back.non_tensor_batch["prompt"]) == ["a", "b"] * 128
    chunk = data.chunk(2)[1]  # a row slice is contiguous: it also goes out-of-band without a copy
    chunk_buffers = []
    pickle.dumps(chunk, protocol=5, buffer_callback=chunk_buffers.append)
    assert len(chunk_buffers) == 3
    assert np.shares_memory(np.frombuffer(chunk_buffers[0].raw(), np.float32), data.batch["k0"])


def test_repr_is_compact():
    text = repr(make(4, step=2))
    assert text.startswith("DataProto(len=4, batch={ids: int64[4, 5], logp: float32[4, 5]}") and "step" in text
