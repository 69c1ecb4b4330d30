"""Published measurements bundled as data (perfmodel/data/seed_measurements.csv)."""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

SEED_CSV = Path(__file__).parents[1] / "data" / "seed_measurements.csv"


@dataclass(frozen=True)
class Measurement:
    platform: str
    hardware: str
    engine: str
    devices: int
    tp: int
    ep: int
    batch: int
    draft_rows: int
    acceptance_length: float | None
    tokens_per_s: float
    source: str
    steps_per_call: int = 1  # decode steps per device call in the measured run
    serving_engine: str = ""  # the GPU serving engine whose kernels ran ("": the generic engine)
    kv_cache: str = ""        # the KV cache format the run used ("": the model preset's)

    @property
    def spec_decode(self) -> bool:
        return self.draft_rows > 0


def seed_measurements() -> list[Measurement]:
    lines = [l for l in SEED_CSV.read_text().splitlines() if not l.startswith("#")]
    out = []
    for r in csv.DictReader(lines):
        out.append(Measurement(r["platform"], r["hardware"], r["engine"], int(r["devices"]), int(r["tp"]),
                               int(r["ep"]), int(r["batch"]), int(r["draft_rows"]),
                               float(r["acceptance_length"]) if r["acceptance_length"] else None,
                               float(r["tokens_per_s"]), r["source"], int(r.get("steps_per_call") or 1),
                               r.get("serving_engine") or "", r.get("kv_cache") or ""))
    return out
