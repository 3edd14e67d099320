#!/usr/bin/env python3
"""The dependency rules of docs/architecture.md, checked.

Four graphs are checked against one table of layers (LAYERS below):

- the include graph of the C++ sources and headers (every #include of a
  weightsync header, public or private, resolved to the file it names);
- the CMake targets' dependencies (weightsync_add_library DEPS and
  target_link_libraries between weightsync_* targets), which must form a DAG;
- the imports between the Python package's modules (python/weightsync/,
  lazy imports inside functions included), which must form a DAG too;
- with --build DIR, the libraries' symbols: an undefined symbol of one
  library that another library defines is a link arrow, and it must be one
  the layers allow (this is what a hidden link cycle looks like).

Plus the rules of the public headers: they include only public headers and
the standard library, and name JSON through nlohmann/json_fwd.hpp.

Arrows that break a rule today and are known are listed in
tools/architecture_debts.txt, each with the reason it is still there. A new
arrow against the rules fails, and so does a listed one that is gone (the list
only shrinks: remove the line). Exit status 0 when clean, 1 otherwise.

    python3 tools/check_architecture.py [--root DIR] [--build DIR] [--graph]
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import subprocess
import sys

# Component of each source folder (relative to the repository root).
FOLDERS = {
    "src/core": "core",
    "src/layouts": "layouts",
    "src/control": "control",
    "src/transport": "transport",
    "src/pipeline": "pipeline",
    "engine_adapter": "engine",
    "trainer_adapter": "trainer",
    "tools/weightsync": "cli",
    "python/src": "python",
    "tests": "tests",
}

# The component that implements each public header (include/weightsync/):
# every public header is named here, and every function it declares is
# defined by its owner (with --build, from the libraries' symbols). A header
# missing from this table fails the check, and so does a name here whose
# header is gone.
PUBLIC_OWNER = {
    "backend/transport.h": "transport",
    "box.h": "core",
    "checksum.h": "core",
    "control.h": "control",
    "dtype.h": "core",
    "engine_layout.h": "core",
    "error.h": "core",
    "hf_checkpoint.h": "core",
    "hf_model.h": "core",
    "json_fields.h": "core",
    "layouts.h": "layouts",
    "load_spec.h": "core",
    "materialize.h": "core",
    "plan.h": "core",
    "plan_options.h": "core",
    "publisher.h": "trainer",
    "safetensors.h": "core",
    "store.h": "core",
    "subscriber.h": "engine",
    "tensor.h": "core",
    "topology.h": "core",
    "trace.h": "core",
    "wire_options.h": "core",
}

# What each component may use, directly. Arrows point down; anything not
# listed is forbidden. The CMake targets of the libraries are named after them.
LAYERS = {
    "core": set(),
    "layouts": {"core"},
    "control": {"core"},
    "transport": {"core"},
    "pipeline": {"core", "layouts", "transport", "control"},
    "engine": {"core", "layouts", "control", "transport", "pipeline"},
    "trainer": {"core", "layouts", "control", "transport", "pipeline"},
    "cli": {"core", "layouts", "control", "transport", "pipeline", "engine", "trainer"},
    "python": {"core", "layouts", "control", "transport", "pipeline", "engine", "trainer"},
    "tests": {"core", "layouts", "control", "transport", "pipeline", "engine", "trainer",
              "cli"},
}

# Private headers that the components above their own may include (those the
# layers allow): the data path's internals, shared by the product libraries and
# the command's benchmarks, installed nowhere. Any other private header is its
# component's alone (tests aside).
SHARED_INTERNALS = {
    "src/core/checksum_stream.h",
    "src/core/copy_program.h",
    "src/core/cuda/gpu.h",
    "src/core/delta.h",
    "src/core/first_fit.h",
    "src/core/fp8.h",
    "src/core/random_checkpoint.h",
    "src/core/wire_sum.h",
    "src/core/writer_layout.h",
    "src/pipeline/copier.h",
    "src/pipeline/delta_frame.h",
    "src/pipeline/item_copies.h",
    "src/pipeline/loop.h",
    "src/pipeline/setup.h",
    "src/pipeline/wire.h",
    "src/transport/fault/freeze_points.h",
    "src/transport/staging.h",
}

TARGETS = {f"weightsync_{c}": c for c in
           ("core", "layouts", "control", "transport", "pipeline", "engine", "trainer")}

INCLUDE_RE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)
SOURCE_EXT = (".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh")


def component_of(rel: str) -> str | None:
    if rel.startswith("include/weightsync/"):
        return PUBLIC_OWNER.get(rel[len("include/weightsync/"):])  # None: check_owners says
    best = None
    for folder, comp in FOLDERS.items():
        if rel == folder or rel.startswith(folder + "/"):
            if best is None or len(folder) > len(best[0]):
                best = (folder, comp)
    return best[1] if best else None


def sources(root: str) -> list[str]:
    out = []
    for top in ["include/weightsync"] + list(FOLDERS):
        base = os.path.join(root, top)
        for dirpath, _, files in os.walk(base):
            for f in files:
                if f.endswith(SOURCE_EXT):
                    out.append(os.path.relpath(os.path.join(dirpath, f), root))
    return sorted(set(out))


def resolve(root: str, rel: str, quote: str, name: str) -> str | None:
    """The repository file an #include names, or None for an outside header."""
    if name.startswith("weightsync/"):
        return "include/" + name
    if quote == '"':
        here = os.path.normpath(os.path.join(os.path.dirname(rel), name))
        if os.path.isfile(os.path.join(root, here)):
            return here
        for base in ("src", "."):
            cand = os.path.normpath(os.path.join(base, name))
            if os.path.isfile(os.path.join(root, cand)):
                return cand
    return None


