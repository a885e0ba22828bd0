"""DPArrange equals brute force on small random instances, for both operators."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tangram.arrange import CHUNK_SIZES, ChunkOperator, LinearOperator, dp_arrange


def carvable(sizes: list[int], free: list[int]) -> bool:
    """Exhaustive search: can every requested chunk be cut from the free chunks?"""
    if not sizes:
        return True
    k, rest = sizes[0], sizes[1:]
    for i, c in enumerate(free):
        if c >= k:
            left = free[:i] + free[i + 1 :]
            # splitting a chunk c into aligned pieces: c -> k used + k, 2k, ..., c/2 free
            pieces = []
            size = k
            while size < c:
                pieces.append(size)
                size *= 2
            if carvable(rest, left + pieces):
                return True
    return False


def brute(options, fits):
    best = None
    for combo in itertools.product(*[sorted(o) for o in options]):
        if not fits(list(combo)):
            continue
        total = sum(o[u] for o, u in zip(options, combo, strict=True))
        if best is None or total < best - 1e-9:
            best = total
    return best


durations = st.floats(min_value=0.01, max_value=100, allow_nan=False)


@st.composite
def linear_case(draw):
    n = draw(st.integers(1, 4))
    options = []
    for _ in range(n):
        units = draw(st.sets(st.integers(1, 6), min_size=1, max_size=4))
        options.append({u: draw(durations) for u in units})
    return options, draw(st.integers(0, 14))


@st.composite
def chunk_case(draw):
    n = draw(st.integers(1, 4))
    options = []
    for _ in range(n):
        units = draw(st.sets(st.sampled_from(CHUNK_SIZES), min_size=1, max_size=4))
        options.append({u: draw(durations) for u in units})
    cap = tuple(draw(st.integers(0, 2)) for _ in range(4))
    return options, cap


@settings(max_examples=300, deadline=None)
@given(linear_case())
def test_linear_matches_brute_force(case):
    options, cap = case
    got = dp_arrange(options, cap)
    want = brute(options, lambda units: sum(units) <= cap)
    if want is None:
        assert got is None
    else:
        total, units = got
        assert total == pytest.approx(want)
        assert sum(units) <= cap
        assert total == pytest.approx(sum(o[u] for o, u in zip(options, units, strict=True)))


@settings(max_examples=300, deadline=None)
@given(chunk_case())
def test_chunk_matches_brute_force(case):
    options, cap = case
    free = [size for size, n in zip(CHUNK_SIZES, cap, strict=True) for _ in range(n)]
    got = dp_arrange(options, cap, ChunkOperator())
    want = brute(options, lambda units: carvable(sorted(units, reverse=True), free))
    if want is None:
        assert got is None
    else:
        total, units = got
        assert total == pytest.approx(want)
        assert carvable(sorted(units, reverse=True), free)


def test_one_eight_chunk_serves_a_two_gpu_action():
    # The paper's Alg. 4 Prev never splits; ours must.
    assert dp_arrange([{2: 1.0}], (0, 0, 0, 1), ChunkOperator()) == (1.0, [2])


def test_prefix_optimum_from_one_pass():
    from tangram.arrange import arrange

    options = [{1: 10.0, 2: 6.0, 4: 4.0}, {1: 8.0, 2: 5.0}, {1: 3.0}]
    table = arrange(options, LinearOperator().space(4))
    for t in range(4):
        assert table.best(t) == dp_arrange(options[:t], 4) if t else table.best(0) == (0.0, [])


def test_bad_options_name_the_field():
    with pytest.raises(ValueError, match=r"options\[0\]"):
        dp_arrange([{}], 4)
    with pytest.raises(ValueError, match="GPU unit count"):
        dp_arrange([{3: 1.0}], (0, 0, 0, 1), ChunkOperator())
    with pytest.raises(ValueError, match="capacity"):
        dp_arrange([{1: 1.0}], -1)



def test_sparse_pass_gives_the_dense_pass_answers():
    """The pass over reached states (dicts) answers every prefix exactly as the numpy pass
    over all states does, ties included (arrange runs either, by size). Whole durations
    0-6 make ties common: a pass that kept the first of equal totals instead of the last
    differs on ~1% of these."""
    import random

    from tangram.arrange import _arrange_dense, _arrange_sparse

    rng = random.Random(0)
    for _ in range(4000):
        chunks = rng.random() < 0.5
        sizes = CHUNK_SIZES if chunks else range(1, 7)
        options = [{u: float(rng.randint(0, 6)) if rng.random() < 0.9 else rng.uniform(0, 6)
                    for u in rng.sample(sizes, rng.randint(1, 4))}
                   for _ in range(rng.randint(0, 5))]
        if chunks:
            space = ChunkOperator().space(tuple(rng.randint(0, 2) for _ in range(4)))
        else:
            space = LinearOperator().space(rng.randint(0, 14))
        dense, sparse = _arrange_dense(options, space), _arrange_sparse(options, space)
        assert sparse.n == dense.n == len(options)
        for t in range(len(options) + 1):
            assert sparse.best(t) == dense.best(t), (options, t)
