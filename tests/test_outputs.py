"""Outputs written whole or not at all (mirror_sd/outputs.py): what a failure leaves behind."""

from pathlib import Path

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


def test_a_symbolic_link_or_a_nameless_out_is_refused_before_any_work(tmp_path):
    from mirror_sd.bench.output import check_out as check_bench_out
    from mirror_sd.errors import BadInputError
    from mirror_sd.outputs import check_out

    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for out in (tmp_path / "link", tmp_path / "dangling"):
        with pytest.raises(BadInputError, match="symbolic link"):
            check_out(out, True, "manifest.json", "bundle")
        with pytest.raises(BadInputError, match="symbolic link"):
            check_bench_out(out)
    for out in (Path("."), Path(".."), tmp_path / "target" / ".."):  # ("a/." is "a" to pathlib)
        with pytest.raises(BadInputError, match="must name a directory"):
            check_bench_out(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "link", "target"]


def test_an_out_that_cannot_be_moved_aside_leaves_no_folder_beside_it(tmp_path, monkeypatch):
    from mirror_sd.outputs import move_into_place

    out, staging = tmp_path / "out", tmp_path / "staging"
    out.mkdir()
    staging.mkdir()
    real = Path.rename
    monkeypatch.setattr(Path, "rename", lambda self, to: (_ for _ in ()).throw(OSError("busy")) if self == out
                        else real(self, to))
    with pytest.raises(OSError, match="busy"):
        move_into_place(staging, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "staging"]
