#!/usr/bin/env bash
# The GPU suite, on the two-GPU machine: precompile every kernel (parallel NVRTC), the
# LocalGroup tests (ldst/tma, then ce on their own: a copy-engine wait has no timeout),
# the torchrun tests (bootstrap, NCCL comparison, 1,000 calls, graphs, latency).
# Everything runs under `timeout`; logs and a JSON + Markdown summary land in $OUT.
# Designed to finish in under 8 minutes.  Usage: OUT=/some/dir scripts/gpu_suite.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/purlin_gpu_suite}
mkdir -p "$OUT"
export PURLIN_RESULTS="$OUT" PURLIN_CACHE_DIR=${PURLIN_CACHE_DIR:-/tmp/purlin_cache}
export PURLIN_WAIT_TIMEOUT_S=${PURLIN_WAIT_TIMEOUT_S:-5} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:$PWD"
T0=$(date +%s)
# Run from the source tree: grammar/ and templates/ ship as purlinc.grammar / purlinc.templates
# in a wheel (pyproject's package-dir); link them in for the run, and remove the links after.
LINKS=()
for pkg in grammar templates; do
  if [ ! -e "purlinc/$pkg" ]; then ln -s "../$pkg" "purlinc/$pkg" && LINKS+=("purlinc/$pkg"); fi
done
trap 'for l in "${LINKS[@]}"; do rm -f "$l"; done' EXIT
declare -A RC SECS

step() {  # step NAME SECONDS LOG command...
  local name=$1 limit=$2 log=$3; shift 3
  local s=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$log" 2>&1
  RC[$name]=$?
  SECS[$name]=$(( $(date +%s) - s ))
  echo "== $name: rc=${RC[$name]} in ${SECS[$name]} s (log $log)"
  tail -n 5 "$OUT/$log"
}

step precompile 120 precompile.log python3 tests/gpu/_common.py precompile
PURLIN_TEST_ATOMS=ldst,tma step local 170 local.log \
  python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_local.py --junitxml=/tmp/purlin_local.xml
PURLIN_TEST_ATOMS=ce step local_ce 70 local_ce.log \
  python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_local.py --junitxml=/tmp/purlin_local_ce.xml \
  -k "test_collective or test_dtypes or test_graph or test_large"
PURLIN_TORCHRUN_TIMEOUT=150 step torchrun 165 torchrun.log \
  python3 -m pytest -q -rs -s -p no:cacheprovider tests/gpu/test_torchrun.py --junitxml=/tmp/purlin_torchrun.xml
# purlinc.torch (eager, torch.compile, CUDA graphs vs NCCL) and CuPy ranks without torch (issue 13)
step torch 600 torch.log \
  python3 -m pytest -q -rs -s -p no:cacheprovider tests/gpu/test_torch_api.py --junitxml=/tmp/purlin_torch.xml

export SUITE_RC_PRECOMPILE=${RC[precompile]} SUITE_RC_LOCAL=${RC[local]} SUITE_RC_LOCAL_CE=${RC[local_ce]}
export SUITE_RC_TORCHRUN=${RC[torchrun]} SUITE_RC_TORCH=${RC[torch]} SUITE_SECONDS=$(( $(date +%s) - T0 ))
export SUITE_STEP_SECONDS="precompile=${SECS[precompile]} local=${SECS[local]} local_ce=${SECS[local_ce]} torchrun=${SECS[torchrun]} torch=${SECS[torch]}"
python3 - <<'PY'
import datetime, json, os, platform, subprocess, xml.etree.ElementTree as ET

out = os.environ["OUT"] if "OUT" in os.environ else os.environ["PURLIN_RESULTS"]
def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception as e:
        return f"({e})"
def versions():
    v = {"python": platform.python_version()}
    for mod in ("torch", "cupy", "numpy", "cuda.bindings"):
        try:
            m = __import__(mod, fromlist=["x"]); v[mod] = getattr(m, "__version__", "?")
        except Exception as e:
            v[mod] = f"missing ({type(e).__name__})"
    try:
        import torch; v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception: pass
    try:
        from purlinc.atom.nvrtc import nvrtc_version; v["nvrtc"] = nvrtc_version()
    except Exception as e: v["nvrtc"] = str(e)
    return v
