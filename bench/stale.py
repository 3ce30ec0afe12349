"""Which benchmark results no longer describe the code: each result under bench/results/ whose measured code
(the repository paths it names in `measures`, else those in MEASURES below) changed since the commit it was
made at, and each that lacks the provenance every result records (bench/provenance.py: commit, dirty flag,
versions of Python, torch, Ray, torchft and DeepSpeed, CPU count, load).

    python bench/stale.py             (`make bench-stale`) the results the docs quote; exit 1 when one the
                                      README quotes (a headline) is stale or lacks provenance
    python bench/stale.py --all       every JSON under bench/results/; exit 1 when any is
    python bench/stale.py --markdown  the table of docs/benchmarks.md (each quoted result, its date and commit)
    python bench/stale.py --write-docs   that table written into docs/benchmarks.md between its markers

A result is quoted where README.md, docs/*.md or bench/README.md name it (`bench/results/NAME.json`); a
headline where README.md does (or HEADLINE_UNNAMED says its figure is in README.md without its path).

A result's commits are every `git_commit` in its JSON (a result merged from several runs, as gpu.json's rows,
names several): it is stale when a measured path changed between its oldest commit and HEAD (committed
changes: `git diff --name-only COMMIT HEAD -- PATHS`), or when it was made on a tree whose uncommitted changes
touched a measured path (`git_dirty_paths`), or when its commit is not in this repository (then nothing can
be said). A result made on a dirty tree that did not record which paths were dirty is said so, not failed.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "bench/results"
QUOTING = ("README.md", "docs/*.md", "bench/README.md")
HEADLINE_DOC = "README.md"
# Figures README.md quotes without naming their JSON: file name -> where.
HEADLINE_UNNAMED: dict[str, str] = {}
# The measured code of results made before bench/provenance.py recorded `measures` (by file name; a result
# that records it is read from its JSON). Each: the script that measured it, and the code its figure is of.
_TRAINER = ["trainers/"]
_RAY = ["trainers/", "raytrain_ext/"]
_PBT = ["trainers/", "raytrain_ext/", "search/"]
MEASURES: dict[str, list[str]] = {
    "chaos.json": ["bench/chaos.py", *_RAY],
    "checkpoint.json": ["bench/checkpoint.py", "bench/run.py", *_TRAINER],
    "checkpoint_writer_nice10.json": ["bench/checkpoint.py", "bench/run.py", *_TRAINER],
    "chunk_calls.json": ["bench/chunk_calls.py", *_TRAINER],
    "cli.json": ["bench/cli.py", *_RAY, "search/"],
    "cluster.json": ["bench/cluster.py", "tests/cluster/", *_RAY],
    "data.json": ["bench/data.py", "trainers/data/", "trainers/storage.py"],
    "data_busy.json": ["bench/data.py", "trainers/data/", "trainers/storage.py"],
    "ft.json": ["bench/ft.py", "tests/cluster/", *_RAY],
    "gpu.json": ["bench/gpu.py", "bench/gpu_check.sh", "bench/plain_loop.py", *_TRAINER],
    "lean.json": ["bench/lean.py", "bench/run.py", *_TRAINER],
    "lean_chunked_loss.json": ["bench/lean.py", "bench/run.py", *_TRAINER],
    "moe.json": ["bench/moe.py", *_TRAINER],
    "moe_gpu_before_compiled_loss.json": ["bench/moe.py", *_TRAINER],
    "no_ray.json": ["bench/no_ray.py", *_RAY],
    "pbt_overhead.json": ["bench/pbt_overhead.py", *_PBT],
    "pbt_quality.json": ["bench/pbt_quality.py", *_PBT],
    "pbt_toy.json": ["bench/pbt_toy.py", *_PBT],
    "pbt_vs_random.json": ["bench/pbt_vs_random.py", *_PBT],
    "pbt_vs_random_burnin0.json": ["bench/pbt_vs_random.py", *_PBT],
    "pipeline.json": ["bench/pipeline.py", *_TRAINER],
    "plan_vs_measured.json": ["bench/plan_vs_measured.py", *_TRAINER],
    "ray_recovery.json": ["bench/ray_recovery.py", *_RAY],
    "resume_profile_cpu.json": ["bench/resume_profile.py", "bench/resume_compare.py", *_TRAINER],
    "resume_profile_gpu.json": ["bench/resume_profile.py", *_TRAINER],
    "storage.json": ["bench/storage.py", "trainers/storage.py"],
    "trainer_overhead.json": ["bench/run.py", "bench/plain_loop.py", *_TRAINER],
    "trainer_overhead_run1.json": ["bench/run.py", "bench/plain_loop.py", *_TRAINER],
    "trainer_overhead_run2.json": ["bench/run.py", "bench/plain_loop.py", *_TRAINER],
    "zero_memory.json": ["bench/zero_memory.py", *_TRAINER],
}
# What every result's provenance holds (bench/provenance.py's names; earlier results' names for the same
# thing count): field -> the keys that hold it.
REQUIRED: dict[str, tuple[str, ...]] = {
    "git_commit": ("git_commit",),
    "git_dirty": ("git_dirty",),
    "date": ("date",),
    "versions": ("versions",),
    "cpus": ("cpus", "cpu_count"),
    "load": ("loadavg_before", "loadavg_at_start", "loadavg"),
}
VERSIONS = ("python", "torch", "ray", "torchft", "deepspeed")
_SHA = re.compile(r"\b[0-9a-f]{7,40}\b")


@dataclass
class Result:
    """One result file and what was found about it."""

    name: str  # relative to the results folder
    quoted_in: list[str] = field(default_factory=list)
    headline: bool = False
    commits: list[str] = field(default_factory=list)  # every distinct commit its JSON names, oldest first
    dates: list[str] = field(default_factory=list)
    dirty: bool | None = None  # the main provenance's git_dirty
    measures: list[str] = field(default_factory=list)
    measures_from: str = ""  # "json" | "MEASURES" | "" (unknown)
    lacks: list[str] = field(default_factory=list)  # provenance fields missing
    changed: list[str] = field(default_factory=list)  # measured files changed since the oldest commit
    dirty_measured: list[str] = field(default_factory=list)  # measured paths uncommitted when it was made
    unknown_commits: list[str] = field(default_factory=list)  # commits not in this repository
    error: str = ""  # unreadable JSON

    @property
    def stale(self) -> bool:
        return bool(self.changed or self.dirty_measured or self.unknown_commits or self.error
                    or not self.commits)

    @property
    def failing(self) -> bool:
        return self.stale or bool(self.lacks)

    def status(self) -> str:
        if self.error:
            return f"UNREADABLE: {self.error}"
        parts = []
        if not self.commits:
            parts.append("no commit recorded")
        if self.unknown_commits:
            parts.append(f"commit {', '.join(self.unknown_commits)} not in this repository")
        if self.changed:
            shown = ", ".join(self.changed[:6]) + (f", ... ({len(self.changed)} files)" if len(self.changed) > 6 else "")
            parts.append(f"measured code changed since {self.commits[0][:9]}: {shown}")
        if self.dirty_measured:
            parts.append(f"made with uncommitted changes to {', '.join(self.dirty_measured)}")
        if self.lacks:
            parts.append(f"lacks provenance: {', '.join(self.lacks)}")
        if not parts and self.dirty:
            parts.append("ok (made on a dirty tree: which paths were dirty is not recorded)")
        return "; ".join(parts) or "ok"


def git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)


def quoted(root: Path) -> dict[str, list[str]]:
    """Result file name -> the documents that name it (`bench/results/NAME.json`, or `results/NAME.json` in
    bench/README.md)."""
    out: dict[str, list[str]] = {}
    pattern = re.compile(r"(?:bench/)?results/([\w./-]+?\.json)")
    for glob in QUOTING:
        for doc in sorted(root.glob(glob)):
            rel = doc.relative_to(root).as_posix()
            for name in pattern.findall(doc.read_text()):
                if (root / RESULTS / name).is_file() and rel not in out.setdefault(name, []):
                    out[name].append(rel)
    return out


def provenances(doc: Any) -> list[dict[str, Any]]:
    """Every dict in the JSON that names a git_commit, the outermost first."""
    found, queue = [], [doc]
    while queue:
        x = queue.pop(0)
        if isinstance(x, dict):
            if "git_commit" in x:
                found.append(x)
            queue += list(x.values())
        elif isinstance(x, list):
            queue += x
    return found


def lacking(main: dict[str, Any] | None) -> list[str]:
    """The provenance fields (REQUIRED, VERSIONS) the result's main provenance does not hold."""
    if main is None:
        return list(REQUIRED)
    out = [name for name, keys in REQUIRED.items() if not any(k in main for k in keys)]
    if "versions" not in out:
        versions = main["versions"] if isinstance(main["versions"], dict) else {}
        out += [f"versions.{v}" for v in VERSIONS if v not in versions]
    return out


