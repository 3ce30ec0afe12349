"""The command line is public: its subcommands and flags are tested so they do not drift."""

from __future__ import annotations

import re

import pytest

from raytrain_ext.cli import build_parser, main


@pytest.mark.parametrize(
    "argv", [["--help"], ["train", "--help"], ["data", "--help"], ["data", "prepare", "--help"], ["export", "--help"]]
)
def test_help_everywhere(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    assert "usage: raytrain" in capsys.readouterr().out


def test_export_flags():
    args = build_parser().parse_args(["export", "runs/x", "out", "--dtype", "bf16", "--max-shard-size", "2GB"])
    assert (args.source, args.out_dir, args.dtype, args.max_shard_size, args.allow_inexact) == (
        "runs/x", "out", "bf16", "2GB", False
    )


def test_train_flags():
    args = build_parser().parse_args(["train", "run.yaml", "--set", "a.b=1", "--set", "c=2", "--no-progress"])
    assert args.config == "run.yaml" and args.overrides == ["a.b=1", "c=2"] and args.no_progress


def test_data_prepare_end_to_end(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello world\n" * 200)
    (tmp_path / "b.txt").write_text("another document\n" * 200)
    (tmp_path / "c.txt").write_text("third one here\n" * 200)
    out = tmp_path / "data"
    code = main(
        [
            "data",
            "prepare",
            "--input",
            str(tmp_path),
            "--output",
            str(out),
            "--val-fraction",
            "0.5",
            "--no-progress",
        ]
    )
    assert code == 0
    assert (out / "manifest.json").is_file()
    assert f"wrote {out}" in capsys.readouterr().out


def test_version_names_the_distribution(capsys, monkeypatch):
    from importlib.metadata import version

    import raytrain_ext._version as v

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"raytrain-ext {version('raytrain-ext')}\n"
    assert v.__version__ == version("raytrain-ext")

    def not_installed(name: str) -> str:
        raise v.PackageNotFoundError(name)

    monkeypatch.setattr(v, "version", not_installed)  # a source tree on PYTHONPATH: pyproject.toml's version
    assert v.package_version() == re.search(r'^version = "(.+)"', v.PYPROJECT.read_text(), re.MULTILINE)[1]
