"""A task for the example reward: `add` has a bug the model is asked to fix.

The reward command of examples/verl_tool.yaml (``python3 -m pytest -q tests``, run as
``pytest -n <cores>`` when Tangram grants several cores) scores 1.0 only once every
test in tests/ passes.
"""


def add(a: int, b: int) -> int:
    return a - b  # the bug


def mul(a: int, b: int) -> int:
    return a * b


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)
