"""The docs say what the code does: the generated reference pages are current, and every command in a shell
block of README.md and docs/*.md parses (a cheap form of it: `--help`, the YAML's keys, `make -n`).

What is checked per command line (```bash / ```sh / ```shell / ```console blocks; in console blocks only the
`$ ` lines):
- `raytrain ...` and `python -m trainers ...`: the subcommand exists, its `--help` exits 0, every option is
  in that help and the words parse as the command's parser parses them; every `--set` key is a key of the
  run YAML (train, plan, cluster check) or of the experiment YAML (tune); a run YAML in the repository is
  loaded with the `--set` values, so a bad value fails here as it would for a user.
- `make TARGET`: `make -n TARGET` succeeds.
- `ray SUB ...`: the subcommand and its options exist in Ray's own command line; after `--`, the command
  a job runs is checked as its own line.
- `python SCRIPT`, `python -m MODULE`, `torchrun ...`: the script or module exists, torchrun's options exist.
- a path into the repository (examples/, clusters/, bench/, docs/, tests/) exists.
Words in capitals (RUN.yaml, HF_DIR, OUT_DIR) and `$VARS` are placeholders: their values are not checked.
The real, short forms of the docs' commands run in `make docs-check`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
import typing
import warnings
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import ray  # noqa: E402, F401  (sets RAY_CLIENT_MODE on import: before the leak guard looks)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs"))
import gen_reference  # noqa: E402

sys.path.remove(str(ROOT / "docs"))

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = ("bash", "sh", "shell", "console")
CHECKED = ("raytrain", "make", "ray", "python", "python3", "torchrun")
REPO_DIRS = ("examples/", "clusters/", "bench/", "docs/", "tests/")
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z0-9_]+\b|\$|<|\.\.\.|://")  # URIs too: the store may not be here
RUN_FOR_REAL = ("plan", "cluster")  # subcommands cheap enough to run as the docs write them
CONTROL = {"&&", "||", ";", "|", "&", "(", ")", "do", "done", "then", "fi", "until", "while", "if", "for"}


@dataclass(frozen=True)
class Command:
    where: str  # page:line
    words: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.words)}"


# ------------------------------------------------------------------------------------------ extraction


def shell_lines(text: str, name: str) -> list[tuple[str, str]]:
    """(page:line, command text) of every command in the page's shell blocks, continuations joined."""
    out: list[tuple[str, str]] = []
    lang = None
    pending, start = "", 0
    for no, line in enumerate(text.splitlines(), start=1):
        fence = re.match(r"^\s*```\s*(\w*)", line)
        if fence:
            lang = None if lang is not None else fence.group(1).lower()
            continue
        if lang not in SHELL:
            continue
        if lang == "console" and not pending:
            if not line.lstrip().startswith("$ "):
                continue
            line = line.lstrip()[2:]
        if not pending:
            start = no
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((f"{name}:{start}", pending + line))
        pending = ""
    return out


def commands_in(text: str, name: str) -> list[Command]:
    """The commands this test checks, split at `&&`, `;`, `|` and shell keywords."""
    found = []
    for where, line in shell_lines(text, name):
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        try:
            words = list(lexer)
        except ValueError:  # an unbalanced quote: the line is not a command we can read
            found.append(Command(where, ("<unreadable>", line)))
            continue
        current: list[str] = []
        for word in [*words, ";"]:
            if word in CONTROL:
                if current:
                    found.append(Command(where, tuple(current)))
                current = []
            else:
                current.append(word)
    return [c for c in found if _program(c.words) in CHECKED or c.words[0] == "<unreadable>"]


def _program(words: tuple[str, ...]) -> str:
    rest = _strip_prefix(words)
    return Path(rest[0]).name if rest else ""


def _strip_prefix(words: tuple[str, ...]) -> tuple[str, ...]:
    """Without leading `VAR=value` assignments and `sudo`."""
    i = 0
    while i < len(words) and (re.match(r"^[A-Za-z_]\w*=", words[i]) or words[i] in ("sudo", "env")):
        i += 1
    return words[i:]


