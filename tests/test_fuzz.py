"""Fuzz the CLI contract: any argv and any model / hardware / config / micro-benchmark / design /
trace / phase-profile / kernel-plan / serving-trace file content, any serving, prefill and
constraint options, any corruption of the bundled data (serving-engine inventories, kernel tables
and their fits), and any output path, either works (exit 0, and --json is plain JSON) or fails
with exit 2 and one line on stderr; an output is whole or absent, with no temporary beside it.
An exit 1 (internal error), a traceback, a hang (no answer within HANG_S) or any other exception
fails the test.

The work limits (perfmodel.util.limits) run scaled down by LIMIT_SCALE: the checks are the
same, and an accepted input then finishes well within HANG_S on a loaded 2-core machine
(tests/test_limits.py checks that accepted inputs spend within their limits, at any scale).

Profiles (PERFMODEL_FUZZ_PROFILE): `ci` (default: about 1,700 cases over the thirteen fuzz tests,
fixed seed) and `fuzz` (`make fuzz`: at least 12,000, random). The module prints how many cases ran.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import signal
import tomllib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from perfmodel.cli.main import main
from perfmodel.spec import arch

PRESETS = arch.PRESET_DIR.parent
PROFILE = os.environ.get("PERFMODEL_FUZZ_PROFILE", "ci")
SCALE = {"ci": 1, "fuzz": 10}[PROFILE]
CASES = {"argv": 400, "files": 300, "traces": 100, "microbench": 100, "designs": 100, "outputs": 60,
         "profiles": 60, "serve": 150, "prefill": 100, "plans": 100, "constraints": 60, "bundled": 120,
         "serve traces": 60}
# x SCALE: at most 1,710 / 17,100 in all; the sweep-output test has 240 distinct inputs, so under
# `fuzz` it runs out near 300 and the others carry the 12,000
LIMIT_SCALE = 10  # the work limits divided by this while fuzzing (module doc)


def fuzz(test: str):
    return settings(max_examples=CASES[test] * SCALE, deadline=None, derandomize=PROFILE == "ci",
                    suppress_health_check=list(HealthCheck), database=None)


HANG_S = 30
COUNTS: dict[str, int] = {}


@pytest.fixture(autouse=True)
def scaled_limits(monkeypatch):
    from perfmodel.util import limits
    for k in ("MAX_LAYER_STEPS", "MAX_SERVE_STEPS", "MAX_SWEEP_SERVE_STEPS"):
        monkeypatch.setattr(limits, k, getattr(limits, k) // LIMIT_SCALE)


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()

    def hang(*_):
        raise TimeoutError(f"no answer within {HANG_S} s: {argv!r}")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(HANG_S)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return rc, out.getvalue(), err.getvalue()


def _no_constant(name):
    raise AssertionError(f"{name} in JSON output")


def check_contract(argv: list[str]) -> int:
    """Run `argv` and assert the contract (module docstring); returns the exit status."""
    rc, out, err = run(argv)
    assert rc in (0, 2), f"exit {rc} for {argv!r}: {err.strip()}"
    if rc == 2:
        lines = err.strip("\n").split("\n")
        assert len(lines) == 1 and lines[0].startswith("perfmodel"), f"{argv!r}: {err!r}"
        assert all(c.isprintable() for c in lines[0]), f"control characters in {lines[0]!r}"
    elif "--json" in argv and not out.startswith("usage:"):  # --help wins
        json.loads(out, parse_constant=_no_constant)
    return rc


COUNTS_FILE: list[Path] = []


def count(test: str) -> None:
    COUNTS[test] = COUNTS.get(test, 0) + 1
    if COUNTS_FILE and sum(COUNTS.values()) % 100 == 0:  # kept current: a worker's last teardown may not run
        _write_counts()


def _write_counts() -> None:
    COUNTS_FILE[0].parent.mkdir(parents=True, exist_ok=True)
    COUNTS_FILE[0].write_text(json.dumps(COUNTS))


@pytest.fixture(scope="module", autouse=True)
def record_counts(request):
    """Each process's case counts go to a file; conftest's terminal summary adds them up."""
    COUNTS_FILE[:] = [request.config.rootpath / "test-output" / "fuzz-counts" / f"{os.getpid()}.json"]
    yield
    _write_counts()


# ----- values -----------------------------------------------------------------------------------

EDGE_TEXT = ["", ",", ",,", " ", "-0", "0", "1", "2", "8", "-1", "nan", "-nan", "inf", "-inf",
             "1e400", "1e-400", "9" * 30, "0x10", "1,", ",1", "1,,2", "1.5", "true", "..", ".",
             "/", "/dev/full", "/dev/null", "/nonexistent/dir/x.json", "a" * 300, "x/" * 2100,
             "\x00", "\x1b[31m", "\n", "é", "\udcff", "kimi-k3", "tpu-v7", "\u2028"]
text_values = st.one_of(st.sampled_from(EDGE_TEXT), st.text(max_size=12),
                        st.integers(-2**70, 2**70).map(str),
                        st.floats(allow_nan=True, allow_infinity=True).map(repr),
                        st.lists(st.integers(-3, 70).map(str), min_size=0, max_size=4).map(",".join))
toml_scalars = st.one_of(st.integers(-2**70, 2**70), st.sampled_from([0, 1, -1, 2**53 + 1, 10**30]),
                         st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                         st.text(max_size=8), st.sampled_from(["bf16", "fp8", "mxfp4", "kda", "mla", "gqa"]))
toml_values = st.recursive(toml_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(["a", "heads", "default", "x"]),
                                                 inner, max_size=3)), max_leaves=8)


# ----- argv ---------------------------------------------------------------------------------------

MODELS = ["kimi-k3-mini", "llama-3.2-1b", "kimi-k3-host-small", "kimi-linear-48b", "nope"]
HARDWARE = ["tpu-v7", "gb200", "h100", "tpu-v6e", "nope"]
DEPLOY_OPTS = {"--model": st.sampled_from(MODELS) | text_values,
               "--hardware": st.sampled_from(HARDWARE) | text_values,
               "--devices": st.sampled_from(["1", "2", "4", "8", "16", "32"]) | text_values,
               "--tp": st.sampled_from(["1", "2", "4"]) | text_values,
               "--ep": st.sampled_from(["1", "2", "4", "8"]) | text_values,
               "--engine": st.sampled_from(["megakernel", "multikernel"]) | text_values,
               "--context": st.sampled_from(["0", "64", "4096"]) | text_values,
               "--prefetch-mib": st.sampled_from(["1", "8", "16"]) | text_values,
               "--expert-slots": st.sampled_from(["1", "4", "16"]) | text_values,
               "--vmem-mib": st.sampled_from(["1", "16", "64"]) | text_values,
               "--routing-skew": st.sampled_from(["0", "0.7"]) | text_values,
               "--draft-rows": st.sampled_from(["0", "3", "7"]) | text_values,
               "--acceptance-length": st.sampled_from(["1", "2", "6"]) | text_values,
               "--acceptance-prob": st.sampled_from(["0", "0.5"]) | text_values,
               "--draft-cost": st.sampled_from(["0", "0.05"]) | text_values}
AXES = ["batch", "context", "prefetch_mib", "expert_slots", "routing_skew", "vmem_mib", "hbm_gbps",
        "link_latency_us", "engine", "dma_sharing", "nope", ""]
EXTRA = {"predict": {"--batch": st.sampled_from(["1", "1,2", "8"]) | text_values},
         "sweep": {"--vary": st.tuples(st.sampled_from(AXES), text_values).map("=".join)},
         "trace": {"--batch": st.sampled_from(["1", "2"]) | text_values, "--out": text_values},
         "serve": {"--rate": st.sampled_from(["1", "50"]) | text_values, "--requests": st.sampled_from(["5", "30"])
                   | text_values, "--concurrency": st.sampled_from(["1", "8"]) | text_values,
                   "--input-len": st.sampled_from(["16", "4:64"]) | text_values,
                   "--output-len": st.sampled_from(["4", "1:9"]) | text_values},
         "explain": {"--layer": st.sampled_from(["0", "1", "5", "999"]) | text_values,
                     "--op": st.sampled_from(["routed_experts", "nope"]) | text_values,
                     "--profile": st.sampled_from(["musespark", "nope", "x.json"]) | text_values,
                     "--batch": st.sampled_from(["1", "8"]) | text_values}}


@st.composite
def argvs(draw, tmp: Path):
    cmd = draw(st.sampled_from(["predict", "sweep", "trace", "list", "reproduce", "validate",
                                "capture", "hostbench", "nope", "serve", "explain"]))
    argv = [cmd]
    opts = {**DEPLOY_OPTS, **EXTRA.get(cmd, {})} if cmd in EXTRA else {}
    if cmd in ("predict", "serve", "explain"):
        argv += ["--model", "kimi-k3-mini", "--devices", "1"]  # small unless the draw says else
    if cmd == "serve":
        argv += ["--no-progress"]
    for name in draw(st.lists(st.sampled_from(sorted(opts)), max_size=5, unique=True)) if opts else []:
        argv += [name, draw(opts[name])]
    if cmd == "sweep":
        argv += ["--vary", draw(EXTRA["sweep"]["--vary"])]
    if cmd == "trace" and "--out" not in argv:
        argv += ["--out", str(tmp / "t.json")]
    if cmd in ("reproduce", "capture", "hostbench", "validate", "list", "nope"):
        # only what fails before any long run: bad options and bad targets
        argv += draw(st.lists(text_values | st.sampled_from(
            ["--write", "--out", "--batch", "--trace", "--modes", "--steps", "--repeats", "--help"]),
            min_size=1 if cmd not in ("list", "nope") else 0, max_size=4))
    if draw(st.booleans()):
        argv.append("--json")
    return argv


def _slow_run(argv: list[str]) -> bool:
    """Commands that would really measure, capture or fit (tens of seconds): not fuzzed."""
    cmd = argv[0]
    if cmd == "reproduce":
        return "--help" not in argv and not any(a.startswith("-") and a not in
                                                ("--json", "--no-fit", "--write", "--help") for a in argv[1:])
    return cmd in ("capture", "hostbench") and "--help" not in argv


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """Run in a temporary directory; files the CLI writes elsewhere are not written, and a fit
    that slips through `_slow_run` returns the physical defaults at once."""
    from perfmodel.cli import fit as cli_fit, predict as cli_predict
    from perfmodel.fit import seed as calibrate
    from perfmodel.util.files import check_path, write_atomic as real_write

    inside = lambda path: Path(path).resolve().is_relative_to(tmp_path.resolve())

    def write_inside(path, *args, **kw):
        check_path(kw.get("field", "--out"), path)  # as the real one does, before resolving it
        return real_write(path, *args, **kw) if inside(path) else Path(path)

    monkeypatch.chdir(tmp_path)
    for cli in (cli_predict, cli_fit):  # the commands that write files
        monkeypatch.setattr(cli, "write_atomic", write_inside)
    monkeypatch.setattr(calibrate, "fit", lambda ms, hw: {
        p.key: 0.0 if p.name == "routing_skew" else 1.0 for p in calibrate.fit_params(sorted(hw))})
    return tmp_path


def test_nul_output_path_in_the_sandbox(sandbox):
    """Found by `make fuzz`: the sandbox's own write guard resolved the path before the CLI's
    check and raised ValueError on a NUL; the CLI refuses it with exit 2."""
    assert check_contract(["trace", "--out", "\x00"]) == 2


@fuzz("argv")
@given(data=st.data())
def test_fuzz_argv(data, sandbox):
    argv = data.draw(argvs(sandbox))
    if _slow_run(argv):
        argv = argv + ["--no-such-option"]
    check_contract(argv)
    count("argv")


# ----- file contents ------------------------------------------------------------------------------

def toml_text(data: dict) -> str:
    """A small TOML writer (top-level scalars, then tables; deeper values inline)."""
    def val(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, float):
            return {"nan": "nan", "inf": "inf", "-inf": "-inf"}.get(repr(v), repr(v))
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{json.dumps(k)} = {val(x)}" for k, x in v.items()) + "}"
        return str(v)
    top = [f"{json.dumps(k)} = {val(v)}" for k, v in data.items() if not isinstance(v, dict)]
    tables = [f"[{json.dumps(k)}]\n" + "\n".join(f"{json.dumps(a)} = {val(b)}" for a, b in v.items())
              for k, v in data.items() if isinstance(v, dict)]
    return "\n".join(top + tables) + "\n"


def mutate(data: dict, draw) -> dict:
    """`data` with a few fields replaced, deleted or added, at any depth."""
    data = json.loads(json.dumps(data))
    for _ in range(draw(st.integers(1, 3))):
        d = data
        while isinstance(d, dict) and d and draw(st.booleans()):
            k = draw(st.sampled_from(sorted(d)))
            if not isinstance(d[k], dict):
                break
            d = d[k]
        if not isinstance(d, dict):
            continue
        key = draw(st.sampled_from(sorted(d) + ["base", "new_field", "layers", "sources"]))
        if draw(st.integers(0, 4)) == 0:
            d.pop(key, None)
        else:
            d[key] = draw(toml_values | st.sampled_from(["kimi-k3", "kimi-k3-mini", "nope"]))
    return data


def byte_noise(raw: bytes, draw) -> bytes:
    raw = bytearray(raw)
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, max(0, len(raw) - 1)))
        raw[i:i + draw(st.integers(0, 3))] = draw(st.binary(min_size=1, max_size=4))
    return bytes(raw)


MODEL_SRC = tomllib.loads((PRESETS / "models" / "kimi-k3-host-small.toml").read_text()) | {
    # the newer sections, so mutations reach them
    "megakernel": {"shard_collective_rows": [1, 8]},
    "custom_formats": {"my4": {"value_bits": 4, "scale_dtype": "e8m0", "block": [1, 32], "compute_dtype": "fp4"}}}
HW_SRC = tomllib.loads((PRESETS / "hardware" / "tpu-v7.toml").read_text())
HF_SRC = {"num_hidden_layers": 4, "hidden_size": 256, "vocab_size": 1000, "num_attention_heads": 4,
          "kv_lora_rank": 64, "q_lora_rank": 96, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
          "v_head_dim": 32, "n_routed_experts": 16, "n_shared_experts": 1, "num_experts_per_tok": 2,
          "moe_intermediate_size": 64, "first_k_dense_replace": 1, "intermediate_size": 512,
          "quantization_config": {"quant_method": "fp8"}}


@st.composite
def file_content(draw, src: dict, as_json: bool) -> bytes:
    data = mutate(src, draw)
    raw = (json.dumps(data) if as_json else toml_text(data)).encode("utf-8", "surrogatepass")
    return byte_noise(raw, draw) if draw(st.integers(0, 3)) == 0 else raw


@fuzz("files")
@given(data=st.data())
def test_fuzz_model_and_hardware_files(data, tmp_path_factory):
    d = tmp_path_factory.mktemp("files", numbered=True)
    kind = data.draw(st.sampled_from(["model", "hardware", "hf"]))
    if kind == "hardware":
        f = d / "hw.toml"
        f.write_bytes(data.draw(file_content(HW_SRC, False)))
        argv = ["predict", "--model", "kimi-k3-mini", "--devices", "1", "--hardware", str(f)]
    else:
        f = d / ("config.json" if kind == "hf" else "m.toml")
        f.write_bytes(data.draw(file_content(HF_SRC if kind == "hf" else MODEL_SRC, kind == "hf")))
        argv = ["predict", "--model", str(f), "--devices", "1", "--hardware", "tpu-v7"]
    argv += data.draw(st.sampled_from([[], ["--engine", "multikernel"], ["--json"]]))
    check_contract(argv)
    count(f"{kind} files")


@pytest.fixture(scope="module")
def xspace(tmp_path_factory):
    """Bytes of a small valid TPU trace of kimi-k3-mini (tests/test_traces.py builds it)."""
    pytest.importorskip("jax")
    from test_traces import MINI_STEP, write_xspace, xspace_text
    f = write_xspace(tmp_path_factory.mktemp("x") / "t.xplane.pb", xspace_text([MINI_STEP] * 2, 30.0))
    return f.read_bytes()


HLO_SAMPLE = """HloModule jit_step
%fused (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %e = f32[4]{0} exponential(%p), metadata={op_name="jit(step)/layer_01/moe/exp"}
}
ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  ROOT %f = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused
}
"""
RECURSIVE_HLO = "".join(f"%c{i} (p: f32[]) -> f32[] {{\n  ROOT %r{i} = f32[] call(%p), to_apply=%c{i + 1}\n}}\n"
                        for i in range(5000)) + HLO_SAMPLE


@fuzz("traces")
@given(data=st.data())
def test_fuzz_trace_files(data, xspace, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run", numbered=True)
    raw = data.draw(st.one_of(st.binary(max_size=64), st.just(xspace).map(lambda b: b),
                              st.integers(0, len(xspace)).map(lambda n: xspace[:n])))
    if data.draw(st.booleans()):
        raw = byte_noise(raw or b"x", data.draw)
    (run_dir / "t.xplane.pb").write_bytes(raw)
    extra = data.draw(st.sampled_from(["", "", "dangling", "hlo", "recursive hlo"]))
    if extra == "dangling":
        (run_dir / "u.xplane.pb").symlink_to(run_dir / "gone.xplane.pb")
    elif extra:
        (run_dir / "hlo").mkdir()
        text = RECURSIVE_HLO if extra == "recursive hlo" else HLO_SAMPLE
        (run_dir / "hlo" / "module_0001.jit_step.cpu_after_optimizations.txt").write_bytes(
            byte_noise(text.encode(), data.draw) if data.draw(st.booleans()) else text.encode())
    meta = {"model": "kimi-k3-mini", "batch": 1, "context": 32, "mode": "megakernel",
            "host_step_s": [1e-4, 2e-4]}
    if data.draw(st.booleans()):
        meta = mutate(meta, data.draw)
        raw = json.dumps(meta).encode()
        (run_dir / "capture.json").write_bytes(byte_noise(raw, data.draw) if data.draw(st.integers(0, 3)) == 0
                                               else raw)
        argv = ["validate", "--trace", str(run_dir), "--hardware", "tpu-v7"]
    else:
        argv = ["validate", "--trace", str(run_dir / "t.xplane.pb"), "--model", "kimi-k3-mini",
                "--hardware", "tpu-v7", "--batch", "1", "--context", "32", "--mode", "megakernel"]
    check_contract(argv + data.draw(st.sampled_from([[], ["--json"]])))
    count("trace files")


# ----- micro-benchmark files, design files, sweep outputs ---------------------------------------

_MB = json.loads((PRESETS.parent / "data" / "microbench" / "tpu7x.json").read_text())
MB_SRC = {**{k: v for k, v in _MB.items() if k != "entries"},  # one entry per mechanism: quick fits
          "entries": list({e["mechanism"]: e for e in _MB["entries"]}.values())}


def mutated_json(draw, data: dict, pick, rounds: int, whole: int) -> bytes:
    """`data` with up to `rounds` tables that `pick(draw)` chooses mutated in place (None: none that
    round), the whole file one time in `whole + 1`, as JSON bytes, byte noise one time in 5."""
    for _ in range(draw(st.integers(0, rounds))):
        target = pick(draw)
        if target is not None:
            changed = mutate(target, draw)
            target.clear()
            target.update(changed)
    if draw(st.integers(0, whole)) == 0:
        data = mutate(data, draw)
    raw = json.dumps(data).encode("utf-8", "surrogatepass")
    return byte_noise(raw, draw) if draw(st.integers(0, 4)) == 0 else raw


@st.composite
def microbench_content(draw) -> bytes:
    data = json.loads(json.dumps(MB_SRC))

    def pick(draw):
        e = data["entries"][draw(st.integers(0, len(data["entries"]) - 1))]
        if not isinstance(e, dict):
            return None
        return e["inputs"] if isinstance(e.get("inputs"), dict) and e["inputs"] and draw(st.booleans()) else e
    return mutated_json(draw, data, pick, 3, 5)


@fuzz("microbench")
@given(data=st.data())
def test_fuzz_microbench_files(data, sandbox):
    f = sandbox / "mb.json"
    f.write_bytes(data.draw(microbench_content()))
    argv = ["calibrate", "--microbench", str(f)] + data.draw(st.sampled_from(
        [[], ["--hardware", "tpu-v7"], ["--json"], ["--out", str(sandbox / "hw.toml")]]))
    check_contract(argv)
    count("micro-benchmark files")


PROFILE_SRC = json.loads((PRESETS.parent / "data" / "phase_profiles" / "musespark.json").read_text())


@st.composite
def profile_content(draw) -> bytes:
    """The bundled phase profile with a phase row, a timed-steps group, the harness or the whole
    file mutated (the lists' entries too, which `mutate` does not enter)."""
    data = json.loads(json.dumps(PROFILE_SRC))
    targets = [r for k in data["kernels"].values() for r in k["phases"]] + data["harness"]["timed_steps"] + [
        data["harness"], data["harness"]["deployment"], data["stated"]]
    return mutated_json(draw, data, lambda draw: draw(st.sampled_from(targets)), 2, 4)


@fuzz("profiles")
@given(data=st.data())
def test_fuzz_phase_profile_files(data, sandbox):
    f = sandbox / "profile.json"
    f.write_bytes(data.draw(profile_content()))
    check_contract(["explain", "--profile", str(f)] + data.draw(st.sampled_from([[], ["--json"]])))
    count("phase profile files")


DESIGN_SRC = [{"base": {"model": "kimi-k3-mini", "devices": 1}, "grid": {"batch": [1, 2], "context": {
               "min": 0, "max": 64, "steps": 2}}},
              {"base": {"model": "kimi-k3-mini", "devices": 1}, "random": {"samples": 3, "seed": 1, "batch": {
               "min": 1, "max": 4}, "engine": ["megakernel", "multikernel"]}}]


@fuzz("designs")
@given(data=st.data())
def test_fuzz_design_files(data, sandbox):
    design = mutate(data.draw(st.sampled_from(DESIGN_SRC)), data.draw)
    raw = toml_text(design).encode("utf-8", "surrogatepass")
    f = sandbox / "d.toml"
    f.write_bytes(byte_noise(raw, data.draw) if data.draw(st.integers(0, 4)) == 0 else raw)
    check_contract(["sweep", "--design", str(f), "--no-progress", "--jobs", "1", "--top", "2"]
                   + data.draw(st.sampled_from([[], ["--json"], ["--out", "rows.csv"]])))
    count("design files")


def output_path(tmp: Path, kind: str) -> str:
    (tmp / "adir").mkdir(exist_ok=True)
    if kind == "dangling":
        with contextlib.suppress(FileExistsError):
            (tmp / "link.csv").symlink_to(tmp / "nowhere" / "x.csv")
        return str(tmp / "link.csv")
    if kind == "fifo":
        with contextlib.suppress(FileExistsError):
            os.mkfifo(tmp / "fifo.csv")
        return str(tmp / "fifo.csv")
    return {"csv": "rows.csv", "parquet": "rows.parquet", "dir": "adir", "dir/": "adir/", "missing": "no/x.csv",
            "full": "/dev/full", "proc": "/proc/rows.csv", "null": "/dev/null", "suffix": "rows.txt",
            "undecodable": "\udcff.csv", "long": "x" * 300 + ".csv", "nul": "a\0.csv", "empty": ""}[kind]


@fuzz("outputs")
@given(kind=st.sampled_from(["csv", "parquet", "dir", "dir/", "missing", "full", "proc", "null", "suffix",
                             "undecodable", "long", "nul", "empty", "dangling", "fifo"]),
       fsize=st.sampled_from([None, None, 0, 600, 4096]), old=st.booleans(), jobs=st.sampled_from(["1", "2"]))
def test_fuzz_sweep_outputs(kind, fsize, old, jobs, sandbox):
    """sweep --out anywhere, under a file-size limit (EFBIG) or not: exit 0 with the whole file or 2
    with one line, the old file (or none) kept, never a temporary."""
    out = output_path(sandbox, kind)
    if old and kind in ("csv", "parquet"):
        Path(out).write_text("old\n")
    before = sorted(p.name for p in sandbox.iterdir())
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if fsize is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, hard))
    try:
        rc = check_contract(["sweep", "--model", "kimi-k3-mini", "--devices", "1", "--vary", "batch=1,2,3",
                             "--no-progress", "--jobs", jobs, "--out", out])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    after = sorted(p.name for p in sandbox.iterdir())
    assert [n for n in after if n.endswith(".tmp")] == [], after
    if kind in ("csv", "parquet"):
        if rc == 0:
            assert Path(out).read_bytes() != b"old\n" and Path(out).stat().st_size > 0
        else:
            assert after == before and (not old or Path(out).read_text() == "old\n")
    count("sweep outputs")


