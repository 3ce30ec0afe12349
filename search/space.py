"""Search spaces from the experiment YAML, and PBT's explore step that keeps every value inside them.

A space maps a dotted run-config key to one parameter:

    optimizer.lr: {loguniform: [1.0e-4, 1.0e-2]}     # continuous, sampled and perturbed in log space
    optimizer.weight_decay: {uniform: [0.0, 0.2]}
    train.micro_batch_size: {int: [2, 8]}              # integers, both ends included (logint: log scale)
    schedule.name: [warmup_cosine, warmup_linear]      # categorical (also {choice: [...]}): moves to neighbours
    optimizer.grad_clip: 1.0                           # fixed value

Ray's own explore multiplies every value by 0.8/1.2 without looking at its bounds (ray #5035) and treats
`tune.choice` as continuous; `explore` here is the pure function the schedulers call instead, by the
rules of `EXPLORE_RULES` (also in `raytrain tune --help`). PB2 searches the space's *search scale*
(`SearchSpace.to_search`/`from_search`: the log of a log range), since Ray's PB2 normalises its bounds
linearly.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainers._base import ConfigError

__all__ = [
    "DISTRIBUTIONS",
    "EXPLORE_RULES",
    "Choice",
    "Fixed",
    "IntRange",
    "Param",
    "Range",
    "SearchSpace",
    "parse_space",
]

EXPLORE_RULES = """\
PBT's explore, at each exploit, from the donor's values (search/space.py):
  loguniform, logint  multiplied by one of scheduler.perturbation_factors (default 2 and 0.5)
  uniform, int        shifted up or down by scheduler.linear_step x the range's width (default 0.15;
                      an int by at least 1)
  a list              moved to a neighbour in the list
  any of them         drawn afresh from its distribution instead, with scheduler.resample_probability
                      (default 0.25)
A move past a bound is reflected back inside, so a value at a bound moves inward, never stays there; a
recipient never gets the configuration another member holds (drawn again)."""


FACTORS = (2.0, 0.5)  # log ranges: multiplied by one (scheduler.perturbation_factors' default)
LINEAR_STEP = 0.15  # linear ranges: moved by this x their width (scheduler.linear_step's default)


def _reflect(x: float, low: float, high: float) -> float:
    """`x` folded back into [low, high] at the bound it passed (a move of more than the width ends at
    the far bound)."""
    if x > high:
        x = 2 * high - x
    elif x < low:
        x = 2 * low - x
    return min(max(x, low), high)


@dataclass(frozen=True)
class Range:
    """A float in [low, high], uniform or log-uniform."""

    low: float
    high: float
    log: bool = False

    def sample(self, rng: random.Random) -> float:
        if self.log:
            return math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        return rng.uniform(self.low, self.high)

    def perturb(
        self, value: float, rng: random.Random, factors: tuple[float, ...], step: float
    ) -> tuple[float, str]:
        if self.log:
            factor = rng.choice(factors)
            lo, hi = self.search_bounds
            x = _reflect(math.log(max(float(value), self.low)) + math.log(factor), lo, hi)
            return self.clip(math.exp(x)), f"* {factor}"
        shift = rng.choice((1, -1)) * step * (self.high - self.low)
        return _reflect(float(value) + shift, self.low, self.high), f"{shift:+.4g}"

    def clip(self, value: float) -> float:
        return min(max(value, self.low), self.high)

    @property
    def bounds(self) -> tuple[float, float]:
        return (self.low, self.high)

    @property
    def search_bounds(self) -> tuple[float, float]:
        """The bounds on the search scale: the log of a log range's."""
        return (math.log(self.low), math.log(self.high)) if self.log else self.bounds

    def to_search(self, value: float) -> float:
        return math.log(value) if self.log else float(value)

    def from_search(self, x: float) -> float:
        return self.clip(math.exp(x) if self.log else x)


