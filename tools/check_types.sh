#!/usr/bin/env bash
# Type-checks the weightsync package (python/weightsync, with the stub of the
# extension, _core.pyi) and examples/*.py with mypy, as CI does:
#
#   bash tools/check_types.sh            # .venv's python (bash run.sh test made it)
#   PYTHON=/path/to/python bash tools/check_types.sh
#
# Strict (every def typed, no implicit Any returns, no implicit re-exports,
# unused ignores reported) on the API modules (weightsync, ._api and the
# modules it re-exports: ._common, ._options, ._results, ._coordinator,
# ._publisher, ._subscriber; ._errors, ._tensors, ._cli) and on examples/; the
# other modules of the package (the torch, Megatron and engine integrations)
# are checked as they are
# typed (their bodies too), without requiring every def to be annotated.
# The source tree's package is checked, not an installed copy. Needs mypy
# (python/requirements-dev.txt); nothing is built or installed.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
py=${PYTHON:-$root/.venv/bin/python}
if ! "$py" -m mypy --version >/dev/null 2>&1; then
  echo "check_types.sh: no mypy for $py (pip install -r python/requirements-dev.txt," \
    "or bash run.sh test, which makes .venv with it)" >&2
  exit 2
fi

cfg=$(mktemp "${TMPDIR:-/tmp}/weightsync-mypy.XXXXXX.ini")
trap 'rm -f "$cfg"' EXIT
cat >"$cfg" <<EOF
[mypy]
python_version = 3.10
mypy_path = $root/python
warn_redundant_casts = True
warn_unused_ignores = True
strict_equality = True
extra_checks = True
check_untyped_defs = True
no_implicit_reexport = True
show_error_codes = True
pretty = False

# The API: strict.
[mypy-weightsync,weightsync._api,weightsync._common,weightsync._options,weightsync._results,weightsync._coordinator,weightsync._publisher,weightsync._subscriber,weightsync._errors,weightsync._tensors,weightsync._cli,engine_worker,fsdp2_trainer]
disallow_untyped_defs = True
disallow_incomplete_defs = True
disallow_untyped_decorators = True
disallow_any_generics = True
warn_return_any = True

# Not clean under mypy yet (owned elsewhere; their findings are listed by
# running this with these lines removed): checked, errors not reported.
[mypy-weightsync._engine,weightsync.vllm,weightsync._vllm_reload]
ignore_errors = True

# Engines and frameworks that are not installed where CI runs.
[mypy-vllm.*,sglang.*,megatron.*,transformers.*,safetensors.*,verl.*,ray.*,peft.*]
ignore_missing_imports = True
EOF
# The cache lives under .cache/ (ignored by git), the build folders untouched.
rc=0
"$py" -m mypy --config-file "$cfg" --cache-dir "$root/.cache/mypy" \
  python/weightsync examples "$@" || rc=$?

# The hand-written stub against the extension as built (the source tree's
# when a built _core is linked into python/weightsync, else the installed
# package's): nanobind's stubgen describes the module, and both must name the
# same functions, classes and members, with the same parameters. Skipped
# (with a note) where the extension or nanobind cannot be imported.
gen=$(mktemp -d "${TMPDIR:-/tmp}/weightsync-stubgen.XXXXXX")
trap 'rm -f "$cfg"; rm -rf "$gen"' EXIT
if ls python/weightsync/_core*.so >/dev/null 2>&1; then export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"; fi
if "$py" -m nanobind.stubgen -q -m weightsync._core -o "$gen/_core.pyi" >"$gen/log" 2>&1; then
  "$py" - "$gen/_core.pyi" python/weightsync/_core.pyi <<'PY' || rc=1
import ast
import sys


def members(path):
    """{name: parameter names (None: not a function)} of a stub, classes' members
    as Class.name; nanobind's unnamed parameters (argN) count by position."""
    out = {}

    def walk(body, prefix):
        for node in body:
            if isinstance(node, ast.ClassDef):
                out[prefix + node.name] = None
                walk(node.body, prefix + node.name + ".")
            elif isinstance(node, ast.FunctionDef):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg != "self"]
                out[prefix + node.name] = ["?" if n.startswith("arg") and n[3:].isdigit() else n
                                           for n in names]
    walk(ast.parse(open(path).read()).body, "")
    return {k: v for k, v in out.items()
            if not k.rsplit(".", 1)[-1].startswith("__") or k.endswith(".__init__")}


built, stub = members(sys.argv[1]), members(sys.argv[2])
problems = [f"{k}: in the extension, not in _core.pyi" for k in sorted(built.keys() - stub.keys())]
problems += [f"{k}: in _core.pyi, not in the extension" for k in sorted(stub.keys() - built.keys())]
for k in sorted(built.keys() & stub.keys()):
    b, s = built[k], stub[k]
    if (b is None) != (s is None) or (b is not None and (len(b) != len(s) or any(
            x != "?" and x != y for x, y in zip(b, s)))):
        problems.append(f"{k}: parameters {b} in the extension, {s} in _core.pyi")
for p in problems:
    print(f"python/weightsync/_core.pyi: error: {p}")
print(f"_core.pyi against the built extension: {len(problems)} differences", file=sys.stderr)
sys.exit(1 if problems else 0)
PY
else
  echo "check_types.sh: note: _core.pyi not compared with the extension (no importable" \
    "weightsync._core or nanobind: $(tail -n 1 "$gen/log"))" >&2
fi
exit $rc
