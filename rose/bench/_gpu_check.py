"""The GPU check: every part of ROSE that needs a real GPU, run on one, each on its own, with
the results as JSON under one folder. Needs only Python, torch and this repository on
PYTHONPATH (no Kafka, Redis, Java or package registry); a part whose Python packages are
missing is skipped, naming them, and `--wheels DIR` adds wheels carried in a folder.

    deploy/gpu-check.sh OUT_DIR [--full] [--wheels DIR] [--dry-run]
    python -m rose.bench._gpu_check OUT_DIR ...        (what the script runs)

Parts (docs/paper-check.md "The GPU check"):

* cuda-tests: `pytest -m cuda` over the test files that carry the mark (cuda-tests.xml).
* interference: serving beside rollout on CUDA stream priorities (rose.bench._cuda);
  interference.json is a calibration file for `rose simulate --interference-bench`.
* interference-profile: serving and rollout as real transformer decode steps (random-init Llama
  1B and 8B shapes, bf16), rollout in its own process as the executor starts workers, at shares
  0.1, 0.25, 0.5 and 1 for each mechanism this machine has (rose.bench.interference_profile);
  one `rose.interference_profile.v1` file per shape and mechanism, for
  `rose simulate --interference-profile`. Sized to about 8 minutes on one H200.
* pause: the pause flag raised -> rollout's stream drained, the device side of a guard pause
  or revoke (the Kafka path of `rose bench revoke` needs a broker and is not run here).
* weights: `rose bench weights` (the delta codec) and host-to-device copies of a version.
* nvml-agent: the agent's NVML adapter (rose.node.nvml) on the real device: utilisation idle
  and busy, memory, and the per-process memory of a rollout process found by its PID.

`--dry-run` imports nothing heavy and runs nothing: it writes the plan (each part, what it
needs, what is missing here) to OUT_DIR/gpu-check.json. Exit status: 1 if a part failed; 3, with
one line saying so, if nothing was measured (every part skipped, e.g. without a GPU: a check that
measured nothing must not read as passed); else 0.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
import traceback
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


# What the GPU machine has besides the standard library: torch, transformers and what their
# wheels require (the import names; transformers 5 brings huggingface_hub 1, which brings httpx
# and typer, the closure of their requirements read from the installed distributions).
PRESENT = (
    "torch", "torchgen", "functorch", "triton", "nvidia", "cuda", "numpy", "transformers", "tokenizers",
    "safetensors", "huggingface_hub", "hf_xet", "filelock", "fsspec", "jinja2", "markupsafe", "networkx",
    "sympy", "mpmath", "typing_extensions", "packaging", "yaml", "regex", "requests", "urllib3", "idna",
    "certifi", "charset_normalizer", "tqdm", "setuptools", "pkg_resources", "_distutils_hack",
    "httpx", "httpx2", "httpcore", "httpcore2", "anyio", "sniffio", "h11", "truststore", "typer", "click",
    "rich", "markdown_it", "mdurl", "pygments", "shellingham", "pydantic", "pydantic_core", "annotated_types",
    "annotated_doc", "typing_inspection", "exceptiongroup", "importlib_metadata", "colorama", "tomli",
)  # fmt: skip
# Import name -> the wheel that carries it (`pip download` names, docs/paper-check.md).
WHEELS = {
    "pytest": "pytest",
    "py": "pytest",  # pytest's wheel carries a top-level `py` shim
    "pluggy": "pluggy",
    "iniconfig": "iniconfig",
    "pygments": "pygments",
    "structlog": "structlog",
    "orjson": "orjson",
    "psutil": "psutil",
    "opentelemetry": "opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions",
    "xxhash": "xxhash",
    "zstandard": "zstandard",
    "redis": "redis",
    "hypothesis": "hypothesis",
    "sortedcontainers": "sortedcontainers",
    "pynvml": "nvidia-ml-py",
}


@dataclass(frozen=True)
class Part:
    name: str
    what: str
    modules: tuple[str, ...]  # imported before it runs (the first that fails to import is reported)
    packages: tuple[str, ...] = ()  # beyond PRESENT, by import name (WHEELS says which wheel)
    cuda: bool = True


def cuda_test_files() -> list[str]:
    """The test files that carry the `cuda` mark, relative to the repository."""
    out = []
    for f in sorted((REPO / "tests").rglob("test_*.py")):
        if "mark.cuda" in f.read_text(errors="replace"):
            out.append(str(f.relative_to(REPO)))
    return out


def parts() -> list[Part]:
    tests = tuple(f.removesuffix(".py").replace("/", ".") for f in cuda_test_files())
    test_pkgs = (
        *("pytest", "py", "pluggy", "iniconfig", "pygments", "hypothesis", "sortedcontainers"),
        *("structlog", "orjson", "psutil", "opentelemetry", "xxhash"),
    )
    return [
        Part("cuda-tests", "pytest -m cuda", ("pytest", "tests.conftest", *tests), test_pkgs),
        Part("interference", "serving beside rollout on CUDA stream priorities", ("torch", "rose.bench._cuda")),
        Part(
            "interference-profile",
            "serving beside a rollout process, real decode steps, profiles per mechanism",
            ("torch", "transformers", "rose.bench.interference_profile"),
        ),
        Part("pause", "pause flag raised -> rollout stream drained", ("torch", "rose.bench._cuda")),
        Part(
            "weights",
            "delta codec (rose bench weights) and host-to-device copies",
            ("torch", "rose.bench.weights", "rose.weights.codec", "rose.weights.checkpoint"),
            ("orjson", "xxhash", "zstandard", "redis"),
        ),
        Part(
            "nvml-agent",
            "the agent's NVML adapter on the real device",
            ("torch", "pynvml", "rose.node.nvml"),
            ("pynvml",),
        ),
    ]


def add_wheels(folder: Path, site: Path) -> list[str]:
    """Unpack every wheel in `folder` into `site` (a wheel is a zip of its importable tree) and
    put `site` first on sys.path and PYTHONPATH; the wheels' names."""
    names = []
    site.mkdir(parents=True, exist_ok=True)
    for whl in sorted(folder.glob("*.whl")):
        with zipfile.ZipFile(whl) as z:
            z.extractall(site)
        names.append(whl.name)
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    importlib.invalidate_caches()
    return names


