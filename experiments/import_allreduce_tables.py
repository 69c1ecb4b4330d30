"""Write the GPU all-reduce micro-benchmarks measured inside CUDA graphs into gpu.json.

NVIDIA's aiconfigurator-core wheel (PyPI, Apache-2.0) ships per-GPU kernel tables measured with
vLLM, SGLang and TensorRT-LLM. This script reads its vLLM 0.24.0 custom all-reduce table (CUDA
graph backend, bf16) for H100 and H200 at 2, 4 and 8 GPUs and the decode range of payloads, and
replaces the `<gpu>-vllm-graph-ar-*` entries of perfmodel/data/microbench/gpu.json with them
(message sizes in the table count bf16 values). Then refit with
`perfmodel calibrate --microbench gpu.json --hardware h100 --out perfmodel/presets/hardware/h100.toml`.

    pip download --no-deps aiconfigurator-core==0.12.0 -d /tmp/aic
    python experiments/import_allreduce_tables.py /tmp/aic/aiconfigurator_core-0.12.0-*.whl
"""
from __future__ import annotations

import argparse
import io
import json
import zipfile
from pathlib import Path

import pandas as pd

from perfmodel.util.files import write_atomic

GPU_JSON = Path(__file__).resolve().parent.parent / "perfmodel" / "data" / "microbench" / "gpu.json"
SYSTEMS = {"h100": "h100_sxm", "h200": "h200_sxm"}
VALUES = (1024, 4096, 16384, 65536, 262144)  # bf16 values per all-reduce: 2 KiB .. 512 KiB
TABLE = "aiconfigurator_core/systems/data/{}/comm/vllm/0.24.0/custom_allreduce_perf.parquet"


def entries(wheel: zipfile.ZipFile, version: str) -> list[dict]:
    out = []
    for platform, system in SYSTEMS.items():
        path = TABLE.format(system)
        if path not in wheel.namelist():
            raise SystemExit(f"wheel: {wheel.filename} has no {path} (an aiconfigurator-core wheel with vLLM 0.24.0 tables)")
        d = pd.read_parquet(io.BytesIO(wheel.read(path)))
        d = d[(d.backend == "vllm_graph") & (d.allreduce_dtype == "bfloat16")]
        for (ranks, values), row in d.set_index(["num_gpus", "message_size"]).sort_index().iterrows():
            if values in VALUES:
                out.append({"id": f"{platform}-vllm-graph-ar-{ranks}gpu-{2 * values // 1024}k", "platform": platform,
                            "mechanism": "gpu_all_reduce", "inputs": {"ranks": int(ranks), "bytes": int(2 * values)},
                            "value": round(float(row.latency) * 1e3, 3), "unit": "us_per_collective",
                            "scope": f"vLLM 0.24.0 custom all-reduce inside a CUDA graph, {ranks} x {system}, "
                                     f"{values} bf16 values",
                            "source": f"NVIDIA aiconfigurator-core {version} (PyPI, Apache-2.0): {path}, "
                                      "backend vllm_graph"})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheel", help="the downloaded aiconfigurator_core wheel")
    a = ap.parse_args()
    if not zipfile.is_zipfile(a.wheel):
        raise SystemExit(f"wheel: {a.wheel!r} is not a wheel (zip) file")
    version = Path(a.wheel).name.split("-")[1] if "-" in Path(a.wheel).name else "unknown"
    with zipfile.ZipFile(a.wheel) as wheel:
        new = entries(wheel, version)
    data = json.loads(GPU_JSON.read_text())
    data["entries"] = [e for e in data["entries"] if "-vllm-graph-ar-" not in e["id"]] + new
    write_atomic(GPU_JSON, json.dumps(data, indent=1) + "\n")
    print(f"wrote {len(new)} entries to {GPU_JSON}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
