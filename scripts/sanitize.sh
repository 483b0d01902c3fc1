#!/usr/bin/env bash
# Every example x algorithm x atom at R=2 (plus the LL and pipelined paths) under
# compute-sanitizer: memcheck, racecheck and synccheck (racecheck and synccheck see
# intra-block hazards only), each case called on fresh data and checked against the
# reference.  On the two-GPU machine, from the source tree:
#
#   OUT=/some/dir PYTHONPATH=/tmp/site:$PWD timeout 420 scripts/sanitize.sh
#
# Each tool runs as `torchrun --no-python compute-sanitizer ... python3 sanitize_cases.py`:
# one sanitizer per process (one GPU each), so the two ranks' kernels run at the same time
# (a sanitizer serialises the kernels of one process, and the kernels of one collective wait
# for each other).  memcheck also runs once in one process driving both GPUs (LocalGroup,
# peer access), which compute-sanitizer may refuse or serialise: its message is recorded.
# A tool that refuses the device is recorded and initcheck runs in its place.
# Every run has a time limit and a case budget; the whole script stays under ~6 minutes.
# Writes $OUT/sanitize_<tool>.log (the sanitizer's report), $OUT/sanitize_<tool>.out
# (the cases), $OUT/cases_*.json and $OUT/sanitize_summary.{json,md}.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/purlin_sanitize}
mkdir -p "$OUT"
export PURLIN_CACHE_DIR=${PURLIN_CACHE_DIR:-/tmp/purlin_cache} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# Sanitized kernels run 10-100x slower: a longer device-side bound, so slowness is not a timeout.
export PURLIN_WAIT_TIMEOUT_S=${PURLIN_SANITIZE_WAIT_S:-30} PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:$PWD"
LINKS=()
for pkg in grammar templates; do
  if [ ! -e "purlinc/$pkg" ]; then ln -s "../$pkg" "purlinc/$pkg" && LINKS+=("purlinc/$pkg"); fi
done
trap 'for l in "${LINKS[@]}"; do rm -f "$l"; done' EXIT
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
TORCHRUN=$(command -v torchrun || echo "python3 -m torch.distributed.run")
T0=$(date +%s)
PORT=29571
declare -A RC SECS

timeout 100 python3 tests/gpu/sanitize_cases.py --precompile >"$OUT/sanitize_precompile.log" 2>&1
echo "== precompile rc=$? in $(( $(date +%s) - T0 )) s: $(tail -n 1 "$OUT/sanitize_precompile.log")"

run_tool() {  # run_tool TAG TOOL LIMIT BUDGET [local]
  local tag=$1 tool=$2 limit=$3 budget=$4 mode=${5:-torchrun} s=$(date +%s)
  local log="$OUT/sanitize_${tag}.log" flags=(--tool "$tool" --print-limit 50 --error-exitcode 99)
  # Host API errors are not kernel faults: on 2 x H200 (2026-11-30) memcheck's 34 reports per rank
  # were all CUDA_ERROR_INVALID_VALUE from cuGetProcAddress_v2 (symbol probing by torch and
  # cuda-bindings at start-up), and no device memory error.  Report device errors only.
  [ "$tool" = memcheck ] && flags+=(--report-api-errors no)
  [ "$tool" = racecheck ] && flags+=(--racecheck-report hazard)
  local rc
  if [ "$mode" = local ]; then
    timeout --kill-after=10 "$limit" "$SAN" "${flags[@]}" --log-file "$log" \
      python3 tests/gpu/sanitize_cases.py --local --tag "$tag" --out "$OUT" --budget "$budget" >"$OUT/sanitize_${tag}.out" 2>&1
    rc=$?
  else
    PORT=$((PORT + 1))
    # %p: one report per process (rank).
    timeout --kill-after=10 "$limit" $TORCHRUN --nproc_per_node=2 --master_port=$PORT --no-python \
      "$SAN" "${flags[@]}" --log-file "${log%.log}.%p.log" \
      python3 tests/gpu/sanitize_cases.py --tag "$tag" --out "$OUT" --budget "$budget" >"$OUT/sanitize_${tag}.out" 2>&1
    rc=$?
    cat "${log%.log}".*.log > "$log" 2>/dev/null
  fi
  RC[$tag]=$rc
  SECS[$tag]=$(( $(date +%s) - s ))
  echo "== $tag ($tool, $mode): rc=$rc in ${SECS[$tag]} s; $(grep -h -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" 2>/dev/null | sort | uniq -c | tr '\n' ' ')"
  tail -n 2 "$OUT/sanitize_${tag}.out"
}