def examine(root: Path, name: str, quoted_in: list[str], headline: bool) -> Result:
    result = Result(name, quoted_in, headline)
    try:
        doc = json.loads((root / RESULTS / name).read_text())
    except (OSError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    found = provenances(doc)
    main = found[0] if found else None
    result.lacks = lacking(main)
    dirty = main.get("git_dirty") if main else None
    result.dirty = None if dirty is None else bool(dirty)  # some earlier results hold `git status` lines
    if main is not None and main.get("measures"):
        result.measures, result.measures_from = list(main["measures"]), "json"
    elif Path(name).name in MEASURES:
        result.measures, result.measures_from = MEASURES[Path(name).name], "MEASURES"
    else:
        result.lacks.append("measures")
    shas = []
    for p in found:
        sha = _SHA.search(str(p.get("git_commit") or ""))
        if sha and sha.group(0) not in shas:
            shas.append(sha.group(0))
        if p.get("date") and str(p["date"]) not in result.dates:
            result.dates.append(str(p["date"]))
        dirty_paths = p.get("git_dirty_paths") or []
        result.dirty_measured += [d for d in dirty_paths if _under(d, result.measures) and d not in result.dirty_measured]
    known = []
    for sha in shas:
        full = git(root, "rev-parse", "--verify", "--quiet", f"{sha}^{{commit}}")
        (known.append(full.stdout.strip()) if full.returncode == 0 else result.unknown_commits.append(sha))
    # oldest first: the changes since the oldest commit hold those since every later one
    known.sort(key=lambda c: int(git(root, "rev-list", "--count", c).stdout.strip() or 0))
    result.commits = known + result.unknown_commits
    if known and result.measures:
        diff = git(root, "diff", "--name-only", known[0], "HEAD", "--", *result.measures)
        result.changed = diff.stdout.split() if diff.returncode == 0 else [f"(git diff failed: {diff.stderr.strip()})"]
    result.dates.sort()
    return result


def _under(path: str, measures: list[str]) -> bool:
    return any(path == m.rstrip("/") or path.startswith(m.rstrip("/") + "/") for m in measures)


def examine_all(root: Path = ROOT, every: bool = False) -> list[Result]:
    """The quoted results (every JSON under bench/results/ with `every`), headlines first, then by name."""
    names = quoted(root)
    for name in HEADLINE_UNNAMED:
        if (root / RESULTS / name).is_file():
            names.setdefault(name, [])
    if every:
        for path in sorted((root / RESULTS).rglob("*.json")):
            names.setdefault(path.relative_to(root / RESULTS).as_posix(), [])
    out = [examine(root, n, q, HEADLINE_DOC in q or n in HEADLINE_UNNAMED) for n, q in names.items()]
    return sorted(out, key=lambda r: (not r.headline, r.name))


def text(results: list[Result], root: Path = ROOT, every: bool = False) -> str:
    head = git(root, "rev-parse", "--short", "HEAD").stdout.strip()
    failing = [r for r in results if r.failing and (every or r.headline)]
    lines = [f"bench/stale.py at HEAD {head}: {len(results)} results ({'every JSON' if every else 'those the docs quote'}"
             f"; headline: quoted in {HEADLINE_DOC})"]
    for r in results:
        mark = "FAIL" if r in failing else ("ok  " if not r.failing else "warn")
        tag = " [headline]" if r.headline else ""
        date = r.dates[0][:10] if r.dates else "no date"
        commits = _commits(r.commits, ",")
        lines.append(f"{mark} {r.name}{tag} ({date}, {commits}): {r.status()}")
    lines.append(f"{len(failing)} {'results' if every else 'headline results'} stale or lacking provenance"
                 + (": " + ", ".join(r.name for r in failing) if failing else ""))
    return "\n".join(lines)


def _commits(commits: list[str], sep: str) -> str:
    """Short shas, oldest first; of many, the oldest, the newest and how many."""
    short = [c[:9] for c in commits]
    if len(short) > 3:
        return f"{short[0]}{sep}...{sep}{short[-1]} ({len(short)} commits)"
    return sep.join(short) or "-"


MARK_BEGIN = "<!-- bench/stale.py --markdown: begin -->"
MARK_END = "<!-- bench/stale.py --markdown: end -->"


def markdown(results: list[Result]) -> str:
    """Each quoted result: where it is quoted, its date(s), commit(s), dirty flag and the provenance it lacks
    (what does not change with the code; whether it is stale now is `make bench-stale`'s)."""
    rows = ["| result | quoted in | date | commit | tree | provenance |", "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        dates = sorted({d[:10] for d in r.dates})
        when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}" if dates else "-"
        tree = {True: "dirty", False: "clean", None: "unknown"}[r.dirty] if r.commits else "-"
        where = [q.removeprefix("docs/") for q in r.quoted_in]
        where = ", ".join(where + (["README.md (the figure, not the file)"] if r.name in HEADLINE_UNNAMED else []))
        lacks = "complete" if not r.lacks else "lacks " + ", ".join(r.lacks)
        name = f"**{r.name}**" if r.headline else r.name
        rows.append(f"| {name} | {where or '-'} | {when} | {_commits(r.commits, ', ')} | {tree} | {lacks} |")
    return "\n".join(rows)


def write_docs(results: list[Result], doc: Path) -> None:
    body = doc.read_text()
    if MARK_BEGIN not in body or MARK_END not in body:
        raise SystemExit(f"bench/stale.py --write-docs: {doc} has no {MARK_BEGIN} ... {MARK_END} block; fix: add one")
    before, rest = body.split(MARK_BEGIN, 1)
    after = rest.split(MARK_END, 1)[1]
    doc.write_text(f"{before}{MARK_BEGIN}\n{markdown(results)}\n{MARK_END}{after}")


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--all", action="store_true", help="every JSON under bench/results/, each one counted")
    p.add_argument("--markdown", action="store_true", help="docs/benchmarks.md's table of the quoted results")
    p.add_argument("--write-docs", action="store_true", help="write that table into docs/benchmarks.md")
    args = p.parse_args(argv)
    results = examine_all(root, args.all)
    if args.write_docs:
        write_docs(results, root / "docs" / "benchmarks.md")
        return 0
    if args.markdown:
        print(markdown(results))
        return 0
    print(text(results, root, args.all))
    return int(any(r.failing and (args.all or r.headline) for r in results))


if __name__ == "__main__":
    sys.exit(main())