# ----- serving, prefill, constraints, kernel plans, serving traces, bundled data -------------------

def mostly(*valid: str):
    """One of `valid` three times in four, else any text."""
    v = st.sampled_from(valid)
    return st.sampled_from((True, True, True, False)).flatmap(lambda ok: v if ok else text_values)


SERVE_OPTS = {"--requests": mostly("1", "7", "50", "400", "1000000", "1048576"),
              "--input-len": mostly("1", "8", "300", "8:64", "64:8", "16777216"),
              "--output-len": mostly("1", "2", "40", "1:30", "16777216"),
              "--max-batch": mostly("1", "8", "256"), "--max-tokens-per-step": mostly("1", "64", "8192"),
              "--prefill-chunk": mostly("1", "16", "512"), "--block-tokens": mostly("1", "16"),
              "--memory-utilization": mostly("0.5", "0.9", "1"), "--prefill-devices": mostly("1", "2"),
              "--prefill-tp": mostly("1", "2"), "--prefill-ep": mostly("1", "2"),
              "--prefill-engine": mostly("megakernel", "multikernel"), "--seed": mostly("0", "1"),
              "--context": st.sampled_from(["0", "64"]), "--steps-per-call": st.sampled_from(["1", "4"]),
              "--draft-rows": st.sampled_from(["0", "3"]), "--engine": st.sampled_from(["megakernel", "multikernel"])}
