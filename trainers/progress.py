"""Progress of a run on the console: a tqdm bar on a terminal; elsewhere (a job log, `nohup`, CI), where a
bar's carriage returns and ANSI codes would be hundreds of lines of escapes, `LineProgress`: the same calls,
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


def progress_bar(total: int, desc: str, initial: int = 0, file: TextIO | None = None):
    """A tqdm bar on a terminal, else a `LineProgress` (both: `n`, `update`, `set_postfix`, `write`, `close`)."""
    if is_terminal(file):
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, file=file)
    return LineProgress(total, desc, initial, file)


class LineProgress:
    """tqdm's calls, printed as plain lines: `desc: step 120/600 (20%), loss=3.412, tok_s=3708, 2m05s`."""

    def __init__(self, total: int, desc: str, initial: int = 0, file: TextIO | None = None,
                 show: bool = True):
        """`show=False`: no progress lines, only what `write` is given (a run's events)."""
        self.total, self.desc, self.n, self.file, self.show = total, desc, initial, file, show
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
        step = max(self.total // 10, 1)
        if self.n // step > self.printed_n // step or time.monotonic() - self.printed_at >= 60:
            self._print()

    def _print(self) -> None:
        elapsed = int(time.monotonic() - self.started)
        share = f" ({100 * self.n // self.total}%)" if self.total else ""
        fields = "".join(f", {k}={v}" for k, v in self.postfix.items())
        self.write(f"{self.desc}: step {self.n}/{self.total}{share}{fields}, {elapsed // 60}m{elapsed % 60:02d}s")
        self.printed_at, self.printed_n = time.monotonic(), self.n
