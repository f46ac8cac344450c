"""Chained prefix keys: stable, prefix-sensitive, namespace-scoped."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

from hashing import (
    InvalidTokenIds,
    Namespace,
    chunk_keys,
    is_valid_key,
    keys_from_block_hashes,
    split_key,
    token_array,
)

NS = Namespace(model="org/model", dtype="bfloat16", layout="LBHNC", chunk_tokens=4)


def test_one_key_per_full_chunk_only():
    assert len(chunk_keys(list(range(11)), NS)) == 2
    assert len(chunk_keys(list(range(12)), NS)) == 3
    assert chunk_keys([1, 2, 3], NS) == []
    assert all(is_valid_key(k) for k in chunk_keys(list(range(12)), NS))


def test_key_format_is_ns_id_slash_digest():
    key = chunk_keys([1, 2, 3, 4], NS)[0]
    ns_id, digest = key.split("/")
    assert ns_id == NS.id and len(ns_id) == 16 and len(digest) == 32


def test_golden_keys_never_change():
    """The key scheme is a stable format: stored chunks must stay findable across releases."""
    ns = Namespace(model="m", dtype="bf16", layout="x", chunk_tokens=4)
    assert ns.id == "c84fc2c27afdf59e"
    assert chunk_keys(list(range(8)), ns) == [
        "c84fc2c27afdf59e/66ba2bf63c7c6d348c0c956fd1d695c3",
        "c84fc2c27afdf59e/707b719ea49e20ec20966834721b09df",
    ]


def test_keys_identical_across_processes_with_different_hash_seeds():
    code = (
        "from hashing import Namespace, chunk_keys;"
        "print(chunk_keys(list(range(64)), Namespace(model='m', dtype='d', layout='l', chunk_tokens=16)))"
    )
    outs = set()
    for seed in ("0", "1", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                text=True, check=True).stdout)
    assert len(outs) == 1


def test_changing_a_token_in_chunk_k_changes_keys_k_onward_only():
    tokens = list(range(100, 132))
    base = chunk_keys(tokens, NS)
    for k in range(len(base)):
        changed = list(tokens)
        changed[k * 4 + 2] += 1
        keys = chunk_keys(changed, NS)
        assert keys[:k] == base[:k]
        assert all(a != b for a, b in zip(keys[k:], base[k:], strict=True))


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(Namespace)])
def test_any_namespace_field_changes_every_key(field):
    tokens = list(range(16))
    other_value = {"model": "x", "dtype": "float16", "layout": "other", "chunk_tokens": 4,
                   "rank": 1, "world_size": 3, "salt": "tenant", "scheme": 99}[field]
    base = dict(model="org/model", dtype="bfloat16", layout="LBHNC", chunk_tokens=2, rank=0,
                world_size=2, salt="", scheme=1)
    a = chunk_keys(tokens, Namespace(**base))
    b = chunk_keys(tokens, Namespace(**{**base, field: other_value}))
    assert not set(a) & set(b)
    # not even the digests collide: the namespace root seeds the chain
    assert not {k.split("/")[1] for k in a} & {k.split("/")[1] for k in b}


def test_accepts_lists_arrays_and_tensors_alike():
    ids = list(range(1000, 1016))
    expected = chunk_keys(ids, NS)
    assert chunk_keys(np.array(ids, dtype=np.int64), NS) == expected
    assert chunk_keys(np.array(ids, dtype=np.uint32), NS) == expected
    assert chunk_keys(np.array(ids, dtype=">u4"), NS) == expected
    assert chunk_keys(np.array(ids + ids, dtype=np.uint32)[::2], NS) == chunk_keys(
        ids[::2] + ids[::2], NS)
    assert chunk_keys(np.array([ids]), NS) == expected
    assert chunk_keys(tuple(ids), NS) == expected
    torch = pytest.importorskip("torch")
    assert chunk_keys(torch.tensor(ids), NS) == expected
    assert chunk_keys(torch.tensor([ids]), NS) == expected


@pytest.mark.parametrize("bad", [[-1, 2, 3, 4], [2**32, 1, 2, 3], [1.5, 2, 3, 4], ["a", 1, 2, 3],
                                 [[1, 2], [3, 4]]])
def test_rejects_ids_that_are_not_uint32_with_a_clear_error(bad):
    with pytest.raises(InvalidTokenIds):
        chunk_keys(bad, NS)


def test_a_little_endian_uint32_array_is_returned_as_it_is():
    """The engines' own token arrays (a chunk's ids as saved) take no copy and no checks."""
    ids = np.arange(1000, 1016, dtype="<u4")
    assert token_array(ids) is ids
    assert token_array(ids[::2]).flags.c_contiguous
    assert token_array(ids[::2]).tolist() == ids[::2].tolist()


def test_max_uint32_is_accepted():
    assert len(chunk_keys([2**32 - 1] * 4, NS)) == 1


def test_namespace_validates_its_fields():
    with pytest.raises(ValueError):
        Namespace(model="m", dtype="d", layout="l", chunk_tokens=0)
    with pytest.raises(ValueError):
        Namespace(model="m", dtype="d", layout="l", rank=2, world_size=2)


def test_engine_block_hashes_map_to_stable_namespaced_keys():
    hashes = [b"\x01" * 32, b"\x02" * 32]
    keys = keys_from_block_hashes(hashes, NS)
    assert keys == keys_from_block_hashes(hashes, NS)
    assert all(is_valid_key(k) and k.startswith(NS.id) for k in keys)
    other = Namespace(model="org/model", dtype="bfloat16", layout="LBHNC", chunk_tokens=4, salt="t")
    assert not set(keys) & set(keys_from_block_hashes(hashes, other))
    assert keys_from_block_hashes([7, 2**70], NS) != keys_from_block_hashes([8, 2**70], NS)


def test_a_list_of_ids_converts_as_numpy_would_and_refuses_the_same_ids():
    ids = [0, 1, 5, 2**31, 2**32 - 1, np.int64(7), True]
    assert token_array(ids).tolist() == np.asarray(ids, dtype=np.int64).astype("<u4").tolist()
    assert token_array(ids).dtype == np.dtype("<u4")
    for bad in ([1, -1], [2**32], [1, 2.5], [True, False]):
        with pytest.raises(InvalidTokenIds):
            token_array(bad)


@pytest.mark.parametrize("tail", ["\n", "\r\n", "\x00", " "])
def test_a_key_with_anything_after_its_digest_is_not_valid(tail):
    key = "0123456789abcdef/" + "0" * 32
    assert is_valid_key(key)
    assert not is_valid_key(key + tail)
    with pytest.raises(ValueError):
        split_key(key + tail)
