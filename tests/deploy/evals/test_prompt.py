"""Prompts in SGLang's convention; the shots are never scored; the choice of questions is deterministic."""

from __future__ import annotations

import pytest

from sglang_pd.deploy.evals import Dataset, UsageError, build_items, few_shot_prefix
from sglang_pd.deploy.evals.data import Problem
from sglang_pd.deploy.evals.prompt import STOP

P = [Problem(i, f"q{i}?", f"work {i}\n#### {i}", i) for i in range(10)]


def test_prompt_is_sglangs_format() -> None:
    items = build_items(P, num_shots=2, num_questions=1)
    assert (
        items[0].prompt
        == "Question: q0?\nAnswer: work 0\n#### 0\n\nQuestion: q1?\nAnswer: work 1\n#### 1\n\nQuestion: q2?\nAnswer:"
    )
    assert few_shot_prefix([]) == ""
    assert STOP == ("Question", "Assistant:", "<|separator|>")


def test_shots_are_excluded_and_first_n_follow_them() -> None:
    items = build_items(P, num_shots=5, num_questions=3)
    assert [it.problem.index for it in items] == [5, 6, 7]
    assert [it.problem.index for it in build_items(P, num_shots=5, num_questions=None)] == [5, 6, 7, 8, 9]


def test_sample_is_seeded_sorted_and_never_a_shot() -> None:
    a = [it.problem.index for it in build_items(P, num_shots=3, num_questions=4, sample=True, seed=7)]
    b = [it.problem.index for it in build_items(P, num_shots=3, num_questions=4, sample=True, seed=7)]
    c = [it.problem.index for it in build_items(P, num_shots=3, num_questions=4, sample=True, seed=8)]
    assert a == b == sorted(a) and len(set(a)) == 4 and min(a) >= 3
    assert a != c


@pytest.mark.parametrize(
    ("shots", "n", "message"),
    [(5, 6, "more than the 5 questions after the 5 shots"), (10, 1, "all used as shots"), (-1, 1, "0 or more")],
)
def test_bad_counts_say_what_to_do(shots: int, n: int, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        build_items(P, num_shots=shots, num_questions=n)


def test_real_data_default_is_1314_questions(dataset: Dataset) -> None:
    assert len(dataset.problems) == 1319 and dataset.canonical
    items = build_items(dataset.problems)
    assert len(build_items(dataset.problems, num_questions=None)) == 1314
    assert items[0].problem.index == 5 and items[0].prompt.count("Question: ") == 6
    assert dataset.problems[0].label == "18"  # "Janet’s ducks"
