"""The house rules of the product tree, checked on its source (parsed with ``ast``, never imported).

The product is ``mindspeed_ha/`` and the top-level ``patches/`` (shipped as
``mindspeed_ha.patches``; ``mindspeed_ha/patches`` is a symbolic link that is not walked
twice). Tests, scripts and examples are not product. Each rule is one test whose failure
lists every offender as ``path:line what``:

(a) no import cycle among mindspeed_ha modules. Every ``import`` statement counts, the
    function-level (lazy) ones included: a lazy import still binds the two modules
    together (the issue's two cycles, runtime <-> testing/injector and
    integrations/megatron_lm <-> recovery/torch_dist, were partly lazy). Imports under
    ``if TYPE_CHECKING:`` do not count: they never run. An import edge goes to the most
    specific module named (``from pkg import mod`` -> ``pkg.mod`` when that is a module,
    else ``pkg``); the implicit import of parent packages is not an edge.
(b) no product module outside ``mindspeed_ha/testing/`` imports ``mindspeed_ha.testing`` (one
    named exception, the command line front door: ``TESTING_FRONT_ENDS``).
(c) nothing touches another module's private names: the issue's check (``rt.``, ``proc.``,
    ``processor.``, ``runtime.`` followed by ``_[a-z]``, outside the module or package that
    defines the runtime / the processor) and, more generally, ``alias._name`` where
    ``alias`` is an imported mindspeed_ha module, and ``from mindspeed_ha.x import _name``.
(d) no class with more than 25 methods (every ``def`` in the class body counts).
(e) no product file over 600 lines, except the listed message catalogue(s).
(f) every environment variable name (a string constant, dict key or keyword name that is
    exactly ``MINDSPEED_HA_*`` or ``TTP_*``) is written only in ``mindspeed_ha/env.py``;
    messages that merely mention a name are fine.
(g) every exception class defined in the product derives from
    ``mindspeed_ha.errors.HAError``.
"""

from __future__ import annotations

import ast
import builtins
import functools
import os
import pathlib
import re
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Set, Tuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "mindspeed_ha"
TESTING = "mindspeed_ha.testing"
MAX_FILE_LINES = 600
MAX_CLASS_METHODS = 25
#: files allowed past MAX_FILE_LINES: path -> (their own limit, why)
LONG_FILES = {
    "mindspeed_ha/control/wire.py": (900, "the message catalogue: one dataclass per wire message type"),
}
#: where the runtime and the processor live (a module or a package of that name)
OWNERS = {
    "rt": "mindspeed_ha.runtime", "runtime": "mindspeed_ha.runtime",
    "proc": "mindspeed_ha.control.processor", "processor": "mindspeed_ha.control.processor",
}
ISSUE_GREP = re.compile(r"\b(rt|proc|processor|runtime)\._[a-z]")
ENV_NAME = re.compile(r"^(MINDSPEED_HA|TTP)_[A-Z0-9_]*$")
ENV_MODULE = "mindspeed_ha/env.py"


@dataclass
class Source:
    path: str                     # relative to the repository root, e.g. "patches/comm.py"
    module: str                   # dotted name, e.g. "mindspeed_ha.patches.comm"
    is_package: bool
    text: str
    tree: ast.Module
    imports: List[Tuple[str, int, List[str]]] = field(default_factory=list)  # (target, line, names)
    module_aliases: Dict[str, str] = field(default_factory=dict)  # local name -> mindspeed_ha module


def _product_files() -> Iterator[Tuple[str, str]]:
    """(path relative to ROOT, dotted module name) of every product ``.py`` file."""
    for top, prefix in (("mindspeed_ha", "mindspeed_ha"), ("patches", "mindspeed_ha.patches")):
        base = ROOT / top
        for dirpath, dirnames, filenames in os.walk(base):  # does not follow mindspeed_ha/patches
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            rel_dir = pathlib.Path(dirpath).relative_to(base)
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                parts = [p for p in rel_dir.parts] + ([] if name == "__init__.py" else [name[:-3]])
                yield (str(pathlib.Path(top) / rel_dir / name), ".".join([prefix] + parts))


