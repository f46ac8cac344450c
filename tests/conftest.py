"""Shared test configuration: keep logs quiet, and give every test its own key space."""

from __future__ import annotations

import uuid

import pytest

from hashing import Namespace


@pytest.fixture
def ns() -> Namespace:
    """A fresh namespace per test, so tests never see each other's keys on shared servers."""
    return Namespace(model="test/model", dtype="float32", layout="test", chunk_tokens=16,
                     salt=uuid.uuid4().hex)
