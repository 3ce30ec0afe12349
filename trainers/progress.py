"""Progress of a run on the console: a tqdm bar on a terminal, plain lines in a log.

A bar redraws itself with carriage returns and ANSI codes: on a terminal that is one line, in a file (a
`ray job submit` log, `nohup`, CI) it is hundreds of lines of escapes (a job log held 382 lines for 600
steps). Where stderr is not a terminal, `progress_bar` gives `LineProgress` instead: the same calls,
and one plain line at each tenth of the run, at most one a minute between them, and one at the end.
"""

from __future__ import annotations

import re
import sys
import time
from typing import Any, TextIO

__all__ = ["LineProgress", "is_terminal", "plain", "progress_bar"]

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def is_terminal(stream: TextIO | None = None) -> bool:
    stream = stream if stream is not None else sys.stderr
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def plain(text: str) -> str:
    """`text` without ANSI escape codes (colors, cursor moves)."""
    return _ANSI.sub("", text)


def progress_bar(total: int, desc: str, initial: int = 0, unit: str = "step", file: TextIO | None = None):
    """A tqdm bar on a terminal, else a `LineProgress` (both: `n`, `update`, `set_postfix`, `write`, `close`)."""
    if is_terminal(file):
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, file=file)
    return LineProgress(total, desc, initial, unit, file)


class LineProgress:
    """tqdm's calls, printed as plain lines: `desc: step 120/600 (20%), loss=3.412, tok_s=3708, 2m05s`."""

    def __init__(self, total: int, desc: str, initial: int = 0, unit: str = "step", file: TextIO | None = None,
                 every_s: float = 60.0, parts: int = 10, show: bool = True):
        """`show=False`: no progress lines, only what `write` is given (a run's events)."""
        self.total, self.desc, self.n, self.unit, self.show = total, desc, initial, unit, show
        self.file, self.every_s, self.parts = file, every_s, parts
        self.postfix: dict[str, Any] = {}
        self.started = self.printed_at = time.monotonic()
        self.printed_n = initial

    def update(self, n: int = 1) -> None:
        self.n += n  # printed with the values of the step, which `set_postfix` brings next

    def set_postfix(self, **values: Any) -> None:
        self.postfix = {k: v for k, v in values.items() if v is not None}
        self._maybe_print()

    def write(self, line: str) -> None:
        print(plain(line), file=self.file or sys.stderr, flush=True)

    def close(self) -> None:
        if self.show and self.n != self.printed_n:
            self._print()

    def _maybe_print(self) -> None:
        if not self.show:
            return
        step = max(self.total // self.parts, 1)
        if self.n // step > self.printed_n // step or time.monotonic() - self.printed_at >= self.every_s:
            self._print()

    def _print(self) -> None:
        elapsed = int(time.monotonic() - self.started)
        share = f" ({100 * self.n // self.total}%)" if self.total else ""
        fields = "".join(f", {k}={v}" for k, v in self.postfix.items())
        self.write(f"{self.desc}: {self.unit} {self.n}/{self.total}{share}{fields}, {elapsed // 60}m{elapsed % 60:02d}s")
        self.printed_at, self.printed_n = time.monotonic(), self.n
