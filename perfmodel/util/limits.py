"""Limits on the work one command does, checked before the work starts.

Every size a user controls (batch lists, prompts and their chunks, requests, tokens, grid points,
plan copies, trace rows, profile groups) sets how much a command computes. A command first
estimates the work its input asks for and refuses an input over a limit with one line naming the
field, its value, the work and the limit; what it accepts it then does, showing progress on a
terminal when it is long, and a Ctrl-C ends it cleanly (perfmodel.util.interrupts).

Work is counted in two units, by the code that does it (`spend`):
- layer steps: one decoder layer (or the embedding / head) of one simulated step timeline, on
  any engine: a Kimi K3 step (93 layers + 2) is 95 layer steps, about 5-10 ms on one core;
- serving steps: one scheduler step of the serving simulator, about 50-150 us.
A command's estimate is an upper bound of what it then spends where the work is known ahead
(predict, explain, a kernel plan, a sweep's points); the serving simulator's steps depend on the
traffic, so it is estimated before (`perfmodel.serve.simulate.estimate_steps`) and held to the
limit while it runs. tests/test_limits.py checks that accepted inputs spend no more than
their limits allow.
"""
from __future__ import annotations

import contextlib
import sys

from perfmodel.util import interrupts
from perfmodel.util.errors import SpecError

MAX_LAYER_STEPS = 250_000       # one command: Kimi K3 about 2,600 step timelines (about 20 s), a 4-layer model 50,000
MAX_SERVE_STEPS = 400_000       # one serving simulation (about 30-60 s)
MAX_SWEEP_SERVE_STEPS = 20_000_000  # a sweep's serving points together (minutes; a progress bar and workers)
MAX_REQUESTS = 1_000_000        # requests one serving simulation replays (and trace rows)
MAX_TOKENS = 2**24              # one request's prompt or output
MAX_SIM_SECONDS = 1e8           # a serving simulation's clock (3 years): arrivals beyond it lose the step's precision
MAX_PLANS = 64                  # --kernel-plan files in one command
MAX_PLAN_COPIES = 100_000       # copies in one kernel plan file
MAX_PROFILE_KERNELS = 16        # kernels in one phase profile
MAX_PROFILE_GROUPS = 64         # groups of timed steps in one phase profile
MAX_PROFILE_SETTINGS = 16       # distinct [megakernel] settings of one profile kernel's rows
PROGRESS_AFTER = 200            # step timelines from which a command shows a progress bar (on a terminal)

SPENT: dict[str, int] = {"layer_steps": 0, "serve_steps": 0}  # this process, since `reset`


def refuse(field: str, value, work: str, amount: float, limit: float, unit: str, hint: str = "") -> None:
    """SpecError naming `field` and `value` when `amount` (of `unit`, what `work` describes) is
    over `limit`."""
    if amount > limit:
        raise SpecError(field, value, f"{work} = {amount:,.0f} {unit}, over the limit of {limit:,.0f}"
                        + (f"; {hint}" if hint else ""))


def check_layer_steps(field: str, value, timelines: float, layers: int, what: str, hint: str = "") -> None:
    """Refuse `timelines` step timelines of a `layers`-layer graph over MAX_LAYER_STEPS."""
    refuse(field, value, f"{what}: {timelines:,.0f} step timelines x {layers} layers", timelines * layers,
           MAX_LAYER_STEPS, "layer steps", hint)


def spend(unit: str, n: int = 1) -> None:
    """Count `n` units of work done (tests read SPENT); a signal recorded where it could not
    unwind the command is raised here (perfmodel.util.interrupts.checkpoint)."""
    SPENT[unit] += n
    interrupts.checkpoint()


def reset() -> dict[str, int]:
    """Zero the counters; returns what they held."""
    out = dict(SPENT)
    for k in SPENT:
        SPENT[k] = 0
    return out


@contextlib.contextmanager
def progress(total: int, desc: str, unit: str = "step", show: bool | None = None):
    """A progress bar on stderr for `total` items of long work (shown on a terminal, from
    PROGRESS_AFTER items, unless `show` says otherwise); yields its `update`."""
    if show is False or (show is None and total < PROGRESS_AFTER):
        yield lambda n=1: None
        return
    from tqdm import tqdm

    class Bar(tqdm):
        monitor_interval = 0  # no monitor thread: the local sweep executor may fork this process
    with Bar(total=total, unit=unit, desc=desc, file=sys.stderr, disable=None if show is None else not show,
             mininterval=0.5) as bar:
        yield bar.update
