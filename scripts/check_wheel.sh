#!/usr/bin/env bash
# The production install, proved: build the wheel from a clean copy of this tree, install it
# NON-editable into a fresh venv (torch==2.13.0 first, so pip keeps the CPU build), import
# every module of the installed package (pkgutil.walk_packages), then run one 4-rank HA job
# with a fault from the installed wheel, in a directory outside the source tree so that the
# tree cannot be imported: `mindspeed-ha demo --fault uce` must exit 0, recover in the
# running processes and match the uninterrupted run's losses bit for bit.
#
#     scripts/check_wheel.sh [--keep] [--lock FILE]
#
# --keep: leave the scratch directory (printed); --lock FILE: run the 4-rank job under
# `flock FILE` (a shared machine's lock for multi-process runs; the install needs none).
#
# Needs python3 with venv and the package registry (or its cache); `.ci/run` calls it.
# Cost: about 5 CPU-minutes (measured 2026-12-02: 4m21s user + 37s sys), most of it pip
# installing megatron-core's dependencies and the demo's two 4-rank runs; the wall time of
# that run (46 min) was set by 8 jobs sharing 2 cores and a wait for --lock, not by the check.
set -euo pipefail

# one function, read whole before it runs (editing this file during a run cannot change it)
main() {
cd "$(dirname "$0")/.."
SRC_ROOT=$PWD
PY=${PYTHON:-python3}
KEEP=""
LOCK=()
while [ $# -gt 0 ]; do
    case "$1" in
        --keep) KEEP=--keep; shift ;;
        --lock) LOCK=(flock "$2"); shift 2 ;;
        *) echo "usage: $0 [--keep] [--lock FILE]" >&2; exit 2 ;;
    esac
done

SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/mindspeed_ha_wheel.XXXXXX")
cleanup() { if [ "$KEEP" = "--keep" ]; then echo "check_wheel: scratch kept in $SCRATCH"; else rm -rf "$SCRATCH"; fi; }
trap cleanup EXIT
step() { echo "check_wheel [$SECONDS s]: $*"; }

# 1. a clean copy (tracked and new files, nothing ignored: no build/, no .venv, no egg-info),
#    so that a stale build directory cannot slip a file into the wheel
step "copying the source tree"
mkdir "$SCRATCH/src"
if git -C "$SRC_ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git -C "$SRC_ROOT" ls-files -z --cached --others --exclude-standard \
        | (cd "$SRC_ROOT" && tar --null --no-recursion -T - -cf -) | tar -xf - -C "$SCRATCH/src"
else
    tar -C "$SRC_ROOT" --exclude=.venv --exclude=build --exclude=dist --exclude='*.egg-info' \
        --exclude=__pycache__ -cf - . | tar -xf - -C "$SCRATCH/src"
fi

# 2. the wheel (pip's isolated build: setuptools and wheel come from the registry)
step "building the wheel"
"$PY" -m venv "$SCRATCH/venv"
VPY="$SCRATCH/venv/bin/python"
"$VPY" -m pip install -q torch==2.13.0
"$VPY" -m pip wheel -q --no-deps -w "$SCRATCH/dist" "$SCRATCH/src"
WHEEL=$(ls "$SCRATCH"/dist/mindspeed_ha-*.whl)
step "built $(basename "$WHEEL")"
"$VPY" - "$WHEEL" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
need = ["mindspeed_ha/__init__.py", "mindspeed_ha/recovery/__init__.py", "mindspeed_ha/control/__init__.py",
        "mindspeed_ha/patches/__init__.py", "mindspeed_ha/testing/trainer/__init__.py"]
missing = [n for n in need if n not in names]
stray = sorted({n.split("/")[0] for n in names if not n.startswith("mindspeed_ha")})
if missing or stray:
    raise SystemExit(f"check_wheel: the wheel lacks {missing} / ships top-level {stray}")
print(f"check_wheel: the wheel holds {len(names)} files, every subpackage included")
EOF

# 3. installed non-editable, as `pip install .` does
step "installing the wheel"
"$VPY" -m pip install -q "$WHEEL"
rm -rf "$SCRATCH/src"  # from here on nothing but the installed package exists

# 4. every module imports from site-packages, started from outside any source tree
mkdir "$SCRATCH/run"
cd "$SCRATCH/run"
unset PYTHONPATH
step "importing every module"
"$VPY" -W ignore::UserWarning - <<'EOF'
import importlib, os, pkgutil, sysconfig
import mindspeed_ha
site = os.path.realpath(sysconfig.get_paths()["purelib"])
names = [m.name for m in pkgutil.walk_packages(mindspeed_ha.__path__, "mindspeed_ha.")]
for name in names:
    mod = importlib.import_module(name)
    where = os.path.realpath(getattr(mod, "__file__", None) or next(iter(mod.__path__)))
    if not where.startswith(site + os.sep):
        raise SystemExit(f"check_wheel: {name} imported from {where}, not from {site}")
print(f"check_wheel: {len(names)} modules imported from {site}")
EOF

# 5. one 4-rank HA job with a fault, through the installed console scripts
step "mindspeed-ha demo --fault uce (4 ranks, baseline + faulty run)"
rc=0
${LOCK[@]+"${LOCK[@]}"} "$SCRATCH/venv/bin/mindspeed-ha" demo --fault uce --train-iters 8 --kill-iteration 4 --report demo.json \
    > demo.out 2>&1 || rc=$?
tail -n 20 demo.out
if [ "$rc" -ne 0 ]; then
    echo "check_wheel: the demo exited $rc" >&2
    exit 1
fi
"$VPY" - <<'EOF'
import json
s = json.load(open("demo.json"))
if s.get("loss_match") != "bitwise" or not s.get("recovered_in_process") or s.get("restarts") != 0:
    raise SystemExit(f"check_wheel: demo report: loss_match {s.get('loss_match')}, recovered_in_process "
                     f"{s.get('recovered_in_process')}, restarts {s.get('restarts')}")
print(f"check_wheel: recovered in process, losses bitwise equal; phases {s['phase_seconds']}")
EOF
step "passed"
}

main "$@"