def placeholder(word: str) -> bool:
    return bool(PLACEHOLDER.search(word))


# ---------------------------------------------------------------------------------------- the checks


def problems_of(text: str, name: str = "doc") -> list[str]:
    out = []
    for cmd in commands_in(text, name):
        if cmd.words[0] == "<unreadable>":
            out.append(f"{cmd.where}: unbalanced quotes: {cmd.words[1]}")
            continue
        out += [f"{cmd}: {p}" for p in check(_strip_prefix(cmd.words))]
    return out


def check(words: tuple[str, ...]) -> list[str]:
    program = Path(words[0]).name
    if program == "raytrain":
        return check_raytrain(words[1:])
    if program == "make":
        return check_make(words[1:])
    if program == "ray":
        return check_ray(words[1:])
    if program == "torchrun":
        return check_torchrun(words[1:])
    return check_python(words[1:])


def _paths(words: typing.Iterable[str]) -> list[str]:
    return [
        f"{w} does not exist"
        for w in words
        if w.startswith(REPO_DIRS) and not placeholder(w) and not (ROOT / w.split("=")[-1]).exists()
    ]


@cache
def _help(main_module: str, argv: tuple[str, ...]) -> argparse.ArgumentParser | str:
    """The parser whose `--help` `argv` reaches (gen_reference.help_of), or why there is none."""
    try:
        return gen_reference.help_of(argv, main_module)[0]
    except SystemExit as e:
        return str(e.code)