SERVE_MODELS = [["--model", "kimi-k3-mini", "--devices", "1"], ["--model", "llama-3.2-1b", "--hardware", "h100",
                                                                "--devices", "1"]]
TRAFFIC = st.one_of(st.tuples(st.just("--rate"), mostly("0.5", "5", "100", "1e-20", "5e-324", "1e9")),
                    st.tuples(st.just("--concurrency"), mostly("1", "4", "64")), st.just(()))


@fuzz("serve")
@given(data=st.data())
def test_fuzz_serve(data, sandbox):
    argv = ["serve", *data.draw(st.sampled_from(SERVE_MODELS)), "--no-progress", "--requests", "20",
            *data.draw(TRAFFIC)]
    for name in data.draw(st.lists(st.sampled_from(sorted(SERVE_OPTS)), max_size=3, unique=True)):
        argv += [name, data.draw(SERVE_OPTS[name])]
    if "--prefill-devices" in argv and data.draw(st.booleans()):
        argv.append("--compare-aggregated")
    check_contract(argv + data.draw(st.sampled_from([[], ["--json"]])))
    count("serve")


@st.composite
def serve_trace_content(draw) -> tuple[str, bytes]:
    rows = draw(st.lists(st.fixed_dictionaries({}, optional={
        "input_len": st.integers(-2, 5000) | st.sampled_from([1e400, "inf", "nan", "8", "", [1], {"a": 1}, True]),
        "output_len": st.integers(-2, 300) | st.sampled_from(["inf", 1.5, "x", None, 2**70]),
        "arrival_s": st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0, 1e300, -1, "1"]),
        "ContextTokens": st.integers(1, 64)}), max_size=8))
    if draw(st.booleans()):
        name = "t.jsonl"
        lines = [json.dumps(r) for r in rows]
        if draw(st.integers(0, 4)) == 0:
            lines.append("[" * draw(st.integers(1, 50_000)) + "]" * draw(st.integers(0, 50_000)))
        raw = "\n".join(lines).encode()
    else:
        name = "t.csv"
        keys = sorted({k for r in rows for k in r}) or ["input_len", "output_len"]
        raw = (",".join(keys) + "\n" + "".join(",".join(str(r.get(k, "")) for k in keys) + "\n" for r in rows)).encode()
    return name, byte_noise(raw or b"x", draw) if draw(st.integers(0, 4)) == 0 else raw


