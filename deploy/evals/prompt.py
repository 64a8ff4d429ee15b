"""Few-shot prompts in SGLang's convention and the choice of questions.

The first `num_shots` lines of the file are the worked examples, each `Question: {q}\\nAnswer: {a}`
followed by a blank line; the question follows as `Question: {q}\\nAnswer:`. The shots are never
scored: questions are drawn from the lines after them (as SGLang's `GSM8KEval` does).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from .data import Problem
from .errors import UsageError

__all__ = ["DEFAULT_NUM_SHOTS", "STOP", "Item", "build_items", "few_shot_prefix", "question_block"]

DEFAULT_NUM_SHOTS = 5
# SGLang's stop strings for the completion API; the chat API sends none (as SGLang's sampler).
STOP: tuple[str, ...] = ("Question", "Assistant:", "<|separator|>")


@dataclass(frozen=True, slots=True)
class Item:
    """One question to ask: the full prompt and the expected value."""

    problem: Problem
    prompt: str


def question_block(problem: Problem, *, with_answer: bool) -> str:
    block = f"Question: {problem.question}\nAnswer:"
    return f"{block} {problem.answer}" if with_answer else block


def few_shot_prefix(shots: Sequence[Problem]) -> str:
    return "".join(question_block(p, with_answer=True) + "\n\n" for p in shots)


def build_items(
    problems: Sequence[Problem],
    *,
    num_shots: int = DEFAULT_NUM_SHOTS,
    num_questions: int | None = None,
    sample: bool = False,
    seed: int = 0,
) -> list[Item]:
    """The first `num_questions` questions after the shots (all if None), or a seeded sample of them."""
    if num_shots < 0:
        raise UsageError(f"--num-shots must be 0 or more, not {num_shots}.")
    pool = problems[num_shots:]
    if not pool:
        raise UsageError(f"The data holds {len(problems)} lines, all used as shots by --num-shots {num_shots}.")
    if num_questions is not None:
        if num_questions < 1:
            raise UsageError(f"--num-questions must be at least 1, not {num_questions}.")
        if num_questions > len(pool):
            raise UsageError(
                f"--num-questions {num_questions} is more than the {len(pool)} questions after the "
                f"{num_shots} shots; use --num-questions all."
            )
    n = len(pool) if num_questions is None else num_questions
    chosen = sorted(random.Random(seed).sample(range(len(pool)), n)) if sample else range(n)
    prefix = few_shot_prefix(problems[:num_shots])
    return [Item(pool[i], prefix + question_block(pool[i], with_answer=False)) for i in chosen]
