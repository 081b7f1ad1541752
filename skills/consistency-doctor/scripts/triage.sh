#!/usr/bin/env bash
# Diagnose the worst samples of a mismatch store and summarise the causes.
#
# usage: triage.sh STORE_DIR [N] [-- DIAGNOSE_ARGS...]
#   STORE_DIR  the verifier's mismatch store (default layout: $ONPOLICY_HOME/mismatches/<job>/*.json);
#              any directory of sample JSON files works (searched recursively)
#   N          how many samples, worst max_abs_logdiff first (default 5)
#   DIAGNOSE_ARGS  passed to every `onpolicy diagnose` (e.g. --model PATH, --trainer kv_tile=16)
# env: ONPOLICY  the command to run (default `onpolicy`; e.g. ".venv/bin/onpolicy")
#      PYTHON    a python3 for ranking and summarising (default python3)
# Exit code: 0 no divergence found, 1 some sample diverges, 2 bad usage or a sample could not be diagnosed.
set -uo pipefail

usage() { echo "usage: triage.sh STORE_DIR [N] [-- DIAGNOSE_ARGS...]" >&2; exit 2; }
[ $# -ge 1 ] || usage
STORE=$1; shift
N=5
if [ $# -ge 1 ] && [ "$1" != "--" ]; then N=$1; shift; fi
[ $# -ge 1 ] && [ "$1" = "--" ] && shift
[[ "$N" =~ ^[1-9][0-9]*$ ]] || { echo "triage: N must be a positive integer, got '$N'" >&2; exit 2; }
[ -d "$STORE" ] || { echo "triage: $STORE: no such directory" >&2; exit 2; }
PY=${PYTHON:-python3}
read -r -a CMD <<< "${ONPOLICY:-onpolicy}"

# worst first: max_abs_logdiff descending (files without it last), then path
mapfile -t FILES < <("$PY" - "$STORE" "$N" <<'PYEOF'
import json, pathlib, sys
rows = []
for p in pathlib.Path(sys.argv[1]).rglob("*.json"):
    try:
        d = json.loads(p.read_text())
        v = float(d.get("max_abs_logdiff", -1.0)) if isinstance(d, dict) else -1.0
    except (OSError, ValueError, TypeError):
        continue
    rows.append((-v, str(p)))
for _, p in sorted(rows)[: int(sys.argv[2])]:
    print(p)
PYEOF
)
if [ ${#FILES[@]} -eq 0 ]; then echo "triage: no samples in $STORE"; exit 0; fi

OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
i=0
for f in "${FILES[@]}"; do
    "${CMD[@]}" diagnose "$f" --json "$@" >"$OUT/$i.json" 2>"$OUT/$i.err"
    echo $? >"$OUT/$i.rc"
    printf '%s\n' "$f" >"$OUT/$i.path"
    i=$((i + 1))
done

"$PY" - "$OUT" "$i" <<'PYEOF'
import collections, json, pathlib, sys
out, n = pathlib.Path(sys.argv[1]), int(sys.argv[2])
counts, advice, worst, failed, divergent = collections.Counter(), {}, 1, 0, 0
for i in range(n):
    path = (out / f"{i}.path").read_text().strip()
    rc = int((out / f"{i}.rc").read_text().strip() or 2)
    if rc not in (0, 1):
        failed += 1
        err = (out / f"{i}.err").read_text().strip().splitlines()
        print(f"{path}: ERROR {err[-1] if err else f'exit {rc}'}")
        continue
    d = json.loads((out / f"{i}.json").read_text())
    if not d["divergent"]:
        counts["none"] += 1
        print(f"{path}: none (no divergence on replay)")
        continue
    divergent += 1
    label = f"{d['class']}/{d['cause']}"
    counts[label] += 1
    advice[label] = d.get("advice", "")
    where = f"layer {d['layer']}" if d.get("layer") is not None else d.get("module")
    print(f"{path}: {label} at {d['op']} ({where}), max |logdiff| {d['max_abs_logdiff']:.3g}")
print("summary: " + ", ".join(f"{k} {v}" for k, v in counts.most_common()) + (f", errors {failed}" if failed else ""))
for label, text in advice.items():
    print(f"  {label}: {text}")
sys.exit(2 if failed else 1 if divergent else 0)
PYEOF
