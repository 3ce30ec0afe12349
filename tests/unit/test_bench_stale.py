"""bench/stale.py on a tiny git repository under tmp_path (real git): a result whose measured path changed after
its commit is listed, one whose paths did not change is not; a headline (README-quoted) one fails the command,
as does one lacking provenance; bench/provenance.py records what stale.py reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import provenance  # noqa: E402
import stale  # noqa: E402

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}


def _git(repo: Path, *args: str) -> str:
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                         env={**os.environ, **GIT_ENV})
    return out.stdout.strip()


def _commit(repo: Path, files: dict[str, str], message: str) -> str:
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", message)
    return _git(repo, "rev-parse", "HEAD")


def _complete(commit: str, measures: list[str], **extra) -> dict:
    """A result whose provenance holds every field (as bench/provenance.py writes it)."""
    versions = dict.fromkeys(stale.VERSIONS, "1.0")
    return {"git_commit": commit, "git_dirty": False, "date": "2026-12-01T00:00:00", "versions": versions, "cpus": 2,
            "loadavg_before": [0.1, 0.1, 0.1], "measures": measures, **extra}


@pytest.fixture()
def repo(tmp_path: Path) -> tuple[Path, str]:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    first = _commit(repo, {"pkg/a.py": "A = 1\n", "pkg/b.py": "B = 1\n", "other/c.py": "C = 1\n",
                           "README.md": "see `bench/results/changed.json` and `bench/results/same.json`\n",
                           "docs/benchmarks.md": "and `bench/results/docs_only.json`\n"}, "first")
    return repo, first


def _write_results(repo: Path, results: dict[str, dict]) -> None:
    (repo / "bench" / "results").mkdir(parents=True, exist_ok=True)
    for name, doc in results.items():
        (repo / "bench" / "results" / name).write_text(json.dumps(doc))


def test_a_result_whose_measured_path_changed_after_its_commit_is_listed(repo):
    repo, first = repo
    _write_results(repo, {"changed.json": _complete(first, ["pkg/a.py"]),
                          "same.json": _complete(first, ["pkg/b.py", "other/"])})
    _commit(repo, {"pkg/a.py": "A = 2\n"}, "change a")
    by_name = {r.name: r for r in stale.examine_all(repo)}
    assert by_name["changed.json"].changed == ["pkg/a.py"] and by_name["changed.json"].stale
    assert by_name["same.json"].changed == [] and not by_name["same.json"].failing
    assert by_name["changed.json"].headline and by_name["same.json"].headline
    assert stale.main([], root=repo) == 1
    _commit(repo, {"pkg/a.py": "A = 1\n"}, "back as it was")  # the same code as at the result's commit
    assert stale.main([], root=repo) == 0


def test_only_headline_results_fail_the_command_but_all_lists_every_json(repo, capsys):
    repo, first = repo
    _write_results(repo, {"changed.json": _complete(first, ["pkg/a.py"]), "same.json": _complete(first, ["pkg/b.py"]),
                          "docs_only.json": _complete(first, ["pkg/a.py"]),
                          "unquoted.json": _complete(first, ["pkg/b.py"])})
    _commit(repo, {"pkg/a.py": "A = 2\n"}, "change a")
    (repo / "README.md").write_text("see `bench/results/same.json`\n")  # changed.json no longer a headline
    assert stale.main([], root=repo) == 0  # docs_only.json is stale, listed, but not a headline
    out = capsys.readouterr().out
    assert "warn docs_only.json (" in out and "measured code changed since" in out and "unquoted.json" not in out
    assert stale.main(["--all"], root=repo) == 1
    out = capsys.readouterr().out
    assert "FAIL changed.json" in out and "FAIL docs_only.json" in out and "ok   unquoted.json" in out
    assert out.rstrip().endswith("2 results stale or lacking provenance: changed.json, docs_only.json")


def test_missing_provenance_an_unknown_commit_and_dirty_measured_paths_are_listed(repo):
    repo, first = repo
    old = {"git_commit": first, "date": "2026-11-01", "cpu_count": 2, "loadavg_at_start": [0, 0, 0],
           "python": "3.12", "torch_version": "2.13"}  # before versions and git_dirty were recorded
    _write_results(repo, {"changed.json": old,
                          "same.json": _complete("0123abcd", ["pkg/b.py"]),
                          "docs_only.json": _complete(first, ["pkg/a.py"], git_dirty=True,
                                                      git_dirty_paths=["pkg/a.py", "notes.txt"])})
    by_name = {r.name: r for r in stale.examine_all(repo)}
    assert by_name["changed.json"].lacks == ["git_dirty", "versions", "measures"]  # no MEASURES entry either
    assert by_name["same.json"].unknown_commits == ["0123abcd"] and by_name["same.json"].stale
    assert by_name["docs_only.json"].dirty_measured == ["pkg/a.py"] and by_name["docs_only.json"].stale
    assert "not in this repository" in by_name["same.json"].status()


def test_the_oldest_of_several_commits_counts(repo):
    """A result merged from runs at two commits (gpu.json's rows) is stale when its older run's code changed."""
    repo, first = repo
    _commit(repo, {"pkg/a.py": "A = 2\n"}, "change a")
    second = _commit(repo, {"other/c.py": "C = 2\n"}, "change c")
    _write_results(repo, {"changed.json": _complete(second, ["pkg/"], rows=[{"git_commit": first}])})
    (result,) = [r for r in stale.examine_all(repo) if r.name == "changed.json"]
    assert result.commits[0] == first and result.changed == ["pkg/a.py"]


def test_markdown_gives_each_quoted_result_its_date_and_commit(repo, capsys):
    repo, first = repo
    _write_results(repo, {"changed.json": _complete(first, ["pkg/a.py"]), "same.json": _complete(first, ["pkg/b.py"])})
    (repo / "docs" / "benchmarks.md").write_text(f"text\n{stale.MARK_BEGIN}\nold\n{stale.MARK_END}\nmore\n")
    assert stale.main(["--write-docs"], root=repo) == 0
    body = (repo / "docs" / "benchmarks.md").read_text()
    assert body.startswith("text\n") and body.endswith(f"{stale.MARK_END}\nmore\n") and "old" not in body
    assert f"| **changed.json** | README.md | 2026-12-01 | {first[:9]} | clean | complete |" in body


def test_provenance_records_what_stale_reads(monkeypatch):
    monkeypatch.delenv("BENCH_GIT_COMMIT", raising=False)
    record = provenance.provenance(time.time(), os.getloadavg(), measures=["trainers/", "bench/stale.py"])
    assert stale.lacking(record) == [] and record["measures"] == ["bench/stale.py", "trainers/"]
    assert set(record["versions"]) == set(stale.VERSIONS) and record["versions"]["torch"]
    assert isinstance(record["git_dirty"], bool) and record["git_commit_source"] == "git"
    assert record["git_dirty"] == bool(record["git_dirty_paths"])
    assert provenance.provenance(time.time(), os.getloadavg())["measures"] is None  # bench/ft.py's call, as before
    with pytest.raises(ValueError, match="no such path"):
        provenance.provenance(time.time(), os.getloadavg(), measures=["trainers/no_such_module.py"])
