"""A standard-format math task for real models: GSM8K-style answers, checked by math-verify.

The model is asked to end with `#### <number>` (GSM8K's format); `\\boxed{...}` (MATH's format) and
LaTeX answers are accepted too. The reward is 1.0 when Hugging Face's answer verifier (`math-verify`:
extraction of the final answer, then symbolic and numeric comparison) finds the completion's answer
equal to the reference, else 0.0. The reference is a number, a numeric string, or a whole GSM8K
solution ending in `#### <number>`; one that holds no number is a `TaskError`.

Prompts come from a small shipped sample set followed by templated word problems generated from
the seed, so the stream is endless and deterministic without any download. Real data sets (a
JSONL of GSM8K) are read by the dispatcher (`dataset.path`) and scored by this same reward.
"""

from __future__ import annotations

import math
import random
import re
import threading
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

from fleetrl.rollout.errors import TaskError
from fleetrl.rollout.tasks.base import Task, TaskPrompt

INSTRUCTION = "Solve the problem step by step. End your answer with a line '#### <number>'.\n\n"

SAMPLES: list[tuple[str, str]] = [
    ("A baker makes 24 muffins and sells 3 boxes of 6 muffins. How many muffins are left?", "6"),
    ("Mia reads 12 pages a day for 5 days, then 20 pages on the sixth day. How many pages did she read?", "80"),
    ("A train travels 60 km per hour for 2.5 hours. How many kilometres does it travel?", "150"),
    ("Sam has $45. He buys 3 books at $8 each. How much money does he have left?", "21"),
    ("A garden has 8 rows of 9 tulips. Half of the tulips are red. How many tulips are red?", "36"),
    ("Tickets cost $12 for adults and $7 for children. What do 2 adults and 3 children pay?", "45"),
    ("A tank holds 1,200 litres and is 3/4 full. How many litres are in it?", "900"),
    ("Lena saves $15 a week. How many weeks until she has saved $135?", "9"),
]

_TEMPLATES = [
    ("{name} has {a} apples and buys {b} bags of {c} apples. How many apples does {name} have now?",
     lambda a, b, c: a + b * c),
    ("A shop has {a} pens. It sells {b} pens on each of {c} days. How many pens are left?",
     lambda a, b, c: a - b * c),
    ("{name} runs {a} km on Monday and {b} km more than that on each of the next {c} days. "
     "How many km does {name} run in total?", lambda a, b, c: a + (a + b) * c),
]
_NAMES = ["Ava", "Ben", "Chen", "Dara", "Eli", "Femi", "Gita", "Hugo"]

_NUMBER = r"-?\$?\s*\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?"
_HASHES = re.compile(r"####\s*(" + _NUMBER + ")")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


class MathTask(Task):
    name = "math"
    max_new_tokens = 512

    def prompts(self, seed: int) -> Iterator[TaskPrompt]:
        for question, answer in SAMPLES:
            yield TaskPrompt(INSTRUCTION + question, answer)
        rng = random.Random(f"math:{seed}")
        while True:
            text, fn = rng.choice(_TEMPLATES)
            b, c = rng.randint(2, 9), rng.randint(2, 6)
            a = rng.randint(b * c, 99)  # keeps the subtraction template non-negative
            question = text.format(name=rng.choice(_NAMES), a=a, b=b, c=c)
            yield TaskPrompt(INSTRUCTION + question, str(fn(a, b, c)))

    def reward(self, completion_text: str, reference: Any) -> float:
        expected = reference_number(reference)
        return 1.0 if verified(completion_text, expected) else 0.0


def verified(completion_text: str, expected: Fraction) -> bool:
    """math-verify's verdict on the completion's final answer against `expected`."""
    from math_verify import parse, verify

    # Its timeouts are SIGALRM-based, which only the main thread may use; elsewhere they are off.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(str(expected), parsing_timeout=timeout)
    answer = parse(completion_text, parsing_timeout=timeout)
    return bool(answer) and bool(verify(gold, answer, timeout_seconds=timeout))


def extract_answer(text: str) -> Fraction | None:
    """The number after the last `####`, else inside the last `\\boxed{}`; None when neither parses."""
    for pattern in (_HASHES, _BOXED):
        found = pattern.findall(text)
        if found:
            return parse_number(found[-1])
    return None


def parse_number(text: str) -> Fraction | None:
    """`1,200`, `$45`, `-3.5`, `3/4` -> an exact Fraction; None for anything else."""
    cleaned = text.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        value = Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None
    return value


def reference_number(reference: Any) -> Fraction:
    if isinstance(reference, bool):
        raise TaskError(f"task 'math': reference {reference!r} is not a number")
    if isinstance(reference, int | float) and math.isfinite(reference):
        return Fraction(reference)
    if isinstance(reference, str):
        value = extract_answer(reference) if "####" in reference or "boxed" in reference else None
        value = value if value is not None else parse_number(reference)
        if value is not None:
            return value
    raise TaskError(f"task 'math': cannot read a number from reference {reference!r}")


def numbers_equal(a: Fraction, b: Fraction) -> bool:
    return a == b or abs(a - b) <= Fraction(1, 10**6) * max(Fraction(1), abs(b))
