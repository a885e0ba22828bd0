import pytest
from calc import add, mean, mul


@pytest.mark.parametrize("a,b,total", [(1, 2, 3), (0, 0, 0), (-4, 4, 0), (10, 5, 15)])
def test_add(a, b, total):
    assert add(a, b) == total


@pytest.mark.parametrize("a,b,product", [(2, 3, 6), (0, 9, 0), (-2, 3, -6)])
def test_mul(a, b, product):
    assert mul(a, b) == product


def test_mean():
    assert mean([1, 2, 3, 4]) == 2.5