def _subcommand(words: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(the path to a `raytrain` subcommand's parser, the words its parser reads)."""
    best = None
    for path in gen_reference.commands():
        n = len(path)
        fixed = path[:-1] if path[-1] == "EXP.yaml" else path  # `tune EXP.yaml`: any experiment file
        if words[: len(fixed)] == fixed and len(words) >= n:
            if path[-1] == "EXP.yaml" and words[n - 1] in {p[-1] for p in gen_reference.commands()}:
                continue
            if best is None or len(fixed) > len(best[0]):
                best = (path, fixed)
    if best is None:
        return None
    path, fixed = best
    return path, words[len(fixed) :]


def check_raytrain(words: tuple[str, ...], main_module: str = "raytrain_ext.cli") -> list[str]:
    if main_module == "raytrain_ext.cli":
        found = _subcommand(words)
        if found is None:
            return [f"no raytrain subcommand {' '.join(words[:2])!r} (raytrain --help lists them)"]
        path, rest = found
    else:
        path, rest = words[:1], words[1:]
    parser = _help(main_module, path)
    if isinstance(parser, str):
        return [f"--help fails: {parser}"]
    problems = _parse(parser, rest)
    if problems:
        return problems
    args = parser.parse_args(list(rest))
    sets = list(getattr(args, "overrides", []) or [])
    problems += _paths(rest)
    experiment = path[0] == "tune"
    problems += [p for kv in sets for p in _check_key(kv.partition("=")[0], experiment)]
    if problems or experiment or placeholder(" ".join(sets)):
        return problems
    if path[0] in RUN_FOR_REAL and main_module == "raytrain_ext.cli" and not any(map(placeholder, rest)):
        return _run_for_real((*path, *rest))
    run = getattr(args, "run", None) if path[:2] == ("cluster", "check") else getattr(args, "config", None)
    if run and (ROOT / run).is_file():
        from trainers._base import ConfigError
        from trainers.config import load_config

        try:
            load_config(ROOT / run, sets)
        except ConfigError as e:
            problems.append(f"the run YAML with these --set values is refused: {e}")
    return problems


@cache
def _run_for_real(argv: tuple[str, ...]) -> list[str]:
    """`raytrain plan` and `raytrain cluster check` are arithmetic over the YAML (milliseconds): run them as
    written, in this process, from the repository root; a wrong layout or a run that does not fit fails."""
    from raytrain_ext.cli import main

    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(argv))
    finally:
        os.chdir(cwd)
    last = (err.getvalue().strip() or out.getvalue().strip()).splitlines()[-1:]
    return [] if code == 0 else [f"exits {code}: {' '.join(last)}"]


def _parse(parser: argparse.ArgumentParser, words: tuple[str, ...]) -> list[str]:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args(list(words))
    except SystemExit as e:
        if e.code:
            return [err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {e.code}"]
    return []


def _check_key(key: str, experiment: bool) -> list[str]:
    from search.config import ExperimentConfig
    from trainers.config import RunConfig

    parts = key.split(".")
    if experiment and parts[0] in ("overrides", "space") and len(parts) > 1:
        parts = parts[1:]
    elif experiment:
        return [] if _has_key(ExperimentConfig, parts) else [f"--set {key}: no such key in the experiment YAML"]
    return [] if _has_key(RunConfig, parts) else [f"--set {key}: no such key in the run YAML"]


def _has_key(model: typing.Any, parts: list[str]) -> bool:
    for i, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            return False
        sub = gen_reference._sub_model(field.annotation)
        if sub is None:  # a leaf; a mapping (deepspeed_extra, tags) takes any key below it
            return i == len(parts) - 1 or typing.get_origin(field.annotation) is dict
        model = sub
    return True


@cache
def _make_target(target: str) -> str:
    done = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, timeout=60)
    return "" if done.returncode == 0 else (done.stderr.strip().splitlines() or ["failed"])[-1]


def check_make(words: tuple[str, ...]) -> list[str]:
    targets = [w for w in words if not w.startswith("-") and "=" not in w]
    return [f"make -n {t}: {err}" for t in targets or ["all"] for err in [_make_target(t)] if err]


@cache
def _ray_cli():
    with warnings.catch_warnings():  # importing Ray's CLI imports Serve, whose models warn about pydantic
        warnings.simplefilter("ignore")
        from ray.scripts.scripts import cli
    return cli


def check_ray(words: tuple[str, ...]) -> list[str]:
    import click

    words, _, job = (tuple(x) for x in _split(words, "--"))
    command, path = _ray_cli(), ["ray"]
    i = 0
    while isinstance(command, click.Group) and i < len(words) and not words[i].startswith("-"):
        sub = command.commands.get(words[i])
        if sub is None:
            return [f"{' '.join(path)} has no subcommand {words[i]!r}"]
        command, i = sub, i + 1
        path.append(words[i - 1])
    options = {o for p in command.params for o in (*p.opts, *getattr(p, "secondary_opts", []))}
    problems = [
        f"{' '.join(path)} has no option {w.split('=')[0]}"
        for w in words[i:]
        if w.startswith("-") and w.split("=")[0] not in options
    ]
    if job:
        problems += [f"the job's command: {p}" for p in check(_strip_prefix(job))]
    return problems


def _split(words: tuple[str, ...], sep: str) -> tuple[list[str], str, list[str]]:
    if sep in words:
        i = words.index(sep)
        return list(words[:i]), sep, list(words[i + 1 :])
    return list(words), "", []


def check_torchrun(words: tuple[str, ...]) -> list[str]:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    i = 0
    while i < len(words) and words[i].startswith("-") and words[i] not in ("-m", "--module"):
        action = parser._option_string_actions.get(words[i].split("=")[0])
        if action is None:
            return [f"torchrun has no option {words[i]}"]
        i += 1 if "=" in words[i] or action.nargs == 0 else 2
    return check_python(words[i:])


def check_python(words: tuple[str, ...]) -> list[str]:
    words = tuple(w for w in words if w not in ("-u", "-X", "-O"))
    if not words or words[0] == "-c":
        return []
    if words[0] in ("-m", "--module"):
        module = words[1] if len(words) > 1 else ""
        if importlib.util.find_spec(module) is None:
            return [f"no module {module}"]
        if module == "trainers":
            return check_raytrain(words[2:], main_module="trainers.__main__")
        return []
    script = words[0]
    if placeholder(script) or (ROOT / script).is_file():
        return _paths(words[1:])
    return [f"no script {script}"]


# ------------------------------------------------------------------------------------------- links

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    found = set()
    for line in _outside_code(text):
        m = re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if m:
            found.add(re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-"))
    return found


def _outside_code(text: str) -> list[str]:
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return out


def link_problems(page: Path) -> list[str]:
    """Links to files in the repository that are not there, and anchors no heading makes."""
    problems = []
    for line in _outside_code(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not file.exists():
                problems.append(f"{where}: no file {path}")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
                problems.append(f"{where}: no heading makes #{anchor} in {file.relative_to(ROOT)}")
    return problems


# ------------------------------------------------------------------------------------------- tests


def test_generated_reference_pages_are_current():
    for path, text in gen_reference.pages().items():
        current = path.read_text() if path.exists() else ""
        assert current == text, f"{path.relative_to(ROOT)} is out of date; fix: run `make docs` and commit it"


def test_every_command_in_the_docs_parses():
    problems = [p for page in PAGES for p in problems_of(page.read_text(), page.relative_to(ROOT).as_posix())]
    assert not problems, "\n".join(problems)


def test_every_link_and_image_is_there():
    problems = [p for page in PAGES for p in link_problems(page)]
    assert not problems, "\n".join(problems)


def test_the_docs_hold_commands():
    """The extraction finds the README's commands (a page format it cannot read would check nothing)."""
    found = commands_in((ROOT / "README.md").read_text(), "README.md")
    programs = {_program(c.words) for c in found}
    assert {"make", "raytrain"} <= programs, programs
    assert any(c.words[:2] == ("make", "demo") for c in found)


WRONG = """
```bash
raytrain trian examples/tiny-dense.yaml
raytrain train examples/tiny-dense.yaml --no-such-flag
raytrain train examples/tiny-dense.yaml --set model.n_head=8
raytrain train examples/tiny-dense.yaml --set model.n_heads=3
raytrain train examples/no-such-run.yaml
raytrain plan examples/tiny-dense.yaml
raytrain plan examples/tiny-dense.yaml --world-size 8
raytrain train examples/tiny-dense.yaml --fit sometimes
raytrain tune examples/pbt-demo.yaml --set populaton=2
raytrain tune report runs/tune/x --outptu y
make no-such-target
ray job submitt --address http://127.0.0.1:8265
ray start --head --no-such-option
ray job submit --address http://127.0.0.1:8265 -- raytrain train examples/tiny-dense.yaml --nope
python -m no_such_module_here
python bench/no_such_script.py
torchrun --nproc-per-node 2 --no-such-torchrun-flag -m trainers train examples/tiny-fsdp.yaml
torchrun --nproc-per-node 2 -m trainers train examples/tiny-fsdp.yaml --no-ray
```
```console
$ raytrain export --no-such-option a b
```
"""

RIGHT = """
```bash
source .venv/bin/activate
raytrain train examples/tiny-dense.yaml --set optimizer.lr=1e-3 \\
    --set train.steps=300   # a comment
raytrain plan RUN.yaml --world-size 32 --device-memory 80GiB
raytrain tune examples/pbt-demo.yaml --set 'space.optimizer.lr={loguniform: [1e-4, 1e-1]}' --set name=wide
raytrain tune report runs/tune/pbt-demo && raytrain tune replay runs/tune/pbt-demo --trial best
make demo && make test PYTEST_ARGS=-x
ray job submit --address http://127.0.0.1:8265 --working-dir . -- raytrain train examples/tiny-fsdp.yaml
torchrun --nproc-per-node 2 -m trainers train examples/tiny-fsdp.yaml --set parallel.zero_stage=2
python examples/make_pretrained.py --output models/tiny-llama
```
```text
raytrain this is output, not checked --at-all
```
"""


def test_a_wrong_command_fails_the_check():
    problems = problems_of(WRONG)
    lines = {p.split(":")[1] for p in problems}  # doc:LINE: ...
    wrong_lines = [str(i) for i, line in enumerate(WRONG.splitlines(), 1) if line.startswith(CHECKED + ("$",))]
    assert sorted(lines, key=int) == wrong_lines, "\n".join(problems)
    assert problems_of(RIGHT) == []
