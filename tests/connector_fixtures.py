"""Fixtures for the connector tests: tiny real transformers models, prompts, stores, chunk files."""

from __future__ import annotations

import asyncio
import socket
import uuid
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hashing import Namespace, chunk_keys
from storage.base import Store
from storage.file import _chunk_path

CHUNK = 32  # tokens per chunk in the tests: small, so a 200-token prompt spans 6 chunks


@cache
def tiny_model(family: str = "llama", dtype: str = "float32", seed: int = 0) -> Any:
    """A 2-layer, hidden-256 model with seeded random weights (GQA: 4 heads, 2 KV heads)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family]
    cfg = cls(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
              max_position_embeddings=2048)
    cfg._name_or_path = f"test/{family}-seed{seed}"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype)).eval()


def prompt(n: int, seed: int = 0) -> Any:
    """A (1, n) tensor of random token ids."""
    import torch

    return torch.from_numpy(np.random.default_rng(seed).integers(0, 1024, (1, n)))


def plain_forward(model: Any, ids: Any, **kwargs: Any) -> Any:
    """The model's own full forward pass: what a miss computes and a hit's chunks hold."""
    import torch

    with torch.no_grad():
        return model(ids, use_cache=True, **kwargs)


def test_namespace(model: Any, chunk_tokens: int = CHUNK) -> Namespace:
    """The model's namespace with a per-test salt, so tests never share chunks by accident."""
    from connector.hf import namespace_for

    return namespace_for(model, chunk_tokens, salt=uuid.uuid4().hex)


test_namespace.__test__ = False  # a helper, not a test


def chunk_file(root: Path, ns: Namespace, ids: Any, index: int) -> Path:
    """The file a `file://` store at `root` keeps chunk `index` of prompt `ids` in."""
    return _chunk_path(root, chunk_keys(ids, ns)[index])


def flip_payload_byte(path: Path, offset: int = 100) -> None:
    """Corrupt one byte of a stored chunk's payload (the header stays valid)."""
    data = bytearray(path.read_bytes())
    data[4096 + offset] ^= 0xFF
    path.write_bytes(bytes(data))


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DelayedStore(Store):
    """A real store whose `get_into` stalls for chosen keys, or raises for chosen keys.

    A stalled disk or a backend raising an unexpected exception cannot be produced on
    demand with the real backends here, so this wraps a real store and injects only that.
    """

    def __init__(self, inner: Store, slow: set[str] = frozenset(), broken: set[str] = frozenset(),
                 delay_s: float = 30.0):
        super().__init__()
        self.inner, self.slow, self.broken, self.delay_s = inner, set(slow), set(broken), delay_s
        self.url = f"delayed+{inner.url}"

    async def put(self, key: str, blob: Any) -> bool:
        return await self.inner.put(key, blob)

    async def get(self, key: str) -> bytes | None:
        return await self.inner.get(key)

    async def get_into(self, key: str, out: Any):
        if key in self.broken:
            raise RuntimeError("backend exploded")
        if key in self.slow:
            await asyncio.sleep(self.delay_s)
        return await self.inner.get_into(key, out)

    async def exists(self, keys):
        return await self.inner.exists(keys)

    async def delete(self, key: str) -> bool:
        return await self.inner.delete(key)

    async def list_keys(self):
        async for k in self.inner.list_keys():
            yield k


@pytest.fixture(name="store_dir")
def store_dir_fixture(tmp_path: Path) -> Path:
    return tmp_path / "kv"