def include_arrows(root: str):
    """(from file, to file or outside header, line) for every include."""
    for rel in sources(root):
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            text = f.read()
        for m in INCLUDE_RE.finditer(text):
            line = text.count("\n", 0, m.start(2)) + 1
            target = resolve(root, rel, m.group(1), m.group(2))
            yield rel, target if target else "<" + m.group(2) + ">", line


def check_includes(root: str):
    """Violations as (key, message); and the component graph seen."""
    found = []
    graph = collections.Counter()
    for src, dst, line in include_arrows(root):
        a = component_of(src)
        public_src = src.startswith("include/weightsync/")
        if dst.startswith("<"):
            if public_src and dst == "<nlohmann/json.hpp>":
                found.append((f"public-json {src}",
                              f"{src}:{line}: a public header includes nlohmann/json.hpp; "
                              "name JSON through <nlohmann/json_fwd.hpp>"))
            continue
        b = component_of(dst)
        if a is None or b is None:
            continue
        if public_src and not dst.startswith("include/weightsync/"):
            found.append((f"public-private {src} -> {dst}",
                          f"{src}:{line}: a public header includes the private header {dst}"))
        if a != b:
            graph[(a, b)] += 1
            if b not in LAYERS[a]:
                found.append((f"include {src} -> {dst}",
                              f"{src}:{line}: {a} includes {dst} ({b}); "
                              f"{a} may use only {sorted(LAYERS[a]) or 'nothing else'}"))
            elif (not dst.startswith("include/") and a != "tests"
                  and dst not in SHARED_INTERNALS):
                # Another component's private header: its internals.
                found.append((f"private {src} -> {dst}",
                              f"{src}:{line}: {a} includes {b}'s private header {dst}"))
    return found, graph


def public_headers(root: str) -> list[str]:
    """The public headers, relative to include/weightsync/."""
    base = os.path.join(root, "include", "weightsync")
    out = []
    for dirpath, _, files in os.walk(base):
        out += [os.path.relpath(os.path.join(dirpath, f), base) for f in files if f.endswith(".h")]
    return sorted(out)


def check_owners(root: str):
    """Every public header has its owner in PUBLIC_OWNER, and every entry a header."""
    found = []
    headers = public_headers(root)
    for h in headers:
        if h not in PUBLIC_OWNER:
            found.append((f"owner include/weightsync/{h}",
                          f"include/weightsync/{h} has no owner: name the library that "
                          "implements it in PUBLIC_OWNER (tools/check_architecture.py)"))
    for h, owner in sorted(PUBLIC_OWNER.items()):
        if h not in headers:
            found.append((f"owner include/weightsync/{h}",
                          f"PUBLIC_OWNER names include/weightsync/{h} ({owner}), which does "
                          "not exist: remove the entry"))
        elif owner not in LAYERS:
            found.append((f"owner include/weightsync/{h}",
                          f"PUBLIC_OWNER gives include/weightsync/{h} to {owner!r}, which is "
                          "no component"))
    return found