def _type_checking_nodes(tree: ast.AST) -> Set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (never executed)."""
    out: Set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            t = node.test
            name = t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                for child in node.body:
                    out.update(id(n) for n in ast.walk(child))
    return out


@functools.lru_cache(maxsize=1)
def sources() -> Dict[str, Source]:
    """Every product module, parsed, by dotted name, with its resolved mindspeed_ha imports."""
    out: Dict[str, Source] = {}
    for path, module in _product_files():
        text = (ROOT / path).read_text(encoding="utf-8")
        out[module] = Source(path, module, path.endswith("__init__.py"), text, ast.parse(text, path))
    for src in out.values():
        skip = _type_checking_nodes(src.tree)
        for node in ast.walk(src.tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                for a in node.names:
                    target = _known(out, a.name)
                    if target:
                        src.imports.append((target, node.lineno, []))
                        if a.asname:
                            src.module_aliases[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(src, node)
                if not base or not (base == PACKAGE or base.startswith(PACKAGE + ".")):
                    continue
                plain = []
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    if sub in out:
                        src.imports.append((sub, node.lineno, []))
                        src.module_aliases[a.asname or a.name] = sub
                    else:
                        plain.append(a.name)
                if plain:
                    target = _known(out, base)
                    if target:
                        src.imports.append((target, node.lineno, plain))
    return out


def _absolute(src: Source, node: ast.ImportFrom) -> Optional[str]:
    if not node.level:
        return node.module
    parts = src.module.split(".")
    if not src.is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _known(mods: Dict[str, Source], name: str) -> Optional[str]:
    """The longest prefix of ``name`` that is a product module (None outside mindspeed_ha)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in mods:
            return candidate
        parts.pop()
    return None


def _report(rule: str, offenders: List[str]) -> str:
    return f"{rule}: {len(offenders)} offender(s)\n  " + "\n  ".join(offenders)


