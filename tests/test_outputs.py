"""Outputs written whole or not at all (mirror_sd/outputs.py): what a failure leaves behind."""

import pytest

from mirror_sd.outputs import staged


def test_staged_moves_a_finished_output_into_place(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    with staged(out) as staging:
        (staging / "f.txt").write_text("done")
    assert (out / "f.txt").read_text() == "done"
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]  # no staging directory beside it


def test_a_failed_output_leaves_neither_it_nor_the_folders_made_for_it(tmp_path):
    (tmp_path / "kept").mkdir()
    out = tmp_path / "kept" / "new" / "deeper" / "out"
    with pytest.raises(RuntimeError, match="half-way"):
        with staged(out) as staging:
            (staging / "f.txt").write_text("half")
            raise RuntimeError("half-way")
    assert list((tmp_path / "kept").iterdir()) == []  # the folder that was there stays, empty


def test_a_failure_putting_it_in_place_cleans_up_too_but_keeps_what_others_wrote(tmp_path):
    out = tmp_path / "new" / "out"

    def place(staging, target):
        (tmp_path / "new" / "theirs.txt").write_text("someone else's")  # written meanwhile, beside OUT
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        with staged(out, place) as staging:
            (staging / "f.txt").write_text("x")
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["theirs.txt"]
