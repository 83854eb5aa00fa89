"""Tasks: deterministic prompts by seed, exact rewards with partial credit, the char tokenizer."""

from __future__ import annotations

import concurrent.futures
import itertools

import pytest
from slowdown import scaled

from fleetrl.rollout import TASKS, CharTokenizer, TaskError, get_task
from fleetrl.rollout.tasks import extract_answer


@pytest.mark.parametrize("name", sorted(TASKS))
def test_prompts_are_deterministic_by_seed(name: str) -> None:
    task = get_task(name)
    a = list(itertools.islice(task.prompts(3), 50))
    assert a == list(itertools.islice(task.prompts(3), 50))
    assert a != list(itertools.islice(task.prompts(4), 50))
    for p in a:
        assert task.reward(_perfect(name, p.reference), p.reference) == 1.0


def _perfect(name: str, reference: object) -> str:
    return f"so the answer is\n#### {reference}" if name == "math" else str(reference)


def test_string_rewards_give_partial_credit() -> None:
    reverse = get_task("reverse")
    assert reverse.prompts(0).__next__().prompt.endswith("=")
    # 0.7 * match + 0.15 * letters of the alphabet + 0.15 * exact length
    assert reverse.reward("dcba", "dcba") == pytest.approx(1.0)
    assert reverse.reward("dcbb", "dcba") == pytest.approx(0.7 * 0.75 + 0.15 + 0.15)
    assert reverse.reward("dcbaaa", "dcba") == pytest.approx(0.7 + 0.15)  # did not stop in time
    assert reverse.reward("zzzz", "dcba") == pytest.approx(0.15)
    assert reverse.reward("", "dcba") == 0.0
    assert reverse.reward("aa", "dcba") == pytest.approx(0.15 * 0.5)
    with pytest.raises(TaskError, match="reverse"):
        reverse.reward("x", None)


def test_math_extracts_the_standard_answer_formats() -> None:
    math = get_task("math")
    assert math.reward("3 + 4 = 7\n#### 7", "7") == 1.0
    assert math.reward("#### 1,200.", 1200) == 1.0
    assert math.reward("The answer is \\boxed{3/4}.", "0.75") == 1.0
    assert math.reward("#### $45", "work...\n#### 45") == 1.0
    assert math.reward("#### 8\n#### 9", "9") == 1.0  # the last answer counts
    assert math.reward("#### 7.5", "7") == 0.0
    assert math.reward("seven", "7") == 0.0
    # math-verify reads what a regex did not: LaTeX fractions in a box, and answers off the main thread
    assert math.reward("so $\\boxed{\\frac{3}{4}}$", "0.75") == 1.0
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert pool.submit(math.reward, "#### 12", "12").result(timeout=scaled(30)) == 1.0
    assert extract_answer("no number here") is None
    with pytest.raises(TaskError, match="math"):
        math.reward("#### 1", "not a number")


def test_unknown_task_is_a_clear_error() -> None:
    with pytest.raises(TaskError, match=r"unknown task 'nope'.*reverse"):
        get_task("nope")


def test_char_tokenizer_round_trips_and_stops_at_eos() -> None:
    tok = CharTokenizer()
    text = "abc=Hello, world! ~ #### 42\n"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and all(3 <= i < tok.vocab_size for i in ids[1:])
    assert tok.decode(ids) == text
    assert tok.decode([*tok.encode("ab", bos=False), tok.eos_id, *tok.encode("cd", bos=False)]) == "ab"
    assert tok.decode(tok.encode("é")) == "?"


def test_reasoning_gym_tasks_are_generated_from_the_seed_and_scored_by_the_dataset() -> None:
    task = get_task("reasoning_gym:leg_counting")
    first = list(itertools.islice(task.prompts(seed=5), 3))
    assert first == list(itertools.islice(get_task("reasoning_gym:leg_counting").prompts(seed=5), 3))
    assert first != list(itertools.islice(task.prompts(seed=6), 3))
    p = first[0]
    assert "<answer>" in p.prompt and "legs" in p.prompt
    assert task.reward(f"thinking...<answer>{p.reference['answer']}</answer>", p.reference) == 1.0
    assert task.reward("<answer>-1</answer>", p.reference) == 0.0
    assert task.reward("no tags", p.reference) == 0.0
    with pytest.raises(TaskError, match="unknown reasoning-gym dataset 'nosuch'"):
        get_task("reasoning_gym:nosuch")
