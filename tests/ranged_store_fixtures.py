"""`store_url`: one store of each kind that serves byte ranges, for tests of ranged reads.

memory:// (slices), file:// (`preadv`), s3:// (moto on loopback: ranged GETs) and
http:// (a kvserver over a directory: `Range:` requests); each test gets an empty one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins = ("tests.s3_fixtures",)  # moto_s3_url


@pytest.fixture(params=["memory", "file", "s3", "http"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "memory":
        yield "memory://"
    elif request.param == "file":
        yield f"file://{tmp_path}/kv"
    elif request.param == "s3":
        from tests.s3_fixtures import with_prefix

        yield with_prefix(request.getfixturevalue("moto_s3_url"))
    else:
        from tests.kvserver_fixtures import running_kvserver

        with running_kvserver("--store", f"file://{tmp_path}/served") as server:
            yield server.url