def missing(part: Part) -> list[str]:
    """The packages the part needs that are not installed here (import names)."""
    return [m for m in ("torch", *part.packages) if importlib.util.find_spec(m) is None]


def probe(part: Part) -> str | None:
    """Import what the part needs; the name of the first missing module (None: all import)."""
    for m in part.modules:
        try:
            importlib.import_module(m)
        except ModuleNotFoundError as e:
            return e.name or m
    return None


# ---- the parts -------------------------------------------------------------------------


def run_cuda_tests(out: Path, full: bool) -> dict:
    files = cuda_test_files()
    xml = out / "cuda-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", *files, f"--junitxml={xml}"]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800, env={**os.environ})
    (out / "cuda-tests.log").write_text(p.stdout + p.stderr)
    counts = junit_counts(xml)
    status = tests_status(p.returncode, counts)
    why = {"reason": f"no CUDA test passed ({counts.get('skipped', 0)} skipped)"} if status == "skipped" else {}
    return {
        "status": status,
        **why,
        "returncode": p.returncode,
        **counts,
        "files": files,
        "log": "cuda-tests.log",
    }


def junit_counts(xml: Path) -> dict:
    """Tests passed, skipped and failed (failures and errors) in a junit xml file, counted per
    test case (a skipped test is not a passed one); {} if the file is missing or unreadable."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(xml).getroot()
    except (OSError, ET.ParseError):
        return {}
    counts = {"tests": 0, "passed": 0, "skipped": 0, "failed": 0}
    for case in root.iter("testcase"):
        counts["tests"] += 1
        tags = {child.tag for child in case}
        if tags & {"failure", "error"}:
            counts["failed"] += 1
        elif "skipped" in tags:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def tests_status(returncode: int, counts: dict) -> str:
    """ "failed" if pytest failed or a test did, "skipped" if none passed (nothing measured),
    else "ok"."""
    if returncode not in (0, 5) or counts.get("failed", 0) or not counts:
        return "failed"
    return "ok" if counts.get("passed", 0) > 0 else "skipped"


def run_interference(out: Path, full: bool) -> dict:
    from rose.bench import _cuda
    from rose.bench.interference import GOAL_PROTECTED_OVER_ALONE

    r = _cuda.interference("cuda", quick=not full)
    r["goal_protected_p99_over_alone"] = GOAL_PROTECTED_OVER_ALONE
    _write(out / "interference.json", r)
    return {
        "status": "ok",
        "file": "interference.json",
        "alpha_per_share": r["alpha_per_share"],
        "alpha_per_share_separate_process": r["alpha_per_share_separate_process"],
        "use": f"rose simulate --interference-bench {out / 'interference.json'}",
    }


def run_interference_profile(out: Path, full: bool) -> dict:
    from rose.bench import interference_profile

    r = interference_profile.run(out)
    _write(out / "interference-profile.json", r)
    files = [f for per_shape in r["files"].values() for f in per_shape.values()]
    return {
        "status": "ok" if files else "failed",
        "file": "interference-profile.json",
        "profiles": files,
        "skipped": interference_profile.skips(r["plan"]),
        "points": interference_profile.summary(r),
        "use": "rose simulate --interference-profile FILE (one of profiles)",
    }


def interference_profile_plan(cuda: bool | None) -> dict:
    """The interference-profile part's plan without importing torch: shapes, shares, steps,
    mechanisms (MPS looked for, never started) and the estimated time on an H200."""
    from rose.bench import interference_profile

    return interference_profile.plan(cuda=True if cuda is None else cuda, mps=interference_profile.mps_daemon())


def run_pause(out: Path, full: bool) -> dict:
    from rose.bench import _cuda

    r = _cuda.pause_latency("cuda", quick=not full)
    _write(out / "pause.json", r)
    return {"status": "ok", "file": "pause.json", "p99_ms": r["p99_ms"], "p99_over_goal": r["p99_over_goal"]}


def run_weights(out: Path, full: bool) -> dict:
    from rose.bench import _cuda, weights

    r = {
        "codec_on_device": _cuda.codec_on_device("cuda", quick=not full),
        "host_to_device": _cuda.host_to_device("cuda", quick=not full),
        "codec": weights.run(None, quick=not full),
    }
    _write(out / "weights.json", r)
    dev = r["codec_on_device"]
    return {
        "status": "ok",
        "file": "weights.json",
        **r["host_to_device"],
        **{k: dev[k] for k in ("encode_over_device_memcpy", "apply_over_device_memcpy", "encode_ms", "apply_ms")},
    }


def run_nvml_agent(out: Path, full: bool) -> dict:
    import threading

    import torch

    from rose.bench import _cuda
    from rose.node.nvml import Nvml

    nv = Nvml()
    try:
        idle = [_sample(nv, i, set()) for i in range(len(nv))]
        dev = _cuda._Device("cuda:0")
        shape = _cuda.Shape()
        stack = _cuda.make_stack(dev, shape, seed=3)
        x = torch.randn(shape.rollout_batch, shape.d_model, device=dev.device, dtype=dev.dtype)
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                _cuda.decode_step(dev, x, stack)
                torch.cuda.synchronize()

        t = threading.Thread(target=load, daemon=True)
        t.start()
        time.sleep(2.0)  # NVML averages utilisation over up to a second
        busy = _sample(nv, 0, set())
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys, torch; x = torch.empty(512 << 20, dtype=torch.uint8, device='cuda:0'); "
                "print('ready', flush=True); sys.stdin.read()",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            ready = child.stdout.readline().strip() == "ready" if child.stdout else False
            time.sleep(0.5)
            attributed = _sample(nv, 0, {child.pid})
        finally:
            if child.stdin:
                child.stdin.close()
            child.wait(30)
            stop.set()
            t.join()
    finally:
        nv.close()
    r = {
        "gpus": len(idle),
        "idle": idle,
        "busy_gpu0": busy,
        "rollout_process_gpu0": {**attributed, "pid": child.pid, "started": ready, "allocated_bytes": 512 << 20},
        "rollout_memory_found": attributed["rollout_mem_bytes"] >= (512 << 20),
        "note": "rollout memory is matched by PID; in a container without the host's PID namespace "
        "NVML reports other PIDs and finds none",
    }
    _write(out / "nvml-agent.json", r)
    ok = busy["util"] > 0 and all(s["mem_total_bytes"] > 0 for s in idle)
    return {
        "status": "ok" if ok else "failed",
        "file": "nvml-agent.json",
        "util_busy": busy["util"],
        "rollout_memory_found": r["rollout_memory_found"],
    }


def _sample(nv, i: int, pids: set[int]) -> dict:
    s = nv.sample(i, pids)
    return {
        "util": s.util,
        "mem_total_bytes": s.mem_total_bytes,
        "mem_used_bytes": s.mem_used_bytes,
        "rollout_mem_bytes": s.rollout_mem_bytes,
    }


RUNNERS: dict[str, Callable[[Path, bool], dict]] = {
    "cuda-tests": run_cuda_tests,
    "interference": run_interference,
    "interference-profile": run_interference_profile,
    "pause": run_pause,
    "weights": run_weights,
    "nvml-agent": run_nvml_agent,
}
NOT_RUN = {
    "revoke-kafka": "`rose bench revoke` times the command through Kafka to the worker: needs a Kafka broker and "
    "Redis, which the GPU machine lacks; its device side is the pause part",
}


NOTHING_MEASURED = 3  # exit status when every part was skipped


def _write(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def _environment(dry: bool) -> dict:
    env: dict = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    if dry or importlib.util.find_spec("torch") is None:
        env["torch"] = None if importlib.util.find_spec("torch") is None else "not imported (dry run)"
        return env
    import torch

    env["torch"] = torch.__version__
    env["cuda_available"] = torch.cuda.is_available()
    if env["cuda_available"]:
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["cuda_version"] = torch.version.cuda
    env["mps_pipe"] = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
    return env


def _plan_lines(p: dict) -> str:
    lines = [
        f"  shares {', '.join(f'{x:g}' for x in p['shares'])}; estimated {p['estimated_s'] / 60:.1f} min on an H200"
    ]
    for name, s in p["shapes"].items():
        m = s["model"]
        head = (
            f"  {name}: {m['layers']} layers, hidden {m['hidden']}, {s['serving_steps_per_phase']} serving steps/phase"
        )
        mechs = [f"{k} ({v['skipped']})" if "skipped" in v else k for k, v in s["mechanisms"].items()]
        lines.append(f"{head}, ~{s['estimated_s']} s: " + "; ".join(mechs))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu-check", description="Run ROSE's GPU parts; JSON under OUT_DIR.")
    ap.add_argument("out", type=Path, help="folder for the results (created)")
    ap.add_argument("--full", action="store_true", help="the long variants (default: quick)")
    ap.add_argument("--wheels", type=Path, help="a folder of wheels to unpack and put first on the path")
    ap.add_argument("--only", default="", help="comma list of parts to run (default: all)")
    ap.add_argument("--dry-run", action="store_true", help="write the plan only: what runs, what is missing")
    a = ap.parse_args(argv)
    out: Path = a.out.resolve()  # the tests run from the repository
    out.mkdir(parents=True, exist_ok=True)
    wheels = add_wheels(a.wheels, out / "_site") if a.wheels else []
    only = {x.strip() for x in a.only.split(",") if x.strip()}
    unknown = only - set(RUNNERS)
    if unknown:
        ap.error(f"--only: unknown part(s) {', '.join(sorted(unknown))} (known: {', '.join(RUNNERS)})")
    env = _environment(a.dry_run)
    cuda = bool(env.get("cuda_available"))
    summary: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "environment": env, "wheels": wheels}
    summary["parts"] = results = {}
    failed = False
    for part in parts():
        if only and part.name not in only:
            continue
        gaps = missing(part)
        entry: dict = {
            "what": part.what,
            "needs": ["torch", *part.packages],
            "missing": gaps,
            "wheels_to_carry": sorted({w for g in gaps for w in WHEELS.get(g, g).split()}),
        }
        results[part.name] = entry
        if a.dry_run:
            entry["would_run"] = not gaps
            if part.name == "interference-profile":
                entry["plan"] = interference_profile_plan(env.get("cuda_available"))
            continue
        if part.cuda and not cuda:
            entry.update(status="skipped", reason="no CUDA GPU (torch.cuda.is_available() is false)")
            continue
        gap = gaps[0] if gaps else probe(part)
        if gap is not None:
            entry.update(status="skipped", reason=f"Python module {gap!r} missing (carry its wheel, --wheels DIR)")
            continue
        t0 = time.perf_counter()
        try:
            entry.update(RUNNERS[part.name](out, a.full))
        except Exception as e:  # one part's failure must not stop the others
            entry.update(status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        failed |= entry.get("status") == "failed"
    summary["not_run"] = NOT_RUN
    summary["dry_run"] = a.dry_run
    summary["measured"] = measured = sorted(n for n, e in results.items() if e.get("status") in ("ok", "failed"))
    _write(out / "gpu-check.json", summary)
    if not a.dry_run and not measured:
        reasons = sorted({e.get("reason", "") for e in results.values()})
        print(f"gpu-check: nothing was measured ({'; '.join(reasons)}); see {out / 'gpu-check.json'}", file=sys.stderr)
        return NOTHING_MEASURED
    for name, res in results.items():
        state = "would run" if res.get("would_run") else f"missing {', '.join(res['missing'])}"
        tally = (
            f" ({res['passed']} passed, {res['skipped']} skipped, {res['failed']} failed)" if "passed" in res else ""
        )
        print(f"{name:20s} {state if a.dry_run else res['status']}{tally}", file=sys.stderr)
        if "plan" in res:
            print(_plan_lines(res["plan"]), file=sys.stderr)
    print(f"summary: {out / 'gpu-check.json'}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