NOT_A_NAME = {
    "alignas", "alignof", "auto", "bool", "catch", "char", "const", "constexpr", "decltype",
    "double", "explicit", "float", "for", "if", "int", "long", "noexcept", "operator",
    "requires", "return", "short", "signed", "sizeof", "static_assert", "switch", "throw",
    "typeid", "unsigned", "void", "while",
}
TOKEN_RE = re.compile(r"[A-Za-z_]\w*|::|\S")


def strip_code(text: str) -> str:
    """The text without comments, string and character literals, preprocessor lines."""
    text = re.sub(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'',
                  " ", text, flags=re.S)
    return re.sub(r"^\s*#.*(?:\\\n.*)*", " ", text, flags=re.M)


def declared_functions(text: str) -> set[str]:
    """Qualified names (weightsync::Class::name) of the functions a header declares.

    A scanner, not a parser: namespaces and class bodies are followed through
    their braces, any other brace (a function body, an initializer, an enum)
    is skipped, and a name followed by "(" in a namespace or class scope is a
    declaration. Names in unnamed namespaces are left out."""
    tok = TOKEN_RE.findall(strip_code(text))
    scopes: list[str | None] = []  # namespace or class names; None: anything else
    names = set()
    i = 0
    while i < len(tok):
        t = tok[i]
        open_scope = all(sc is not None for sc in scopes)
        if t == "namespace" and open_scope:
            j, parts = i + 1, []
            while j < len(tok) and tok[j] not in ("{", ";", "="):
                if tok[j] not in ("::", "inline"):
                    parts.append(tok[j])
                j += 1
            if j < len(tok) and tok[j] == "{":
                scopes.append("::".join(parts) if parts else None)
            i = j + 1
            continue
        if t in ("class", "struct", "union") and open_scope and (i == 0 or tok[i - 1] != "enum"):
            j, name = i + 1, None
            while j < len(tok) and tok[j] not in ("{", ";", ":", "(", ")", ",", ">", "="):
                if re.match(r"[A-Za-z_]", tok[j]) and tok[j] != "final":
                    name = tok[j]
                j += 1
            if j < len(tok) and tok[j] == ":":  # a base clause
                while j < len(tok) and tok[j] not in ("{", ";"):
                    j += 1
            if j < len(tok) and tok[j] == "{" and name:
                scopes.append(name)
                i = j + 1
                continue
            i = j
            continue
        if t == "{":
            scopes.append(None)
        elif t == "}":
            if scopes:
                scopes.pop()
        elif (open_scope and scopes and i + 1 < len(tok) and tok[i + 1] == "("
              and re.match(r"[A-Za-z_]", t) and t not in NOT_A_NAME
              and tok[i - 1] not in (".", "->", "=", "return")):
            name = "~" + t if tok[i - 1] == "~" else t
            k = i - 1 - (tok[i - 1] == "~")
            while k >= 1 and tok[k] == "::" and re.match(r"[A-Za-z_]", tok[k - 1]):
                name = tok[k - 1] + "::" + name  # Class::name declared out of its class
                k -= 2
            names.add("::".join(scopes + [name]))
        i += 1
    return names


def symbol_name(demangled: str) -> str | None:
    """weightsync::Class::name of a demangled function symbol (no parameters,
    template arguments or ABI tags); None for operators and anything else."""
    s = re.sub(r"\[abi:\w+\]", "", demangled)
    if "operator" in s or "(anonymous namespace)" in s:
        return None
    depth, out = 0, []
    for c in s:
        if c == "(" and depth == 0:
            break
        if c == "<":
            depth += 1
        elif c == ">":
            depth -= 1
        elif depth == 0:
            out.append(c)
    else:
        return None  # not a function
    name = "".join(out).split(" ")[-1]  # after a template's return type
    return name if name.startswith("weightsync::") else None


def check_definers(root: str, functions: dict[str, set[str]]):
    """A function a public header declares is defined by the header's owner.

    `functions` maps each library's defined functions (demangled) to it. The
    include check sees a library include the header of a library below it,
    which is allowed; it cannot see that the header declares a function a
    library above defines. This is that arrow, found where it is defined,
    whether or not anything calls it yet. A name declared in several headers
    (overloads) passes when one of them is its definer's."""
    declared = collections.defaultdict(set)
    for h in public_headers(root):
        with open(os.path.join(root, "include", "weightsync", h), encoding="utf-8") as f:
            for name in declared_functions(f.read()):
                declared[name].add(h)
    found = []
    for comp, syms in sorted(functions.items()):
        for sym in sorted(syms):
            name = symbol_name(sym)
            headers = declared.get(name or "", set())
            if not headers or any(PUBLIC_OWNER.get(h) == comp for h in headers):
                continue
            h = sorted(headers)[0]
            found.append((f"define {name} in {comp} -> include/weightsync/{h}",
                          f"include/weightsync/{h} ({PUBLIC_OWNER.get(h, 'no owner')}) declares "
                          f"{name}, which {comp} defines: a public header declares only what "
                          f"its owner defines (move the declaration to a header of {comp}, "
                          "or the definition to the owner)"))
    return found