@dataclass(frozen=True)
class IntRange:
    """An integer in [low, high] (both included), uniform or log-uniform."""

    low: int
    high: int
    log: bool = False

    def sample(self, rng: random.Random) -> int:
        if not self.log:
            return rng.randint(self.low, self.high)
        # log-uniform over [low, high + 1) floored: each integer gets its share of the log range
        x = math.exp(rng.uniform(math.log(self.low), math.log(self.high + 1)))
        return self.clip(math.floor(x))

    def perturb(self, value: int, rng: random.Random, factors: tuple[float, ...], step: float) -> tuple[int, str]:
        value = int(value)
        if self.log:  # reflected in log space: 64 x 2 in [1, 64] is 32, not the far bound
            factor = rng.choice(factors)
            lo, hi = math.log(self.low), math.log(self.high)
            new = round(math.exp(_reflect(math.log(value) + math.log(factor), lo, hi)))
            if new == value and factor != 1:  # rounding would never move a small integer
                new = value + (1 if factor > 1 else -1)
        else:
            new = value + rng.choice((1, -1)) * max(1, round(step * (self.high - self.low)))
        new = int(_reflect(new, self.low, self.high))
        return new, f"{new - value:+d}"

    def clip(self, value: float) -> int:
        return int(min(max(round(value), self.low), self.high))

    @property
    def bounds(self) -> tuple[float, float]:
        return (float(self.low), float(self.high))

    @property
    def search_bounds(self) -> tuple[float, float]:
        """The bounds on the search scale: the log of [low, high + 1) for a log range (as `sample` draws)."""
        return (math.log(self.low), math.log(self.high + 1)) if self.log else self.bounds

    def to_search(self, value: int) -> float:
        return math.log(value + 0.5) if self.log else float(value)

    def from_search(self, x: float) -> int:
        return self.clip(math.floor(math.exp(x)) if self.log else x)


@dataclass(frozen=True)
class Choice:
    """One of a list of values; perturbation moves to a neighbour in the list (the order is meaningful)."""

    values: tuple[Any, ...]

    def sample(self, rng: random.Random) -> Any:
        return rng.choice(self.values)

    def perturb(self, value: Any, rng: random.Random, factors: tuple[float, ...], step: float) -> tuple[Any, str]:
        if value not in self.values:
            return self.sample(rng), "resample"
        i = self.values.index(value)
        if len(self.values) == 1:
            return value, "fixed"
        step = rng.choice((-1, 1))
        if not 0 <= i + step < len(self.values):  # at an end: the only neighbour
            step = -step
        return self.values[i + step], "shift left" if step < 0 else "shift right"


@dataclass(frozen=True)
class Fixed:
    value: Any

    def sample(self, rng: random.Random) -> Any:
        return self.value


Param = Range | IntRange | Choice | Fixed
_MUTABLE = (Range, IntRange, Choice)


