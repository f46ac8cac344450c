"""`CoreOptions`: one vocabulary for every engine adapter's core settings, checked at start."""

from __future__ import annotations

import logging

import pytest

from connector.core import KVConnector
from connector.options import CORE_OPTIONS, CoreOptions, OptionError, check_known
from hashing import Namespace


def test_defaults_are_the_cores_own():
    """An adapter that sets nothing gets what `KVConnector` itself defaults to."""
    core = KVConnector("memory://", Namespace(model="m", dtype="float16", layout="x",
                                              chunk_tokens=16))
    try:
        opts = CoreOptions.parse({}, "anywhere")
        assert {name: getattr(core, name) for name in ("lookup_timeout_s", "load_deadline_s",
                                                       "max_in_flight")} == {
            "lookup_timeout_s": opts.lookup_timeout_s, "load_deadline_s": None,
            "max_in_flight": opts.max_in_flight}
    finally:
        core.close()


@pytest.mark.parametrize("given, message", [
    ({"lookup_timeout_s": 0}, "lookup_timeout_s=0 must be a positive number"),
    ({"load_deadline_s": "later"}, "load_deadline_s='later' must be a positive number"),
    ({"max_in_flight": 2.5}, "max_in_flight=2.5 must be a positive whole number"),
    ({"breaker_failures": True}, "breaker_failures=True must be a positive whole number"),
    ({"breaker_max_cooldown": float("inf")}, "breaker_max_cooldown=inf must be a non-negative"),
])
def test_a_bad_value_is_one_line_naming_the_setting(given, message):
    with pytest.raises(OptionError, match=f"^engine-config: {message}") as err:
        CoreOptions.parse(given, "engine-config")
    assert "\n" not in str(err.value)


def test_numeric_strings_read_as_their_numbers():
    opts = CoreOptions.parse({"lookup_timeout_s": "0.5", "max_in_flight": "4"}, "x")
    assert (opts.lookup_timeout_s, opts.max_in_flight) == (0.5, 4)


def test_a_former_name_sets_what_it_stood_for_with_a_warning(caplog):
    aliases = {"timeout_s": ("lookup_timeout_s", "load_deadline_s")}
    with caplog.at_level(logging.WARNING, logger="kvstash.connector"):
        opts = CoreOptions.parse({"timeout_s": 3}, "cfg", aliases)
    assert (opts.lookup_timeout_s, opts.load_deadline_s) == (3, 3)
    assert "cfg: timeout_s is deprecated" in caplog.text
    # a new name given beside it wins
    opts = CoreOptions.parse({"timeout_s": 3, "lookup_timeout_s": 1}, "cfg", aliases)
    assert (opts.lookup_timeout_s, opts.load_deadline_s) == (1, 3)


def test_an_unknown_option_names_the_closest_known_one():
    with pytest.raises(OptionError, match=r"^cfg: unknown option 'max_inflight' \(did you "
                                          r"mean 'max_in_flight'\?\); kvstash's options: "):
        check_known({"max_inflight": 4}, CORE_OPTIONS, "cfg")


def test_a_fixed_load_deadline_replaces_the_policys():
    core = KVConnector("memory://", Namespace(model="m", dtype="float16", layout="x",
                                              chunk_tokens=16), load_deadline_s=0.25)
    try:
        assert core.load_deadline(10_000) == 0.25 and core.max_load_wait_s == 0.25
        assert core.plan(64, chunk_nbytes=1024).deadline_s == 0.25
    finally:
        core.close()