refused() {  # did the sanitizer refuse to run (rather than report)? its own error lines
  grep -q -E "Error: (Device|Target application|.*not supported)|Unable to|cannot be used|unsupported" "$OUT/sanitize_$1.log" "$OUT/sanitize_$1.out" 2>/dev/null
}

if [ -z "$SAN" ]; then
  echo "compute-sanitizer not found" | tee "$OUT/sanitize_summary.md"
  exit 1
fi
"$SAN" --version > "$OUT/sanitize_version.txt" 2>&1

run_tool memcheck memcheck 95 60
run_tool racecheck racecheck 75 45
run_tool synccheck synccheck 60 35
run_tool memcheck_local memcheck 45 25 local
FALLBACK=""
for tag in memcheck racecheck synccheck; do
  if refused "$tag"; then FALLBACK="$FALLBACK $tag"; fi
done
if [ -n "$FALLBACK" ]; then
  echo "== refused:$FALLBACK; running initcheck in their place"
  run_tool initcheck initcheck 60 35
fi

export SAN_SECONDS=$(( $(date +%s) - T0 )) SAN_FALLBACK="$FALLBACK" OUT
python3 - <<'PY'
import glob, json, os, re

out = os.environ["OUT"]
summary = {"seconds": int(os.environ["SAN_SECONDS"]), "refused_then_initcheck": os.environ["SAN_FALLBACK"].split(),
           "version": open(os.path.join(out, "sanitize_version.txt")).read().strip().splitlines()[-1:], "tools": {}}
for log in sorted(glob.glob(os.path.join(out, "sanitize_*.log"))):
    tag = os.path.basename(log)[len("sanitize_"):-len(".log")]
    if "." in tag or tag in ("precompile", "version"):
        continue
    text = open(log, errors="replace").read()
    errors = [int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) error", text)]
    hazards = re.findall(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", text)
    cases = {}
    for path in glob.glob(os.path.join(out, f"cases_{tag}_rank*.json")):
        data = json.load(open(path))
        for row in data["results"]:
            key = row["outcome"].split(":")[0]
            cases.setdefault(f"rank{data['rank']}", {}).setdefault(key, 0)
            cases[f"rank{data['rank']}"][key] += 1
        bad = [f"{r['label']} {r.get('path', '')}: {r['outcome']}" for r in data["results"]
               if r["outcome"].startswith(("wrong", "error"))]
        if bad:
            summary.setdefault("failures", {})[f"{tag}/rank{data['rank']}"] = bad[:20]
    reports = [l for l in text.splitlines() if l.startswith("=========") and
               re.search(r"Invalid|Race|Barrier|Uninitialized|Error:|error", l) and "SUMMARY" not in l]
    summary["tools"][tag] = {
        "error_summaries": errors, "sanitizer_errors": sum(errors),
        "racecheck": [{"hazards": int(h), "errors": int(e), "warnings": int(w)} for h, e, w in hazards],
        "cases": cases, "first_reports": reports[:15],
        "ran": bool(errors or hazards),
    }
json.dump(summary, open(os.path.join(out, "sanitize_summary.json"), "w"), indent=1)
md = ["# compute-sanitizer on the Purlin kernels (R=2)", "", f"Total {summary['seconds']} s; {summary['version']}", "",
      "| run | sanitizer errors | racecheck hazards | cases per rank (ok / n/a / wrong / error / not run) |",
      "| --- | --- | --- | --- |"]
for tag, t in summary["tools"].items():
    hz = sum(h["hazards"] for h in t["racecheck"]) if t["racecheck"] else "-"
    per = "; ".join(f"{r}: {c.get('ok', 0)} / {c.get('n/a', 0)} / {c.get('wrong', 0)} / {c.get('error', 0)} / {c.get('not run', 0)}"
                    for r, c in sorted(t["cases"].items()))
    md.append(f"| {tag} | {t['sanitizer_errors'] if t['ran'] else 'no summary (refused or cut short)'} | {hz} | {per} |")
for tag, t in summary["tools"].items():
    if t["first_reports"]:
        md += ["", f"## {tag}: first reports", "```", *t["first_reports"], "```"]
if summary.get("failures"):
    md += ["", "## case failures"] + [f"- {k}: {v}" for k, v in summary["failures"].items()]
open(os.path.join(out, "sanitize_summary.md"), "w").write("\n".join(md) + "\n")
print("\n".join(md))
PY