@fuzz("serve traces")
@given(data=st.data())
def test_fuzz_serve_traces(data, sandbox):
    name, raw = data.draw(serve_trace_content())
    (sandbox / name).write_bytes(raw)
    argv = ["serve", "--model", "kimi-k3-mini", "--devices", "1", "--trace", str(sandbox / name), "--no-progress"]
    argv += data.draw(st.sampled_from([[], ["--rate", "5"], ["--concurrency", "2"], ["--requests", "3", "--rate", "50"]]))
    check_contract(argv + data.draw(st.sampled_from([[], ["--json"]])))
    count("serve traces")


@fuzz("prefill")
@given(data=st.data())
def test_fuzz_prefill(data, sandbox):
    argv = ["predict", *data.draw(st.sampled_from([["--model", "kimi-k3-mini", "--devices", "1"],
                                                   ["--model", "llama-3.2-1b", "--hardware", "h100", "--devices", "1"],
                                                   ["--model", "kimi-k3", "--devices", "32", "--ep", "8"]]))]
    argv += ["--prompt", data.draw(mostly("1", "100", "4096", "131072", "1048576"))]
    if data.draw(st.booleans()):
        argv += ["--prefill-chunk", data.draw(mostly("1", "7", "64", "1024", "8192"))]
    if data.draw(st.booleans()):
        argv += ["--batch", data.draw(mostly("1", "1,8", ",".join(["8"] * 40), ",".join(map(str, range(1, 65)))))]
    argv += data.draw(st.sampled_from([[], ["--gain"], ["--engine", "multikernel"], ["--json"]]))
    check_contract(argv)
    count("prefill")


