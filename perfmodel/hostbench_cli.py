"""`perfmodel hostbench`: the CLI entry of perfmodel_jax.hostbench (JAX side), which it imports
only when run; without JAX it prints a one-line hint."""
from __future__ import annotations

import importlib.util

DEFAULT_OUT = "out/host-cpu.toml"  # not a committed file


def run(a) -> dict:
    if importlib.util.find_spec("jax") is None:
        print("perfmodel hostbench: needs JAX (pip install -e '.[jax]'); nothing measured")
        return {"error": "jax not installed"}
    from perfmodel_jax.hostbench import cmd_hostbench
    return cmd_hostbench(a)


def add_parser(sub) -> None:
    p = sub.add_parser("hostbench", help="measure this machine and write a CPU hardware file (needs JAX)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"hardware file to write (default {DEFAULT_OUT})")
    p.add_argument("--name", default="host-cpu", help="the hardware name in the file")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke test, not a measurement)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
