#!/usr/bin/env python3
"""tools/check_architecture.py fails on each kind of arrow against the rules.

On a copy of the repository's sources (never the tree itself): the copy as it
is passes; then one forbidden change at a time (an include up the layers, a
private header of another component, json.hpp in a public header, a public
header without an owner, a CMake dependency up the layers, a link up the
layers, a function declared in one library's public header and defined in
another's, a stale entry of the list of known arrows, two Python modules that import
each other) must make it fail,
naming the file and the rule.

    python3 check_rules_test.py SOURCE_DIR [BUILD_DIR]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", ".."))
COPIED = ["CMakeLists.txt", "include", "src", "engine_adapter", "trainer_adapter",
          "tools/weightsync", "tools/check_architecture.py", "tools/architecture_debts.txt",
          "python/src", "tests/core", "tests/layouts", "tests/pipeline", "tests/e2e",
          "tests/engine", "python/weightsync"]


def ignore(_dir, names):
    return [n for n in names if n in ("__pycache__",)]


class CheckRules(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="ws-arch-")
        for rel in COPIED:
            src, dst = os.path.join(ROOT, rel), os.path.join(self.tmp, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if os.path.isdir(src):
                shutil.copytree(src, dst, ignore=ignore)
            else:
                shutil.copy(src, dst)

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def check(self, *extra):
        script = os.path.join(self.tmp, "tools", "check_architecture.py")
        r = subprocess.run([sys.executable, script, "--root", self.tmp, *extra],
                           capture_output=True, text=True)
        return r.returncode, r.stdout + r.stderr

    def append(self, rel, text):
        with open(os.path.join(self.tmp, rel), "a", encoding="utf-8") as f:
            f.write(text)

    def replace(self, rel, old, new):
        path = os.path.join(self.tmp, rel)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        self.assertIn(old, text, f"{rel} no longer holds {old!r}: update the test")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text.replace(old, new, 1))

    def assert_fails(self, *needles, extra=()):
        rc, out = self.check(*extra)
        self.assertEqual(rc, 1, out)
        self.assertIn("architecture FAILED", out)
        for n in needles:
            self.assertIn(n, out)

    def test_the_copy_passes(self):
        rc, out = self.check()
        self.assertEqual(rc, 0, out)
        self.assertIn("architecture ok", out)

    def test_include_up_the_layers_fails(self):
        self.append("src/core/box.cpp", "\n#include <weightsync/publisher.h>\n")
        self.assert_fails("src/core/box.cpp:",
                          "core includes include/weightsync/publisher.h (trainer)")

    def test_transport_including_the_control_plane_fails(self):
        self.append("src/transport/transport.cpp", '\n#include "control/protocol.h"\n')
        self.assert_fails("src/transport/transport.cpp:", "transport includes src/control/protocol.h")

    def test_another_components_private_header_fails(self):
        self.append("engine_adapter/weights_delivery.cpp", '\n#include "layouts/layout_rules.h"\n')
        self.assert_fails("engine includes layouts's private header src/layouts/layout_rules.h")

    def test_json_hpp_in_a_public_header_fails(self):
        self.append("include/weightsync/box.h", "\n#include <nlohmann/json.hpp>\n")
        self.assert_fails("include/weightsync/box.h:", "includes nlohmann/json.hpp")

    def test_private_header_in_a_public_header_fails(self):
        self.append("include/weightsync/box.h", '\n#include "core/fp8.h"\n')
        self.assert_fails("a public header includes the private header src/core/fp8.h")

    def test_public_header_without_an_owner_fails(self):
        with open(os.path.join(self.tmp, "include/weightsync/unowned.h"), "w") as f:
            f.write("#pragma once\nnamespace weightsync { int unowned(); }\n")
        self.assert_fails("include/weightsync/unowned.h has no owner")

    def fake_build(self, sources):
        """libweightsync_<component>.a for each {component: C++ source}, or a
        skip where there is no compiler."""
        compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
        if not compiler or not shutil.which("ar") or not shutil.which("nm"):
            self.skipTest("needs a C++ compiler, ar and nm")
        build = os.path.join(self.tmp, "fake-build")
        os.makedirs(build, exist_ok=True)
        for comp, text in sources.items():
            cpp = os.path.join(build, comp + ".cpp")
            with open(cpp, "w") as f:
                f.write(text)
            obj = cpp[:-4] + ".o"
            subprocess.run([compiler, "-c", cpp, "-o", obj], check=True)
            lib = os.path.join(build, f"libweightsync_{comp}.a")
            if os.path.exists(lib):
                os.remove(lib)
            subprocess.run(["ar", "rcs", lib, obj], check=True)
        return build

    def test_function_of_a_shared_header_defined_above_its_owner_fails(self):
        # The hidden arrow: core's public header declares a function that the
        # layouts library defines. Layouts including core's header is allowed
        # and nothing in core calls the function yet, so neither the include
        # check nor the link check sees it; the header's owner does.
        decl = "\nnamespace weightsync {\nstruct Hidden {\n  static int make(int x);\n};\n" \
               "int hidden_generator(int x);\n}  // namespace weightsync\n"
        self.append("include/weightsync/box.h", decl)
        defs = ("namespace weightsync {\nstruct Hidden { static int make(int x); };\n"
                "int Hidden::make(int x) { return x; }\n"
                "int hidden_generator(int x) { return x + 1; }\n}\n")
        build = self.fake_build({"core": "int core_side() { return 0; }\n", "layouts": defs})
        rc, out = self.check()
        self.assertEqual(rc, 0, out)  # the includes and CMake alone show nothing
        # The fake libraries define none of the tree's known arrows: no list.
        no_debts = os.path.join(self.tmp, "no_debts.txt")
        open(no_debts, "w").close()
        symbols = ("--build", build, "--debts", no_debts)
        self.assert_fails(
            "include/weightsync/box.h (core) declares weightsync::hidden_generator, which "
            "layouts defines",
            "include/weightsync/box.h (core) declares weightsync::Hidden::make, which layouts "
            "defines", extra=symbols)
        self.assertNotIn("link ", self.check(*symbols)[1])
        # Declared in the header layouts owns, the same definitions pass.
        self.replace("include/weightsync/box.h", decl, "\n")
        self.append("include/weightsync/layouts.h", decl)
        rc, out = self.check(*symbols)
        self.assertEqual(rc, 0, out)

    def test_cmake_dependency_up_the_layers_fails(self):
        self.replace("src/core/CMakeLists.txt", "DEPS nlohmann_json::nlohmann_json",
                     "DEPS weightsync_engine nlohmann_json::nlohmann_json")
        self.assert_fails("target weightsync_core depends on weightsync_engine",
                          "the CMake targets form a cycle")

    def test_stale_entry_of_the_list_fails(self):
        self.append("tools/architecture_debts.txt",
                    "include src/core/box.cpp -> include/weightsync/control.h  # gone\n")
        self.assert_fails("no longer found (remove the line): include src/core/box.cpp")

    def test_python_import_circle_fails(self):
        # A lazy import inside a function closes the circle too (vllm.py
        # imports _vllm_transfer inside weight_transfer_engine_class).
        self.append("python/weightsync/_vllm_transfer.py",
                    "\n\ndef _later():\n    from .vllm import receive\n\n    return receive\n")
        self.assert_fails("the Python modules import each other in a circle: "
                          "weightsync.vllm -> weightsync._vllm_transfer -> "
                          "weightsync.vllm")

    def test_python_import_of_an_extension_is_no_arrow(self):
        # `from . import _core` names the compiled extension, not the package.
        self.append("python/weightsync/_errors.py", "\n\nfrom . import _core  # noqa\n")
        rc, out = self.check()
        self.assertEqual(rc, 0, out)

    def test_link_up_the_layers_fails(self):
        build = self.fake_build({
            "core": "void engine_side(); void core_side() { engine_side(); }\n",
            "engine": "void core_side(); void engine_side() {} void uses() { core_side(); }\n",
        })
        rc, out = self.check("--build", build)
        self.assertEqual(rc, 1, out)
        self.assertIn("uses 1 symbol(s) defined in engine, against the layers: engine_side()", out)
        self.assertNotIn("libweightsync_engine.a uses", out)  # engine -> core is allowed


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])