# ------------------------------------------------------------------------------------ (a)
def import_cycles() -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    mods = sources()
    graph = {m: sorted({t for t, _, _ in s.imports if t != m}) for m, s in mods.items()}
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    on_stack: Set[str] = set()
    stack: List[str] = []
    cycles: List[List[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    cycles.append(sorted(comp))
    return cycles


def test_no_import_cycle():
    mods = sources()
    offenders = []
    for comp in import_cycles():
        members = set(comp)
        edges = [f"{mods[m].path}:{line} -> {t}" for m in comp for t, line, _ in mods[m].imports
                 if t in members and t != m]
        offenders.append("cycle among " + ", ".join(comp) + "\n    " + "\n    ".join(sorted(set(edges))))
    assert not offenders, _report("(a) import cycles (lazy imports count)", offenders)


# ------------------------------------------------------------------------------------ (b)
#: the one module outside testing/ allowed to import it, and why: the command line's
#: ``demo`` and ``preprocess`` verbs are the front ends of the shipped test tools (the demo,
#: the built-in trainer's data preparation); each imports them lazily inside its verb
TESTING_FRONT_ENDS = {"mindspeed_ha.cli": "the demo and preprocess verbs run the shipped test tools"}


def test_no_product_module_imports_testing():
    offenders = [f"{s.path}:{line} imports {t}"
                 for s in sources().values() if not _in(s.module, TESTING) and s.module not in TESTING_FRONT_ENDS
                 for t, line, _ in s.imports if _in(t, TESTING)]
    assert not offenders, _report("(b) product -> mindspeed_ha.testing", sorted(offenders))


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


# ------------------------------------------------------------------------------------ (c)
def test_no_private_access_across_modules():
    offenders = []
    for s in sources().values():
        for lineno, line in enumerate(s.text.splitlines(), 1):
            for m in ISSUE_GREP.finditer(line):
                if not _in(s.module, OWNERS[m.group(1)]):
                    offenders.append(f"{s.path}:{lineno} {line.strip()[:100]}")
        for t, line, names in s.imports:
            for n in names:
                if _private(n):
                    offenders.append(f"{s.path}:{line} from {t} import {n}")
        for node in ast.walk(s.tree):
            if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                    and node.value.id in s.module_aliases and s.module_aliases[node.value.id] != s.module):
                offenders.append(f"{s.path}:{node.lineno} {node.value.id}.{node.attr} "
                                 f"({s.module_aliases[node.value.id]})")
    assert not offenders, _report("(c) private names used across modules", sorted(set(offenders)))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


# ------------------------------------------------------------------------------------ (d)
def test_no_class_over_25_methods():
    offenders = []
    for s in sources().values():
        for node in ast.walk(s.tree):
            if isinstance(node, ast.ClassDef):
                n = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
                if n > MAX_CLASS_METHODS:
                    offenders.append(f"{s.path}:{node.lineno} class {node.name}: {n} methods")
    assert not offenders, _report(f"(d) classes over {MAX_CLASS_METHODS} methods", sorted(offenders))


# ------------------------------------------------------------------------------------ (e)
def test_no_product_file_over_600_lines():
    offenders = []
    for s in sources().values():
        limit, _why = LONG_FILES.get(s.path, (MAX_FILE_LINES, ""))
        n = len(s.text.splitlines())
        if n > limit:
            offenders.append(f"{s.path}: {n} lines (limit {limit})")
    assert not offenders, _report("(e) product files too long", sorted(offenders))


def test_long_file_exceptions_exist():
    """An exception for a file that is gone is a stale rule."""
    missing = [p for p in LONG_FILES if not (ROOT / p).is_file()]
    assert not missing, f"LONG_FILES lists files that do not exist: {missing}"


# ------------------------------------------------------------------------------------ (f)
def test_environment_names_live_in_env_module():
    offenders = []
    for s in sources().values():
        if s.path == ENV_MODULE:
            continue
        for node in ast.walk(s.tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and ENV_NAME.match(node.value):
                offenders.append(f"{s.path}:{node.lineno} {node.value!r}")
            elif isinstance(node, ast.keyword) and node.arg and ENV_NAME.match(node.arg):
                offenders.append(f"{s.path}:{node.value.lineno} keyword {node.arg}=")
    assert not offenders, _report(f"(f) environment names outside {ENV_MODULE}", sorted(offenders))


def test_env_module_is_the_catalogue():
    """The rule's other half: env.py defines names, one constant each, no duplicates."""
    tree = sources()["mindspeed_ha.env"].tree
    values: Dict[str, str] = {}
    dupes = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            value = node.value.value
            name = node.targets[0].id  # type: ignore[attr-defined]
            if value in values:
                dupes.append(f"{value!r}: {values[value]} and {name}")
            values[value] = name
    assert values and not dupes, f"mindspeed_ha/env.py names a variable twice: {dupes}"


# ------------------------------------------------------------------------------------ (g)
_BUILTIN_EXC = {n for n in dir(builtins) if isinstance(getattr(builtins, n), type)
                and issubclass(getattr(builtins, n), BaseException)}


@functools.lru_cache(maxsize=1)
def _class_index() -> Dict[Tuple[str, str], Tuple[Source, ast.ClassDef]]:
    """(module, class name) -> its definition, nested classes included."""
    return {(s.module, node.name): (s, node) for s in sources().values()
            for node in ast.walk(s.tree) if isinstance(node, ast.ClassDef)}


def _imported_names(s: Source) -> Dict[str, Tuple[str, str]]:
    """local name -> (module, name) for ``from mindspeed_ha.x import Name [as local]``."""
    out = {}
    for node in ast.walk(s.tree):
        if isinstance(node, ast.ImportFrom):
            base = _absolute(s, node)
            if base and _in(base, PACKAGE):
                for a in node.names:
                    out[a.asname or a.name] = (base, a.name)
    return out


def _resolve_base(s: Source, base: ast.expr) -> Tuple[Optional[Tuple[str, str]], str]:
    """((module, class) of a product class, or None; the base's spelling)."""
    if isinstance(base, ast.Name):
        if (s.module, base.id) in _class_index():
            return (s.module, base.id), base.id
        return _imported_names(s).get(base.id), base.id
    if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
        mod = s.module_aliases.get(base.value.id)
        return ((mod, base.attr) if mod else None), f"{base.value.id}.{base.attr}"
    return None, ast.dump(base)


def _ancestry(key: Tuple[str, str], seen: Optional[Set] = None) -> Tuple[bool, bool]:
    """(is an exception, derives from HAError) for the product class ``key``."""
    if key == ("mindspeed_ha.errors", "HAError"):
        return True, True
    seen = set() if seen is None else seen
    idx = _class_index()
    if key not in idx or key in seen:
        # a re-export: follow ``from x import Name`` in that module
        if key[0] in sources() and key not in seen:
            seen.add(key)
            target = _imported_names(sources()[key[0]]).get(key[1])
            if target:
                return _ancestry(target, seen)
        return False, False
    seen.add(key)
    s, node = idx[key]
    is_exc = ha = False
    for b in node.bases:
        resolved, spelling = _resolve_base(s, b)
        if resolved:
            e, h = _ancestry(resolved, seen)
            is_exc, ha = is_exc or e, ha or h
        elif spelling.split(".")[-1] in _BUILTIN_EXC or re.search(r"(Error|Exception)$", spelling):
            is_exc = True
    return is_exc, ha


def test_every_exception_derives_from_haerror():
    offenders = []
    for (module, name), (s, node) in sorted(_class_index().items()):
        is_exc, ha = _ancestry((module, name))
        if is_exc and not ha:
            bases = ", ".join(_resolve_base(s, b)[1] for b in node.bases)
            offenders.append(f"{s.path}:{node.lineno} class {name}({bases})")
    assert not offenders, _report("(g) exception classes outside the HAError tree", offenders)


def test_the_layout_checker_sees_the_tree():
    """Guard against a checker that passes because it parsed nothing."""
    mods = sources()
    assert "mindspeed_ha.errors" in mods and "mindspeed_ha.patches.registry" in mods
    assert all(not s.path.startswith("mindspeed_ha/patches/") for s in mods.values())
    assert any(t == "mindspeed_ha.errors" for s in mods.values() for t, _, _ in s.imports)
