"""Workload generators: deterministic, and with the reuse structure each workload promises."""

from __future__ import annotations

import numpy as np
import pytest

from bench.workloads import Prompt, long_doc, multi_turn, rag, reusable_tokens


def starts_with(prompt: Prompt, prefix: np.ndarray) -> bool:
    return len(prompt) >= len(prefix) and np.array_equal(prompt.token_ids[: len(prefix)], prefix)


def common_prefix(a: Prompt, b: Prompt) -> int:
    n = min(len(a), len(b))
    diff = np.nonzero(a.token_ids[:n] != b.token_ids[:n])[0]
    return int(diff[0]) if len(diff) else n


@pytest.mark.parametrize("make", [multi_turn, long_doc, rag])
def test_same_seed_same_prompts_other_seed_other_prompts(make):
    a, b, c = make(seed=1), make(seed=1), make(seed=2)
    assert [p.source for p in a] == [p.source for p in b]
    assert all(np.array_equal(x.token_ids, y.token_ids) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x.token_ids, y.token_ids) for x, y in zip(a, c, strict=False))


@pytest.mark.parametrize("make", [multi_turn, long_doc, rag])
def test_token_ids_fit_the_vocabulary(make):
    for p in make(vocab_size=500):
        assert p.token_ids.min() >= 0 and p.token_ids.max() < 500


def test_multi_turn_resends_the_history_behind_a_shared_system_prompt():
    prompts = multi_turn(users=3, rounds=4, system_tokens=100, question_tokens=10,
                         answer_tokens=20)
    assert len(prompts) == 12
    system = prompts[0].token_ids[:100]
    assert all(starts_with(p, system) for p in prompts)
    by_user: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_user.setdefault(p.source.split("/")[0], []).append(p)
    for rounds in by_user.values():
        for earlier, later in zip(rounds, rounds[1:], strict=False):
            # history = the earlier prompt, its answer, then a new question
            assert starts_with(later, earlier.token_ids)
            assert len(later) == len(earlier) + 20 + 10
    # Different users share the system prompt and nothing after it.
    assert common_prefix(by_user["user0"][0], by_user["user1"][0]) == 100
    # Users take turns: round 0 of every user before round 1 of any.
    assert [p.source for p in prompts[:3]] == ["user0/round0", "user1/round0", "user2/round0"]


def test_long_doc_interleaves_several_questions_per_document():
    prompts = long_doc(docs=3, questions=4, doc_tokens=300, question_tokens=8, seed=0)
    assert len(prompts) == 12
    docs = [p.source.split("/")[0] for p in prompts]
    assert {d: docs.count(d) for d in set(docs)} == {"doc0": 4, "doc1": 4, "doc2": 4}
    assert docs != sorted(docs), "questions about different documents must interleave"
    first = {}
    for p in prompts:
        d = p.source.split("/")[0]
        first.setdefault(d, p)
        assert common_prefix(first[d], p) >= 300
    assert common_prefix(first["doc0"], first["doc1"]) < 300


def test_rag_draws_top_k_passages_in_varying_order():
    prompts = rag(questions=40, passages=10, top_k=3, passage_tokens=50,
                  instruction_tokens=20, question_tokens=5, seed=0)
    picks = [tuple(int(x) for x in p.source.split(":")[1].split(",")) for p in prompts]
    assert all(len(set(pick)) == 3 for pick in picks)
    assert all(len(p) == 20 + 3 * 50 + 5 for p in prompts)
    # The same passage set shows up in different orders (partial reuse, not full reuse).
    orders: dict[frozenset, set] = {}
    for pick in picks:
        orders.setdefault(frozenset(pick), set()).add(pick)
    assert any(len(v) > 1 for v in orders.values())
    # Popular passages recur more than rare ones.
    counts = np.bincount([x for pick in picks for x in pick], minlength=10)
    assert counts[:3].sum() > counts[-3:].sum()
    # Two prompts share exactly the instruction plus the passages they have in common
    # at the front, in the same order.
    for a, pa, b, pb in [(prompts[i], picks[i], prompts[j], picks[j])
                         for i in range(5) for j in range(i + 1, 5)]:
        same = 0
        while same < 3 and pa[same] == pb[same]:
            same += 1
        assert common_prefix(a, b) >= 20 + 50 * same


def test_reusable_tokens_are_whole_shared_chunks_and_never_the_last_token():
    a = Prompt("a", np.arange(100))
    b = Prompt("b", np.arange(100))  # identical: all but the last chunk that holds token 99
    c = Prompt("c", np.concatenate([np.arange(70), np.full(30, 7)]))
    assert reusable_tokens([a, b, c], chunk_tokens=32) == [0, 96, 64]
    assert reusable_tokens([a, Prompt("d", np.arange(64))], chunk_tokens=32) == [0, 32]


@pytest.mark.parametrize("make, low, high", [(multi_turn, 0.5, 0.9), (long_doc, 0.5, 0.8),
                                             (rag, 0.0, 0.4)])
def test_default_workloads_have_the_intended_amount_of_reuse(make, low, high):
    prompts = make()
    rate = sum(reusable_tokens(prompts, 256)) / sum(map(len, prompts))
    assert low < rate < high