def junit(path):
    if not os.path.exists(path):
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    res = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "failed": []}
    for s in suites:
        for k in ("tests", "failures", "errors", "skipped"):
            res[k] += int(s.get(k, 0))
        for case in s.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                el = case.find("failure") if case.find("failure") is not None else case.find("error")
                res["failed"].append(f"{case.get('name')}: {(el.get('message') or '')[:300]}")
    res["passed"] = res["tests"] - res["failures"] - res["errors"] - res["skipped"]
    return res
def load(name):
    p = os.path.join(out, name)
    return json.load(open(p)) if os.path.exists(p) else None
summary = {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "machine": sh("hostname") + " / " + sh("nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tr '\n' ';'"),
    "topology": sh("nvidia-smi topo -m"),
    "versions": versions(),
    "seconds": int(os.environ["SUITE_SECONDS"]), "step_seconds": os.environ["SUITE_STEP_SECONDS"],
    "rc": {k: int(os.environ[f"SUITE_RC_{k.upper()}"]) for k in ("precompile", "local", "local_ce", "torchrun", "torch")},
    "local": junit("/tmp/purlin_local.xml"), "local_ce": junit("/tmp/purlin_local_ce.xml"),
    "torchrun_pytest": junit("/tmp/purlin_torchrun.xml"),
    "local_results": load("local_results.json"), "torchrun": load("torchrun_results.json"),
    "torch_pytest": junit("/tmp/purlin_torch.xml"), "torch_api": load("torch_results.json"),
    "cupy_no_torch": load("cupy_results.json"),
}
if summary["torch_api"]:
    summary["torch_api"].pop("checks_rank0", None)
tr = summary["torchrun"] or {}
if "checks" in tr:
    tr = {k: v for k, v in tr.items() if k != "checks"}
    summary["torchrun"] = tr
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
md = [f"# Purlin GPU suite, {summary['date']}", "", f"Machine: {summary['machine']}", "",
      f"Versions: {json.dumps(summary['versions'])}", "", f"Total {summary['seconds']} s ({summary['step_seconds']}); rc {summary['rc']}", "",
      "| part | passed | failed | errors | skipped |", "| --- | --- | --- | --- | --- |"]
for part in ("local", "local_ce", "torchrun_pytest", "torch_pytest"):
    r = summary[part]
    if r:
        md.append(f"| {part} | {r['passed']} | {r['failures']} | {r['errors']} | {r['skipped']} |")
if tr:
    md += ["", f"torchrun checks: {tr.get('passed')}/{tr.get('total')} passed; stages {tr.get('stages')}"]
    if tr.get("latency"):
        md += ["", "| collective | algorithm | atom | bytes/rank | purlin graph us | NCCL graph us | purlin eager us | NCCL eager us |",
               "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for row in tr["latency"]:
            md.append("| {collective} | {algorithm} | {atom} | {input_bytes_per_rank} | {purlin_graph_us} | {nccl_graph_us} | {purlin_eager_us} | {nccl_eager_us} |".format(**row))
ta, cp = summary["torch_api"] or {}, summary["cupy_no_torch"] or {}
if ta or cp:
    md += ["", f"purlinc.torch checks (eager, compile, reduce-overhead, cuda-graph, bad input; all ranks): "
           f"{ta.get('passed')}/{ta.get('total')} passed; stages {ta.get('stages')}",
           f"CuPy ranks without torch (all-gather): {cp.get('passed')}/{cp.get('checks')} passed, torch imported: "
           f"{cp.get('torch_imported')}"]
if summary["local_results"]:
    md += ["", "Local results: " + json.dumps(summary["local_results"])]
for part in ("local", "local_ce", "torchrun_pytest", "torch_pytest"):
    r = summary[part]
    if r and r["failed"]:
        md += ["", f"## {part} failures"] + [f"- {f}" for f in r["failed"][:60]]
md += ["", "```", summary["topology"], "```"]
open(os.path.join(out, "summary.md"), "w").write("\n".join(md) + "\n")
print("\n".join(md[:40]))
PY
