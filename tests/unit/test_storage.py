"""trainers.storage's operations read the same on a local folder and in a bucket (a local S3 server, moto):
a folder committed whole, listings, a growing file polled, local copies for tools, the run dir's names."""

from __future__ import annotations

import pytest

from trainers.run_dir import RunDir
from trainers.storage import (
    absolute,
    commit_folder,
    is_within,
    list_files,
    list_names,
    local_folder,
    location,
    occupied,
    publish,
    read_appended,
    read_bytes,
    read_range,
    remove_tree,
    start_folder,
    working_copy,
    write_bytes_atomic,
    write_folder,
)

pytestmark = pytest.mark.usefixtures("own_cache")


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path, s3):
    """A folder to work in: local, or a prefix of a fresh bucket (the server is started before the test's
    environment guard looks, for both)."""
    if request.param == "local":
        return tmp_path / "root"
    return location(f"s3://{s3.make_bucket()}/root")


def test_a_folder_appears_whole_in_place_of_the_ones_it_replaces(root):
    old, later = root / "step_00000004", root / "step_00000006"
    for folder in (old, later):
        write_bytes_atomic(folder / "data", b"old")
        write_bytes_atomic(folder / "COMMITTED", b"{}")
    final = root / "step_00000004"
    staging = start_folder(final, "COMMITTED", name=".install-step_00000004-x")
    write_bytes_atomic(staging / "data", b"new")
    write_bytes_atomic(staging / "sub" / "more", b"123")
    assert not (final / "COMMITTED").is_file() or read_bytes(final / "data") == b"old", "nothing half-made loads"
    commit_folder(staging, final, "COMMITTED", b'{"step": 4}\n', replaces=["step_00000006"])
    assert read_bytes(final / "COMMITTED") == b'{"step": 4}\n' and read_bytes(final / "data") == b"new"
    assert list_files(final) == ["COMMITTED", "data", "sub/more"]
    assert list_names(root) == ["step_00000004"], "the replaced folder and the staging are gone"
    assert list_names(root, "step_*6") == [] and list_names(root / "missing") == []
    remove_tree(final, first="COMMITTED")
    assert not occupied(final) and not occupied(root / "missing")


def test_a_growing_file_is_read_from_where_it_was_and_from_0_after_a_rewind(root):
    path = root / "metrics.jsonl"
    assert read_appended(path, 0) == (None, 0, None)
    write_bytes_atomic(path, b"a\nb\n")
    data, offset, version = read_appended(path, 0)
    assert (data, offset) == (b"a\nb\n", 0)
    write_bytes_atomic(path, b"a\nb\nc\n")  # locally a new file (the atomic writer renames): read again
    data, offset, version = read_appended(path, 4, version)
    assert data in (b"c\n", b"a\nb\nc\n") and data.endswith(b"c\n")
    write_bytes_atomic(path, b"a\n")  # rewound below the offset
    assert read_appended(path, 6, version)[:2] == (b"a\n", 0)
    assert bytes(read_range(path, 0, 1)) == b"a" and bytes(read_range(path, 1, 0)) == b""


def test_local_copies_for_tools_and_a_working_copy_published_whole(root, tmp_path):
    write_bytes_atomic(root / "src" / "config.yaml", b"cfg")
    write_bytes_atomic(root / "src" / "deep" / "x", b"x")
    local = local_folder(root / "src", tmp_path / "down", names=["config.yaml", "absent"])
    assert (local / "config.yaml").read_bytes() == b"cfg"
    assert (local_folder(root / "src", tmp_path / "all") / "deep" / "x").read_bytes() == b"x"
    with write_folder(root / "out", last="summary.txt") as out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.txt").write_text("s")
        (out / "plot.png").write_bytes(b"p")
    assert list_files(root / "out") == ["plot.png", "summary.txt"]
    target = RunDir(root / "run").metrics
    copy = working_copy(target)
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_bytes(b'{"step": 1}\n')
    publish(copy, target)
    assert read_bytes(target) == b'{"step": 1}\n'


def test_absolute_locations_and_what_is_within(root, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_within(absolute(root / "run" / "checkpoints"), root / "run")
    assert not is_within(root / "other", root / "run") and not is_within(tmp_path / "x", location("s3://b/x"))
    assert absolute("rel") == tmp_path / "rel" and absolute(location("s3://b/x")) == location("s3://b/x")