CALL_RE = re.compile(r"(weightsync_add_library|target_link_libraries)\s*\(([^)]*)\)", re.S)


def cmake_arrows(root: str):
    edges = set()
    for rel in ["CMakeLists.txt"] + [f + "/CMakeLists.txt" for f in FOLDERS]:
        path = os.path.join(root, rel)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            text = re.sub(r"#.*", "", f.read())
        for m in CALL_RE.finditer(text):
            words = m.group(2).split()
            if not words or words[0] not in TARGETS:
                continue
            for w in words[1:]:
                if w in TARGETS and w != words[0]:
                    edges.add((words[0], w, rel))
    return edges


def check_cmake(root: str):
    found = []
    edges = cmake_arrows(root)
    for a, b, rel in sorted(edges):
        if TARGETS[b] not in LAYERS[TARGETS[a]]:
            found.append((f"cmake {a} -> {b}",
                          f"{rel}: target {a} depends on {b}, against the layers"))
    # A DAG: depth-first search for a cycle.
    succ = collections.defaultdict(set)
    for a, b, _ in edges:
        succ[a].add(b)
    state = {}

    def visit(n, path):
        state[n] = 1
        for m in sorted(succ[n]):
            if state.get(m) == 1:
                cyc = path[path.index(m):] + [m] if m in path else [n, m]
                found.append((f"cmake-cycle {' -> '.join(cyc)}",
                              f"the CMake targets form a cycle: {' -> '.join(cyc)}"))
            elif m not in state:
                visit(m, path + [m])
        state[n] = 2

    for n in sorted(succ):
        if n not in state:
            visit(n, [n])
    return found, edges


PYTHON_PACKAGE = "python/weightsync"


def python_modules(root: str) -> dict[str, str]:
    """{dotted module name: file} of the Python package's modules."""
    base = os.path.join(root, PYTHON_PACKAGE)
    top = os.path.basename(PYTHON_PACKAGE)
    out = {}
    for dirpath, _, files in os.walk(base):
        for f in files:
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), base)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join([top] + rel)] = os.path.join(dirpath, f)
    return out


def python_import_arrows(root: str):
    """(importer, imported, line) for every import of one of the package's
    modules by another, wherever the statement is (a function's lazy import
    is an arrow too: it only moves the circle to run time). Importing a
    submodule does not count as an arrow to its parent package."""
    import ast

    modules = python_modules(root)
    # Every name a file or folder of a package gives a submodule (extensions
    # and stubs included).
    submodules = set(modules)
    for name, path in modules.items():
        if os.path.basename(path) == "__init__.py":
            submodules |= {f"{name}.{f.split('.')[0]}" for f in os.listdir(os.path.dirname(path))}
    for name, path in sorted(modules.items()):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        is_package = os.path.basename(path) == "__init__.py"
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = name.split(".")
                    keep = len(parts) - node.level + (1 if is_package else 0)
                    base = ".".join(parts[:keep] + ([base] if base else []))
                # `from pkg import mod` names a submodule (a .py file, or an
                # extension such as _core: no arrow); `from mod import x` the module.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in submodules else base
                           for a in node.names]
            for t in targets:
                if t in modules and t != name:
                    yield name, t, node.lineno


def check_python_imports(root: str):
    """The package's modules import each other without a circle."""
    succ = collections.defaultdict(dict)
    for a, b, line in python_import_arrows(root):
        succ[a].setdefault(b, line)
    found = []
    state: dict[str, int] = {}

    def visit(n, path):
        state[n] = 1
        for m in sorted(succ[n]):
            if state.get(m) == 1:
                cyc = path[path.index(m):] + [m]
                where = ", ".join(f"{x} line {succ[x][y]}" for x, y in zip(cyc, cyc[1:]))
                found.append((f"python-cycle {' -> '.join(cyc)}",
                              f"the Python modules import each other in a circle: "
                              f"{' -> '.join(cyc)} ({where}); move what both need into a "
                              "module that imports neither"))
            elif m not in state:
                visit(m, path + [m])
        state[n] = 2

    for n in sorted(succ):
        if n not in state:
            visit(n, [n])
    return found


