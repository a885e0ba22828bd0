import math

import pytest

from tangram.model import Action, Demand, Elasticity


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: Demand(()), "demand.choices"),
        (lambda: Demand.range(4, 2), "demand.min"),
        (lambda: Demand.fixed(-1), "demand.choices"),
        (lambda: Demand.fixed(math.nan), "demand.choices"),
        (lambda: Elasticity.from_table({2: 1.5}), "elasticity.table"),
        (lambda: Elasticity.from_table({2: 0.0}), "elasticity.table"),
        (lambda: Elasticity.amdahl(1.2), "parallel_fraction"),
        (lambda: Action("a", "t", "j", "k", {"cpu": Demand.fixed(1)}, t1_s=-1.0), "t1_s"),
        (lambda: Action("a", "t", "j", "k", {"cpu": Demand.fixed(1)}, t1_s=math.nan), "t1_s"),
        (lambda: Action("a", "t", "j", "k", {"tpu": Demand.fixed(1)}), "unknown resource"),
        (lambda: Action("", "t", "j", "k"), "action.id"),
        (lambda: Action("a", "t", "j", "k", {"cpu": Demand.fixed(1)}, elastic="gpu"),
         "action.elastic"),
        (lambda: Action("a", "t", "j", "k", {"gpu": Demand.fixed(1)}), "action.service"),
    ],
)
def test_bad_values_name_the_field(build, field):
    with pytest.raises(ValueError, match=field):
        build()


def test_duration_follows_elasticity():
    a = Action("a", "t", "j", "test_run", {"cpu": Demand.range(1, 8)}, elastic="cpu",
               t1_s=8.0, elasticity=Elasticity.amdahl(1.0))
    assert a.duration(1) == 8.0
    assert a.duration(4) == pytest.approx(2.0)
    table = Elasticity.from_table({1: 1.0, 2: 0.75, 4: 0.5})
    assert table.efficiency(3) == 0.75  # nearest smaller entry
    assert Elasticity.amdahl(0.5).efficiency(2) == pytest.approx(1 / (2 * 0.75))
    assert Demand.range(1, 10, 4).choices == (1, 5, 9, 10)
    assert a.schedulable_elastic


def test_slot_init_builds_what_the_dataclass_init_builds():
    """slot_init's __init__ (slots set through their descriptors) takes the same arguments
    and builds the same frozen value as the dataclass's; it refuses what it cannot copy."""
    import dataclasses

    from tangram.model import slot_init

    def make():
        @dataclasses.dataclass(frozen=True, slots=True)
        class P:
            a: str
            b: int = 2
            c: tuple = ()
        return P

    plain, fast = make(), slot_init(make())
    for args, kw in ((("x",), {}), (("x", 3), {}), (("x",), {"c": (1,)}), ((), {"a": "y", "b": 4})):
        got, want = fast(*args, **kw), plain(*args, **kw)
        assert [getattr(got, f) for f in "abc"] == [getattr(want, f) for f in "abc"]
    assert fast("x") == fast("x", 2, ()) and hash(fast("x")) == hash(fast("x", 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast("x").b = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        fast()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        fast("x", d=1)  # type: ignore[call-arg]

    @dataclasses.dataclass(frozen=True, slots=True)
    class Q:
        a: list = dataclasses.field(default_factory=list)

    with pytest.raises(TypeError):
        slot_init(Q)
