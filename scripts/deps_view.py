"""A directory that shows only what a wheel declares it needs, taken from an existing venv.

    VENV/bin/python scripts/deps_view.py WHEEL OUT_DIR

Run with the Python of the venv the dependencies are installed in (``check_wheel.sh
--deps-from``). Reads the wheel's ``Requires-Dist`` (markers evaluated for this interpreter,
no extra), follows each requirement's own ``Requires-Dist`` through the venv's installed
distributions (the extras a requirement names included), and symlinks every top-level
entry (package, module, ``.dist-info``, ``.libs``) of those distributions' RECORD into
``OUT_DIR``. A ``.pth`` line naming ``OUT_DIR`` then shows a fresh venv those distributions
and nothing else of the venv: a module the package imports without declaring it fails the
import check as it would after ``pip install`` of the wheel.

Exit 2 (naming it) when a requirement is not installed in the venv.
"""

import importlib.metadata as md
import os
import sys
import zipfile

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name


def wheel_requirements(path):
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(name).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def wanted(req, extras):
    """The requirement's marker holds for this interpreter and one of ``extras`` ("" = none)."""
    return req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras)


def closure(requirements):
    seen = {}
    todo = [(Requirement(r), {""}) for r in requirements]  # (requirement, extras of who asked)
    while todo:
        req, parent_extras = todo.pop()
        if not wanted(req, parent_extras):
            continue
        key = canonicalize_name(req.name)
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            raise SystemExit(f"deps_view: {req} is not installed in {sys.prefix}") from None
        extras = set(req.extras) | {""}
        if key in seen and extras <= seen[key][1]:
            continue
        seen[key] = (dist, extras | (seen[key][1] if key in seen else set()))
        todo += [(Requirement(r), extras) for r in dist.requires or ()]
    return [dist for dist, _ in seen.values()]


def main(wheel, out):
    os.makedirs(out)
    tops = {}
    for dist in closure(wheel_requirements(wheel)):
        base = os.path.realpath(str(dist.locate_file("")))
        for f in dist.files or ():
            parts = f.parts
            if parts and parts[0] != ".." and not parts[0].endswith(".pth"):
                tops[parts[0]] = os.path.join(base, parts[0])
    for name, src in sorted(tops.items()):
        if os.path.exists(src):
            os.symlink(src, os.path.join(out, name))
    print(f"check_wheel: {len(tops)} entries of the wheel's declared dependencies shown from {sys.prefix}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(2)
    main(sys.argv[1], sys.argv[2])
