"""The test tiers' rerun rule (pyproject's pytest-rerunfailures options): a test whose multi-process group
lost a rank to a crash before it returned (tests/dist/harness.py's RankCrashed, raised in a module-scoped
fixture as the dist tests' groups are) runs once more from a fresh fixture; a test crashed twice, or any
other error, fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

GROUP_TESTS = """
from pathlib import Path

import pytest
from tests.dist.harness import RankCrashed

COUNT = Path(__file__).with_name("runs")


@pytest.fixture(scope="module")
def group():
    runs = int(COUNT.read_text()) if COUNT.exists() else 0
    COUNT.write_text(str(runs + 1))
    if runs < {crashes}:
        raise {error}("rank 0 of 4 was killed by SIGABRT before it returned", 0, 4242, -6, "SIGABRT")
    return runs


def test_first(group):
    assert group == {crashes}


def test_second(group):
    assert group == {crashes}
"""


def _outcome(config: pytest.Config, tmp_path: Path, crashes: int, error: str) -> tuple[str, int]:
    """pytest's summary line for the two tests above under this session's rerun options (pyproject's), and
    how often the fixture ran."""
    (tmp_path / "test_group.py").write_text(GROUP_TESTS.format(crashes=crashes, error=error))
    reruns = ["-o", f"reruns={config.getini('reruns')}", "-o", f"only_rerun={' '.join(config.getini('only_rerun'))}"]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
               "-c", str(tmp_path / "none.ini"), *reruns, str(tmp_path / "test_group.py")]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return done.stdout.strip().splitlines()[-1], int((tmp_path / "runs").read_text())


@pytest.mark.parametrize(
    ("crashes", "error", "summary", "runs"),
    [
        (1, "RankCrashed", "2 passed, 1 rerun", 2),  # one crash: the fixture runs again, both tests pass
        (9, "RankCrashed", "2 errors, 2 rerun", 3),  # always crashes: both fail, after one more try each
        (1, "RuntimeError", "2 errors", 1),  # anything else is never rerun
    ],
)
def test_only_a_crashed_rank_reruns_and_only_once(pytestconfig, tmp_path, crashes, error, summary, runs):
    (tmp_path / "none.ini").write_text("[pytest]\n")
    line, fixture_runs = _outcome(pytestconfig, tmp_path, crashes, error)
    assert summary in line and fixture_runs == runs, line