class SearchSpace(Mapping):
    """Dotted run-config key -> parameter. Pure: every random choice comes from the `rng` passed in."""

    def __init__(self, params: dict[str, Param]):
        self.params = dict(params)

    def __getitem__(self, key: str) -> Param:
        return self.params[key]

    def __iter__(self):
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)

    @property
    def mutable(self) -> dict[str, Param]:
        return {k: p for k, p in self.params.items() if isinstance(p, _MUTABLE)}

    def sample(self, rng: random.Random) -> dict[str, Any]:
        return {key: p.sample(rng) for key, p in self.params.items()}

    def explore(
        self,
        config: Mapping[str, Any],
        rng: random.Random,
        resample_probability: float = 0.25,
        factors: tuple[float, ...] = FACTORS,
        step: float = LINEAR_STEP,
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """PBT's explore step on the donor's `config`, by `EXPLORE_RULES`: each mutable key is resampled with
        `resample_probability`, else perturbed (log ranges by one of `factors`, linear ones by `step` x their
        width, reflected at a bound; lists to a neighbour). Returns (new config, key -> operation)."""
        new, ops = dict(config), {}
        for key, p in self.mutable.items():
            if key not in config or rng.random() < resample_probability:
                new[key], ops[key] = p.sample(rng), "resample"
            else:
                new[key], ops[key] = p.perturb(config[key], rng, factors, step)
        return new, ops

    def contains(self, key: str, value: Any) -> bool:
        p = self.params[key]
        if isinstance(p, Range):
            return p.low <= value <= p.high
        if isinstance(p, IntRange):
            return isinstance(value, int) and p.low <= value <= p.high
        if isinstance(p, Choice):
            return value in p.values
        return value == p.value

    def coerce(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """Integers for int ranges and values clipped into ranges (PB2 proposes floats in its boxes)."""
        out = dict(config)
        for key, value in config.items():
            p = self.params.get(key)
            if isinstance(p, (Range, IntRange)) and isinstance(value, (int, float)):
                out[key] = p.clip(value)
        return out

    def search_bounds(self) -> dict[str, tuple[float, float]]:
        """Continuous bounds of every mutable range on the search scale (the box PB2 searches: the log of a
        log range's bounds)."""
        return {k: p.search_bounds for k, p in self.mutable.items() if isinstance(p, (Range, IntRange))}

    def to_search(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """A config with its ranges' values on the search scale (floats); other keys as they are."""
        return {k: self._range(k).to_search(v) if self._range(k) else v for k, v in config.items()}

    def from_search(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """`to_search` undone: values on the search scale back to the ranges' own (clipped, ints rounded)."""
        return {k: self._range(k).from_search(v) if self._range(k) else v for k, v in config.items()}

    def _range(self, key: str) -> Range | IntRange | None:
        p = self.params.get(key)
        return p if isinstance(p, (Range, IntRange)) else None


# ------------------------------------------------------------------------------------------- parsing

DISTRIBUTIONS = ("uniform", "loguniform", "int", "logint", "choice")


def parse_space(raw: Mapping[str, Any], where: str = "space") -> SearchSpace:
    if not isinstance(raw, Mapping) or not raw:
        raise ConfigError(
            f"{where} must map run-config keys to ranges; fix: e.g. optimizer.lr: {{loguniform: [1e-4, 1e-2]}}"
        )
    return SearchSpace({str(k): parse_param(f"{where}.{k}", v) for k, v in raw.items()})


def parse_param(where: str, raw: Any) -> Param:
    if isinstance(raw, list):
        return _choice(where, raw)
    if not isinstance(raw, Mapping):
        return Fixed(raw)
    if len(raw) != 1 or next(iter(raw)) not in DISTRIBUTIONS:
        keys = ", ".join(map(str, raw)) or "nothing"
        raise ConfigError(
            f"{where}: unknown distribution ({keys}); fix: use one of {{{', '.join(DISTRIBUTIONS)}}}: [...], "
            f"a list of choices, or a fixed value"
        )
    kind, args = next(iter(raw.items()))
    if kind == "choice":
        return _choice(where, args)
    low, high = _pair(where, kind, args)
    log = kind in ("loguniform", "logint")
    if log and low <= 0:
        raise ConfigError(f"{where}: {kind} needs low > 0 (got {low}); fix: use uniform or a positive low")
    if kind in ("int", "logint"):
        if low != int(low) or high != int(high):
            raise ConfigError(f"{where}: {kind} bounds must be integers (got [{low}, {high}]); {_fix(kind)}")
        return IntRange(int(low), int(high), log)
    return Range(low, high, log)


def _pair(where: str, kind: str, args: Any) -> tuple[float, float]:
    fix = _fix(kind)
    if not isinstance(args, (list, tuple)) or len(args) != 2:
        raise ConfigError(f"{where}: {kind} takes [low, high] (got {args!r}); {fix}")
    try:
        # PyYAML reads `1e-4` (no dot) as a string: accept it
        low, high = (float(a) for a in args)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {kind} bounds {args!r} are not numbers; {fix}") from None
    if not (math.isfinite(low) and math.isfinite(high)) or low >= high:
        raise ConfigError(f"{where}: {kind} bounds [{low}, {high}] are not low < high; {fix}")
    return low, high


def _fix(kind: str) -> str:
    return f"fix: {kind}: [low, high] with low < high" + (" (integers)" if "int" in kind else "")


def _choice(where: str, values: Any) -> Choice:
    if not isinstance(values, list) or not values:
        raise ConfigError(f"{where}: a categorical parameter needs a non-empty list; fix: e.g. [a, b, c]")
    if len({repr(v) for v in values}) != len(values):
        raise ConfigError(f"{where}: the list {values} repeats a value; fix: list each choice once")
    return Choice(tuple(values))
