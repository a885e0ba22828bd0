"""The one parser of unit sets (tangram/units.py), directly and through every reader that
takes a set without a server: a trace (`tangram trace validate`, a real subprocess) and an
integration's config. The HTTP API's fields: tests/test_attack_units.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tangram.units import MAX_ALTERNATIVES, MAX_TEXT, MAX_UNITS, parse_units
from tangram_sdk.integrations.common import RewardConfig
from traces.generate import generate
from traces.schema import parse_set, write

ROOT = Path(__file__).parent.parent

#: strings that must be refused, with a word the refusal must say
BAD = [
    ("1-2000000", "1..4096"), ("1-999999999", "1..4096"), ("0-4294967295", "1..4096"),
    ("  1-999999999  ", "1..4096"), ("1,2,99999999999", "1..4096"),
    ("9" * MAX_TEXT, "1..4096"),
    (",".join(str(i) for i in range(2000)), f"longer than {MAX_TEXT}"),
    (",".join(str(i) for i in range(1, MAX_ALTERNATIVES + 2)), f"at most {MAX_ALTERNATIVES}"),
    ("8-2", "min 8 > max 2"), ("0", "1..4096"), ("0-4", "1..4096"),
    ("-3", "expected"), ("-1-4", "expected"), ("1--4", "expected"), ("", "expected"),
    (" ", "expected"), ("\t\n", "expected"), ("1,,2", "expected"), ("1-4,8", "expected"),
    ("4 4", "expected"), ("1e3", "expected"), ("0x10", "expected"), ("\u0661", "expected"),
    ("\u00b2", "expected"), ("1.5", "expected"), (True, "expected"), (2.0, "expected"),
    (None, "expected"), (-1, "1..4096"), (10 ** 30, "1..4096"), (MAX_UNITS + 1, "1..4096"),
]


@pytest.mark.parametrize("text,why", BAD, ids=range(len(BAD)))
def test_bad_sets_are_refused_naming_the_field_and_value(text, why):
    with pytest.raises(ValueError) as e:
        parse_units(text, "gpus")
    msg = str(e.value)
    assert msg.startswith("gpus: ") and why in msg, msg
    assert repr(text)[:20] in msg, msg  # the value as written (cut short when long)
    assert len(msg) < 200, msg  # a long value is not echoed whole


@pytest.mark.parametrize("text,choices", [
    ("4", (4,)), (4, (4,)), ("1-4", (1, 2, 3, 4)), (" 1 - 4 ", (1, 2, 3, 4)),
    ("1,2,4,8", (1, 2, 4, 8)), ("8, 2 ,2", (2, 8)), ("3-3", (3,)),
    (f"1-{MAX_UNITS}", tuple(range(1, MAX_UNITS + 1))), (str(MAX_UNITS), (MAX_UNITS,)),
])
def test_good_sets(text, choices):
    assert parse_units(text, "cpu").choices == choices


def test_a_smaller_bound_is_kept_and_never_raised():
    assert parse_units("1-8", "cpu", most=8).choices[-1] == 8
    with pytest.raises(ValueError, match=r"cpu: counts must be in 1\.\.8"):
        parse_units("1-9", "cpu", most=8)
    with pytest.raises(ValueError, match=r"in 1\.\.4096"):
        parse_units("5000", "cpu", most=10 ** 9)


def test_trace_cells_go_through_the_same_parser():
    assert parse_set("") is None and parse_set(float("nan")) is None and parse_set(None) is None
    assert parse_set("1-4").choices == (1, 2, 3, 4) and parse_set(8.0).choices == (8,)
    for text in ("1-999999999", "0-4294967295", "1.5", 0.5):
        with pytest.raises(ValueError):
            parse_set(text, "cpu_cores")


def test_trace_validate_refuses_huge_sets_without_expanding(tmp_path):
    """`tangram trace validate` on rows asking for a billion cores or two million GPUs:
    exit 2 naming each row, column and value (before: the sets were expanded, and
    "1-999999999" alone needs tens of GB)."""
    df = generate("coding", 2, 0)
    cpu_row, gpu_row = 1, 3
    df.loc[cpu_row, "cpu_cores"] = "1-999999999"
    df.loc[gpu_row, ["cpu_cores", "gpus", "service"]] = ["", "1-2000000", "judge"]
    path = write(df, tmp_path / "huge.csv")
    res = subprocess.run([sys.executable, str(ROOT / "cli.py"), "trace", "validate", str(path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert (f"row {cpu_row + 1}, column 'cpu_cores', value '1-999999999': counts must be in "
            "1..4096") in res.stderr, res.stderr
    assert f"row {gpu_row + 1}, column 'gpus', value '1-2000000'" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_integration_config_uses_the_same_parser():
    for cpu in ("1-999999999", "0", "1,,2", True):
        with pytest.raises(ValueError, match=r"^reward\.cpu: "):
            RewardConfig.from_dict({"command": "true", "cpu": cpu})
    assert RewardConfig.from_dict({"command": "true", "cpu": "1-8"}).cpu == "1-8"