SERVING_DESIGN = {"base": {"model": "kimi-k3-mini", "devices": 1, "requests": 20, "input_len": 32, "output_len": 8},
                  "grid": {"concurrency": [1, 4]}, "constraints": {"ttft_p90_s": 1.0}}


@fuzz("constraints")
@given(data=st.data())
def test_fuzz_constraints(data, sandbox):
    design = json.loads(json.dumps(SERVING_DESIGN))
    if data.draw(st.integers(0, 2)):
        design = mutate(design, data.draw)
    (sandbox / "d.toml").write_bytes(toml_text(design).encode("utf-8", "surrogatepass"))
    argv = ["sweep", "--design", str(sandbox / "d.toml"), "--no-progress", "--jobs", "1", "--top", "2"]
    for _ in range(data.draw(st.integers(0, 2))):
        name = data.draw(st.sampled_from(["ttft_p90_s", "tpot_p50_s", "e2e_p99_s", "ttft_p90_s", "ttft", "nope", ""]))
        argv += ["--constraint", f"{name}={data.draw(mostly('1', '0.5', '0.001', '1e9'))}"]
    check_contract(argv + data.draw(st.sampled_from([[], ["--json"], ["--out", "rows.csv"]])))
    count("constraints")


def synthetic_plan() -> dict:
    """A plan file of kimi-k3-mini on one device: each layer's static weights as 256 KiB ring
    banks, each MoE layer's experts as routed copies, its KV read at the layer's start."""
    from perfmodel.graph import ops
    from perfmodel.graph.dmaplan import COLUMNS, FORMAT, VERSION
    from perfmodel.spec.deployment import Deployment
    from perfmodel.spec.loaders import load_model
    g = ops.build(load_model("kimi-k3-mini"), Deployment(devices=1, tp=1, batch=1, context=64))
    rows, bank = [], 256 * 1024
    for layer in sorted(set(g.layer.tolist())):
        m = g.layer == layer
        static, routed, kv = (int(x[m].sum()) for x in (g.static_bytes, g.routed_bytes, g.kv_bytes))
        if kv:
            rows.append([layer, "kv_cache", f"kv {layer}", kv, False, False])
        for b in range(0, static, bank):
            rows.append([layer, "attention", f"bank {b // bank}", min(bank, static - b), False, True])
        if routed:
            rows += [[layer, "routed_expert", f"expert {e}", routed // 2, True, False] for e in range(2)]
    return {"format": FORMAT, "version": VERSION, "model": "kimi-k3-mini",
            "deployment": {"devices": 1, "tp": 1, "ep": 1, "batch": 1, "context": 64},
            "kernel": {"bank_bytes": bank, "depth": 8, "expert_slots": 2}, "source": "synthetic",
            "columns": ["order", "layer", "family", "name", "bytes", "routed", "ring"],
            "copies": [[i, *r] for i, r in enumerate(rows)]}


@pytest.fixture(scope="module")
def plan_src():
    return synthetic_plan()


@fuzz("plans")
@given(data=st.data())
def test_fuzz_kernel_plan_files(data, sandbox, plan_src):
    plan = json.loads(json.dumps(plan_src))

    def pick(draw):
        target = draw(st.sampled_from(["deployment", "kernel", "row", "none"]))
        if target == "row" and plan["copies"]:
            i = draw(st.integers(0, len(plan["copies"]) - 1))
            row = plan["copies"][i]
            if isinstance(row, list) and row:
                row[draw(st.integers(0, len(row) - 1))] = draw(toml_scalars)
            if draw(st.integers(0, 5)) == 0:
                plan["copies"] = plan["copies"][:draw(st.integers(0, len(plan["copies"])))]
            return None
        return plan.get(target) if isinstance(plan.get(target), dict) else None
    raw = mutated_json(data.draw, plan, pick, 3, 4)
    (sandbox / "plan.json").write_bytes(raw)
    argv = data.draw(st.sampled_from([["predict"], ["explain"]])) + ["--kernel-plan", str(sandbox / "plan.json")]
    argv += data.draw(st.sampled_from([[], ["--json"], ["--steps-per-call", "4"], ["--hardware", "tpu-v6e"],
                                       ["--batch", "2"], ["--model", "kimi-k3"]]))
    check_contract(argv)
    count("plan files")


@pytest.fixture
def bundled_copy(tmp_path, monkeypatch):
    """A function that puts fresh copies of the serving-engine inventories and H100's kernel
    tables where the loaders read them instead of the package's (their caches cleared), for one
    example to corrupt; returns (inventory dir, H100 table dir)."""
    import shutil
    from perfmodel.cost import gpu_kernels as gk
    from perfmodel.spec import engines
    src_inv, src_h100 = engines.ENGINE_DIR, gk.KERNEL_DIR / "h100"
    inv, kdir = tmp_path / "serving_engines", tmp_path / "kernels"
    monkeypatch.setattr(engines, "ENGINE_DIR", inv)
    monkeypatch.setattr(gk, "KERNEL_DIR", kdir)
    caches = (engines.inventory.cache_clear, gk.tables.cache_clear, gk.forget_fits,
              gk.gpus_with_tables.cache_clear)

    def fresh():
        shutil.rmtree(inv, ignore_errors=True)
        shutil.rmtree(kdir, ignore_errors=True)
        shutil.copytree(src_inv, inv)
        shutil.copytree(src_h100, kdir / "h100")
        for clear in caches:
            clear()
        return inv, kdir / "h100"
    yield fresh
    for clear in caches:
        clear()


def corrupt_npz(path: Path, draw) -> None:
    import numpy as np
    how = draw(st.sampled_from(["bytes", "drop", "replace", "index"]))
    if how == "bytes":
        raw = path.read_bytes()
        path.write_bytes(draw(st.sampled_from([raw[:draw(st.integers(0, len(raw)))], byte_noise(raw, draw)])))
        return
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    key = draw(st.sampled_from(sorted(arrays)))
    if how == "drop":
        arrays.pop(key)
    elif how == "replace":
        arrays[key] = draw(st.sampled_from([np.zeros(3), np.array(["x"]), np.arange(4, dtype=np.uint8),
                                            np.array([[1.0]]), np.array([{"a": 1}], dtype=object)]))
    elif key.startswith("index"):
        doc = json.loads(arrays[key].tobytes())
        doc = mutate(doc, draw) if isinstance(doc, dict) else draw(toml_values)
        arrays[key] = np.frombuffer(json.dumps(doc).encode("utf-8", "surrogatepass"), np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


@fuzz("bundled")
@given(data=st.data())
def test_fuzz_bundled_data(data, bundled_copy):
    inv, h100 = bundled_copy()
    what = data.draw(st.sampled_from(["inventory", "table", "fit", "nccl"]))
    if what == "inventory":
        f = inv / "vllm.toml"
        src = tomllib.loads(f.read_text())
        f.write_bytes(data.draw(file_content(src, False)))
    elif what == "fit":
        f = h100 / "fit.json"
        doc = json.loads(f.read_text())
        engines = doc["engines"]
        doc["engines"] = {"vllm": dict(list(engines["vllm"].items())[:40])}  # quick to write and read

        def pick(draw):
            groups = doc["engines"].get("vllm") if isinstance(doc.get("engines"), dict) else None
            if not isinstance(groups, dict) or not groups:
                return None
            g = groups[draw(st.sampled_from(sorted(groups)))]
            return g if isinstance(g, dict) else None
        f.write_bytes(mutated_json(data.draw, doc, pick, 3, 6))
    else:
        corrupt_npz(h100 / ("nccl.npz" if what == "nccl" else "vllm.npz"), data.draw)
    argv = ["predict", "--model", data.draw(st.sampled_from(["llama-3.2-1b", "kimi-k3-mini"])), "--hardware", "h100",
            "--devices", "1", "--engine", "multikernel", "--serving-engine", "vllm"]
    check_contract(argv + data.draw(st.sampled_from([[], ["--json"], ["--batch", "1,64"]])))
    count(f"bundled {what}")


# ----- every signature the fuzz run found, kept as explicit examples ------------------------

HOST_MODEL = (PRESETS / "models" / "kimi-k3-host-small.toml").read_text()
TPU = (PRESETS / "hardware" / "tpu-v7.toml").read_text()
TINY = 'name = "x"\nhidden = 64\nvocab = 8\nlayers = 2\n'
HF = '{"num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 8, '


def model(text: str | bytes, name: str = "m.toml"):
    """argv predicting with a model file holding `text` (written into the test's tmp dir)."""
    def argv(tmp: Path) -> list[str]:
        (tmp / name).write_bytes(text if isinstance(text, bytes) else text.encode())
        return ["predict", "--model", str(tmp / name)]
    return argv


def hw(text: str | bytes):
    def argv(tmp: Path) -> list[str]:
        (tmp / "hw.toml").write_bytes(text if isinstance(text, bytes) else text.encode())
        return ["predict", "--model", "kimi-k3-mini", "--devices", "1", "--hardware", str(tmp / "hw.toml")]
    return argv


def cli(*argv: str):
    return lambda tmp: [a.replace("TMP", str(tmp)) for a in argv]


REGRESSIONS = {
    "undecodable model file": model(b'name = "\xff\xfe"\n'),
    "undecodable hardware file": hw(b"\xff\xfe\x00"),
    "TPU components without the DMA descriptor cost": lambda tmp: hw("\n".join(
        l for l in (Path(__file__).resolve().parents[1] / "perfmodel/presets/hardware/tpu-v7.toml")
        .read_text().splitlines() if "dma_descriptor_s" not in l))(tmp),
    "undecodable config.json": model(b'{"hidden_size": "\xff"}', "config.json"),
    "attention not a table": model(TINY + "attention = 5\n"),
    "moe not a table": model(TINY + "moe = 5\n"),
    "format not a string": model(TINY + "[formats]\nattention = [1]\n"),
    "null layer count": model('{"num_hidden_layers": null, "hidden_size": 8}', "config.json"),
    "zero heads": model(HF + '"num_attention_heads": 0, "intermediate_size": 8}', "config.json"),
    "string width, huge shared count": model(
        HF + '"num_attention_heads": 2, "n_routed_experts": 4, "num_experts_per_tok": 1, '
        '"moe_intermediate_size": "x", "n_shared_experts": 99999999999}', "config.json"),
    "huge first_k_dense_replace": model('{"num_hidden_layers": 2, "first_k_dense_replace": 99999999999}',
                                        "config.json"),
    "deeply nested JSON": model("[" * 5000 + "]" * 5000, "config.json"),
    "huge layer count": model(HOST_MODEL.replace("layers = 4", "layers = 99999999999999999")),
    "5000-digit layer count": model(HOST_MODEL.replace("layers = 4", "layers = " + "9" * 5000)),
    "a billion experts": model('base = "kimi-k3"\nname = "x"\n[moe]\nexperts = 1000000000\n'),
    "infinite skew": model('base = "kimi-k3"\nname = "x"\n[moe]\nrouting_skew = inf\n'),
    "base not a string": model('base = ["kimi-k3"]\nname = "x"\n'),
    "infinite latency": hw(TPU.replace("link_latency_s = ", "link_latency_s = inf #")),
    "efficiency not a table": hw(TPU.replace("[efficiency]", "efficiency = 3\n[x]")),
    "1-byte DMA tiles": hw(TPU.replace("dma_tile_bytes = ", "dma_tile_bytes = 1 #")),
    "--batch ,": cli("predict", "--batch", ","),
    "--vary batch=-0": cli("sweep", "--vary", "batch=-0"),
    "--vary hbm_gbps=-nan,0": cli("sweep", "--vary", "hbm_gbps=-nan,0"),
    "--vary prefetch_mib=nan": cli("sweep", "--vary", "prefetch_mib=nan", "--json"),
    "40,000-point sweep": cli("sweep", "--vary", "batch=" + ",".join(["1"] * 200),
                              "--vary", "context=" + ",".join(["1"] * 200)),
    "validate an empty directory": cli("validate", "--trace", "TMP", "--hardware", "tpu-v7", "--json"),
    "trace --out ..": cli("trace", "--out", ".."),
    "trace --out ''": cli("trace", "--out", ""),
    "trace --out /dev/full": cli("trace", "--out", "/dev/full"),
    "trace --out into a missing directory": cli("trace", "--out", "/nonexistent/dir/t.json"),
    "trace --out 300-byte name": cli("trace", "--out", "TMP/" + "x" * 300),
    "trace --out 6000-byte path": cli("trace", "--out", "x/" * 3000),
    "5000-byte model path": cli("predict", "--model", "x" * 5000 + ".toml"),
    "control characters in a name": cli("predict", "--model", "bad\x1b[31m\nname"),
    "undecodable argv": cli("predict", "--model", "\udcff.toml"),
    "capture into /dev/full": cli("capture", "--out", "/dev/full/x", "--batch", ","),
    "capture --steps 0": cli("capture", "--steps", "0"),
    "--prefetch-mib 1e308": cli("predict", "--prefetch-mib", "1e308"),
    "--routing-skew 1e300": cli("predict", "--routing-skew", "1e300"),
    "swept skew beyond the Zipf range": cli("sweep", "--vary", "routing_skew=269"),
    "swept ring depth inf": cli("sweep", "--vary", "prefetch_mib=inf"),
    "swept ring depth 1e308": cli("sweep", "--vary", "prefetch_mib=1e308"),
    "attention default a list": model('base = "kimi-k3"\nname = "x"\nlayers = 4\n[attention]\ndefault = []\n'),
    "400-digit context": cli("predict", "--context", "9" * 400),
    "unknown command": cli("nope"),
    "no command": cli(),
    # the new surfaces (micro-benchmark files, designs, outputs, options that need another)
    "micro-benchmark file: a directory": cli("calibrate", "--microbench", "TMP"),
    "micro-benchmark entry without a value": lambda tmp: mb(tmp, lambda d: d["entries"][0].pop("value")),
    "micro-benchmark zero bank": lambda tmp: mb(tmp, lambda d: d["entries"][0]["inputs"].update(bank_bytes=0)),
    "micro-benchmark unknown key": lambda tmp: mb(tmp, lambda d: d["entries"][0].update(zzz=1)),
    "micro-benchmark entry no fit reads": lambda tmp: mb(tmp, lambda d: d["entries"][0].update(mechanism="x")),
    "micro-benchmark deep nesting": lambda tmp: raw_file(tmp, "mb.json", "[" * 5000, "calibrate", "--microbench"),
    "design: a billion-point grid": lambda tmp: raw_file(
        tmp, "d.toml", "[grid]\nbatch = {min = 1, max = 8, steps = 1000000000}\n", "sweep", "--design"),
    "design: undecodable": lambda tmp: raw_file(tmp, "d.toml", b"[grid]\nbatch = [\xff]\n", "sweep", "--design"),
    "design: deep nesting": lambda tmp: raw_file(tmp, "d.toml", "[grid]\nbatch = " + "[" * 5000, "sweep", "--design"),
    "design: an empty axis": lambda tmp: raw_file(tmp, "d.toml", "[grid]\nbatch = []\n", "sweep", "--design"),
    "--vary with no values": cli("sweep", "--vary", "batch=,"),
    "sweep --out /dev/full": cli("sweep", "--vary", "batch=1", "--out", "/dev/full"),
    "sweep --out a directory": cli("sweep", "--vary", "batch=1", "--out", "TMP"),
    "--acceptance-length without --draft-rows": cli("predict", "--acceptance-length", "3"),
    "--draft-cost without --draft-rows": cli("predict", "--draft-cost", "0.1"),
    "--acceptance-prob without --draft-rows in a sweep": cli("sweep", "--vary", "batch=1", "--acceptance-prob", "0.5"),
    "--jobs with the Ray executor": cli("sweep", "--vary", "batch=1", "--jobs", "2", "--executor", "ray"),
    "calibrate --write without --kernels": cli("calibrate", "--write"),
    "--expert-slots 65536": cli("predict", "--expert-slots", "65536"),
    "fractional DMA tiles": hw(TPU.replace("dma_tile_bytes = ", "dma_tile_bytes = 0.001 #")),
    "unknown top-level key in a model file": model(TINY + "zzz = 1\n"),
    "unknown section in a model file": model(TINY + "[zzz]\na = 1\n"),
    "hostbench --name with a newline": cli("hostbench", "--name", "a\nb", "--out", "TMP/h.toml"),
    "trace --out into a missing directory, checked first": cli("trace", "--out", "TMP/no/t.json"),
}


def mb(tmp: Path, change) -> list[str]:
    d = json.loads(json.dumps(MB_SRC))
    change(d)
    (tmp / "mb.json").write_text(json.dumps(d))
    return ["calibrate", "--microbench", str(tmp / "mb.json")]


def raw_file(tmp: Path, name: str, content, *argv: str) -> list[str]:
    (tmp / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return [*argv, str(tmp / name)]


@pytest.mark.parametrize("name", REGRESSIONS)
def test_regression_examples(name, tmp_path):
    assert check_contract(REGRESSIONS[name](tmp_path)) == 2


def test_base_cycle(tmp_path, monkeypatch):
    (tmp_path / "a.toml").write_text('base = "b"\nname = "a"\n')
    (tmp_path / "b.toml").write_text('base = "a"\nname = "b"\n')
    (tmp_path / "c.toml").write_text('base = "c"\nname = "c"\n')
    monkeypatch.setattr(arch, "PRESET_DIR", tmp_path)
    for name in ("a", "c"):
        rc, _, err = run(["predict", "--model", name])
        assert rc == 2 and "cycle" in err, err


def test_internal_error_is_one_line_and_debug_shows_traceback(monkeypatch, capsys):
    from perfmodel.cli import predict as cli
    monkeypatch.setattr(cli, "cmd_list", lambda a: 1 / 0)
    rc, _, err = run(["list"])
    assert rc == 1 and "please report" in err and len(err.strip().splitlines()) == 1
    rc, _, err = run(["--debug", "list"])
    assert rc == 1 and "Traceback" in err and "ZeroDivisionError" in err
