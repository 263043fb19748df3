#!/usr/bin/env bash
# The production install, proved: build the wheel from a clean copy of this tree, install it
# NON-editable into a fresh venv, import every module of the installed package
# (pkgutil.walk_packages), then run one HA job with a fault from the installed wheel, in a
# directory outside the source tree so that the tree cannot be imported:
# `mindspeed-ha demo --fault uce` on 2 ranks (DP2, the UCE repaired in place from the other
# replica) must exit 0, recover in the running processes and match the uninterrupted run's
# losses bit for bit.
#
#     scripts/check_wheel.sh [--keep] [--lock FILE] [--deps-from VENV]
#
# --keep: leave the scratch directory (printed); --lock FILE: run the job under
# `flock FILE` (a shared machine's lock for multi-process runs; the install needs none);
# --deps-from VENV: the dependencies (torch, megatron-core, pyzmq, ...) are not installed
# again but taken from VENV: scripts/deps_view.py symlinks the distributions of the closure
# of the wheel's Requires-Dist (and nothing else of VENV: an undeclared import still fails)
# into one directory, which a `.pth` line in the fresh venv names, added after the wheel
# went in with `pip install --no-deps`; `pip check` proves the wheel's requirements met; the
# wheel is built with VENV's setuptools (no isolated build env). `.ci/run` passes the venv
# its first part installed from the same setup.cfg. The editable install VENV may hold is
# not in that closure, and the import check fails on any module not imported from the
# fresh venv.
#
# Without --deps-from: torch==2.13.0 first (so pip keeps the CPU build), then the wheel with
# its dependencies from the package registry (or its cache), an isolated build.
# Cost (2026-12-05, CPU-seconds): the demo 23.6 on 2 ranks x 4 iterations (51.8 on
# 4 ranks x 8 before); with --deps-from the install is seconds instead of about 60 s wall of
# pip resolving and unpacking megatron-core's dependencies and torch.
set -euo pipefail

# one function, read whole before it runs (editing this file during a run cannot change it)
main() {
cd "$(dirname "$0")/.."
SRC_ROOT=$PWD
PY=${PYTHON:-python3}
KEEP=""
LOCK=()
DEPS=""
while [ $# -gt 0 ]; do
    case "$1" in
        --keep) KEEP=--keep; shift ;;
        --lock) LOCK=(flock "$2"); shift 2 ;;
        --deps-from) DEPS=$(cd "$2" && pwd); shift 2 ;;
        *) echo "usage: $0 [--keep] [--lock FILE] [--deps-from VENV]" >&2; exit 2 ;;
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

# 2. the wheel
step "building the wheel"
if [ -n "$DEPS" ]; then
    DPY="$DEPS/bin/python"
    "$PY" -m venv --without-pip "$SCRATCH/venv"
    VPY="$SCRATCH/venv/bin/python"
    want=$("$DPY" -c 'import sys; print(sys.version_info[:2])')
    have=$("$VPY" -c 'import sys; print(sys.version_info[:2])')
    if [ "$want" != "$have" ]; then
        echo "check_wheel: --deps-from $DEPS: its python is $want, the fresh venv's $have" >&2
        exit 2
    fi
    PIP=("$DPY" -m pip --python "$VPY")  # VENV's pip, run on (and installing into) the fresh venv
    "$DPY" -m pip wheel -q --no-deps --no-build-isolation -w "$SCRATCH/dist" "$SCRATCH/src"
else
    "$PY" -m venv "$SCRATCH/venv"
    VPY="$SCRATCH/venv/bin/python"
    PIP=("$VPY" -m pip)
    "${PIP[@]}" install -q torch==2.13.0
    "${PIP[@]}" wheel -q --no-deps -w "$SCRATCH/dist" "$SCRATCH/src"  # isolated: setuptools, wheel from the registry
fi
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
if [ -n "$DEPS" ]; then
    "${PIP[@]}" install -q --no-deps "$WHEEL"
    # the closure of the wheel's Requires-Dist in VENV, symlinked into one directory: the
    # fresh venv sees those distributions and nothing else of VENV
    "$DPY" "$SRC_ROOT/scripts/deps_view.py" "$WHEEL" "$SCRATCH/deps"
    echo "$SCRATCH/deps" > "$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/mindspeed_ha_check_deps.pth"
    "${PIP[@]}" check  # every requirement of the installed wheel met
else
    "${PIP[@]}" install -q "$WHEEL"
fi
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
step "mindspeed-ha demo --fault uce (2 ranks, DP2, baseline + faulty run)"
rc=0
${LOCK[@]+"${LOCK[@]}"} "$SCRATCH/venv/bin/mindspeed-ha" demo --fault uce --nproc 2 --pipeline-model-parallel-size 1 \
    --train-iters 4 --kill-iteration 3 --report demo.json \
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
