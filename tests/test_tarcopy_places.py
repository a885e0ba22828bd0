"""executor/tarcopy.py's places (issue 47 #6): which places a docker fork copies besides
/work, and that a copy's unpack puts an entry only into a place it was given."""

from __future__ import annotations

import io

import pytest

from executor.tarcopy import UnsafeMember, pack, places_beside, unpack


def test_places_beside_drops_the_workdir_and_nested_places():
    assert places_beside("/work", ["/tmp", "/var/tmp", "/dev/shm", "/tmp"]) == \
        ("/tmp", "/var/tmp", "/dev/shm")
    # $HOME inside /tmp (the default image's is /tmp itself) or inside /work: copied once
    assert places_beside("/work", ["/tmp", "/tmp/home", "/work/home"]) == ("/tmp",)
    assert places_beside("/work", ["/tmp", "/home/u"]) == ("/tmp", "/home/u")
    assert places_beside("/work", ["relative", "/tmp/"]) == ("/tmp",)


def test_unpack_puts_each_place_back_and_refuses_a_place_not_given(tmp_path):
    work, place = tmp_path / "work", tmp_path / "place"
    for d in (work, place):
        d.mkdir()
    (work / "w.txt").write_text("w")
    (place / "sub").mkdir()
    (place / "sub" / "p.txt").write_text("p")
    stream = io.BytesIO()
    assert pack(stream, str(work), places=(str(place),)) == 2
    copy_work = tmp_path / "copy-work"
    copy_work.mkdir()
    # the copy was given no such place: refused
    stream.seek(0)
    with pytest.raises(UnsafeMember, match="no place a copy is given"):
        unpack(stream, str(copy_work))
    (place / "sub" / "p.txt").unlink()
    stream.seek(0)
    unpack(stream, str(copy_work), (str(place),))
    assert (copy_work / "w.txt").read_text() == "w"
    assert (place / "sub" / "p.txt").read_text() == "p"