def nm(args: list[str]) -> list[str]:
    return subprocess.run(["nm", "-C"] + args, capture_output=True, text=True,
                          check=True).stdout.splitlines()


def check_symbols(root: str, build: str):
    libs = {}
    for target, comp in TARGETS.items():
        hits = glob.glob(os.path.join(build, "**", f"lib{target}.a"), recursive=True)
        if hits:
            libs[comp] = hits[0]
    defined = collections.defaultdict(set)
    functions = collections.defaultdict(set)
    for comp, path in libs.items():
        for line in nm(["-g", "--defined-only", path]):
            parts = line.split(" ", 2)
            if len(parts) == 3 and parts[1] in "TDBR":
                defined[parts[2]].add(comp)
                if parts[1] == "T":
                    functions[comp].add(parts[2])
    found = check_definers(root, functions)
    arrows = collections.defaultdict(set)
    for comp, path in libs.items():
        for line in nm(["-u", path]):
            sym = line.strip()[2:] if line.strip().startswith("U ") else line.strip()
            owners = defined.get(sym, set())
            if comp in owners or len(owners) != 1:
                continue
            other = next(iter(owners))
            arrows[(comp, other)].add(sym)
    for (a, b), syms in sorted(arrows.items()):
        if b not in LAYERS[a]:
            found.append((f"link {a} -> {b}",
                          f"{libs[a]} uses {len(syms)} symbol(s) defined in {b}, against the "
                          f"layers: {', '.join(sorted(syms)[:3])}"))
    return found, {k: len(v) for k, v in arrows.items()}, sorted(libs)


def read_debts(path: str) -> dict[str, str]:
    debts = {}
    if not os.path.isfile(path):
        return debts
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            key, _, why = line.partition("  # ")
            if not why.strip():
                sys.exit(f"{path}:{n}: every listed arrow needs its reason after '  # '")
            debts[key.strip()] = why.strip()
    return debts


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=os.path.dirname(here), help="the repository root")
    ap.add_argument("--build", help="a build folder: also check the libraries' symbols")
    ap.add_argument("--debts", help="the list of known arrows (default: "
                    "ROOT/tools/architecture_debts.txt)")
    ap.add_argument("--graph", action="store_true",
                    help="print the arrows between components, with counts")
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    debts = read_debts(args.debts or os.path.join(root, "tools", "architecture_debts.txt"))

    found, graph = check_includes(root)
    found += check_owners(root)
    cm_found, edges = check_cmake(root)
    found += cm_found
    found += check_python_imports(root)
    checked = ["includes", "cmake targets", "python imports"]
    if args.build:
        sym_found, links, libs = check_symbols(root, args.build)
        if not libs:
            print(f"no weightsync libraries under {args.build}", file=sys.stderr)
            return 1
        found += sym_found
        checked.append(f"symbols of {len(libs)} libraries")

    if args.graph:
        print("include arrows between components (count of #include lines):")
        for (a, b), n in sorted(graph.items()):
            mark = "" if b in LAYERS[a] else "   <- against the layers"
            print(f"  {a:>9} -> {b:<9} {n:4d}{mark}")
        print("cmake target arrows:")
        for a, b, _ in sorted(edges):
            print(f"  {a} -> {b}")
        if args.build:
            print("link arrows (undefined symbols resolved in another library):")
            for (a, b), n in sorted(links.items()):
                mark = "" if b in LAYERS[a] else "   <- against the layers"
                print(f"  {a:>9} -> {b:<9} {n:4d}{mark}")

    keys = {}
    for key, msg in found:
        keys.setdefault(key, msg)
    new = [msg for key, msg in keys.items() if key not in debts]
    # Arrows of the symbols are only found with --build: without it, their
    # entries are neither found nor gone.
    gone = [key for key in debts if key not in keys
            and (args.build or not key.startswith(("link ", "define ")))]
    known = len(keys) - len(new)
    for msg in new:
        print("architecture: " + msg, file=sys.stderr)
    for key in gone:
        print(f"architecture: listed in architecture_debts.txt but no longer found (remove "
              f"the line): {key}", file=sys.stderr)
    status = "ok" if not new and not gone else "FAILED"
    print(f"architecture {status}: checked {', '.join(checked)}; {len(new)} new arrow(s) "
          f"against the rules, {known} known (architecture_debts.txt), {len(gone)} listed "
          f"but gone")
    return 0 if status == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
