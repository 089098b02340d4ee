"""The Python package's copy of include/strata.h, checked against the header field by field.

A C program compiled against the header prints every struct's size and each field's offset and
size, and every STRATA_* constant's value (sizeof, offsetof and the constants as the C compiler
sees them); the ctypes structures (strata._lib, strata.kv, strata.harvest, strata.params,
strata._swapper) must have the same fields in the same order at the same offsets with the same
sizes, and the Python constants (strata.Status among them) the same values. A struct or a
constant added to the header without its Python copy fails here too. The C compiler is $CC or cc.
"""

import ctypes
import os
import re
import shutil
import subprocess
import tempfile
import unittest

import strata
from strata import _lib, harvest, kv, params

try:
    from strata import _swapper
except ImportError as e:  # Pie's structures live in strata._swapper, which needs torch
    _swapper = None
    NO_SWAPPER = f"needs torch (strata._swapper imports it): {e}"
from strata._status import Status

HERE = os.path.dirname(os.path.abspath(__file__))
INCLUDE = os.path.join(os.path.dirname(os.path.dirname(HERE)), "include")
HEADER = os.path.join(INCLUDE, "strata.h")

# Every struct the header defines -> its ctypes copy.
STRUCTS = {
    "strata_stats_t": _lib.Stats,
    "strata_tag_stats_t": _lib.TagStats,
    "strata_revoked_t": _lib.Revoked,
    "strata_spill_stats_t": _lib.SpillStats,
    "strata_harvest_handle_t": harvest.Handle,
    "strata_harvest_hints_t": harvest.Hints,
    "strata_kv_config_t": kv.Config,
    "strata_kv_tensor_t": kv.TensorDesc,
    "strata_kv_request_info_t": kv.RequestInfo,
    "strata_kv_stats_t": kv.Stats,
    "strata_kv_token_copy_t": kv.TokenCopy,
    "strata_pie_decision_t": _swapper and _swapper._Decision,
    "strata_pie_overlap_t": _swapper and _swapper.Overlap,
    "strata_params_model_stats_t": params.ModelStats,
}

_RESIDENCY = {name: code for code, name in kv._RESIDENCY.items()}

# Every STRATA_* constant of the header (but the include guard) -> its Python copies.
CONSTANTS = {
    **{s.c_name: [s.value] for s in Status},
    "STRATA_HARVEST_BACKED": [harvest.BACKED],
    "STRATA_HARVEST_LOSSY": [harvest.LOSSY],
    "STRATA_KV_BACKED": [kv.BACKED],
    "STRATA_KV_LOSSY": [kv.LOSSY],
    "STRATA_KV_K": [kv._KINDS["k"]],
    "STRATA_KV_V": [kv._KINDS["v"]],
    "STRATA_TIER_HOST": [kv._TIERS["host"], strata._TIERS["host"]],
    "STRATA_TIER_DISK": [kv._TIERS["disk"], strata._TIERS["disk"]],
    "STRATA_KV_RESIDENT": [_RESIDENCY["device"]],
    "STRATA_KV_IN_HOST": [_RESIDENCY["host"]],
    "STRATA_KV_ON_DISK": [_RESIDENCY["disk"]],
    "STRATA_KV_LOST": [_RESIDENCY["lost"]],
    "STRATA_KV_COPY_IN": [kv._DIRECTIONS["in"]],
    "STRATA_KV_COPY_OUT": [kv._DIRECTIONS["out"]],
    "STRATA_PIE_GPU": [_swapper and _swapper.GPU],
    "STRATA_PIE_CPU": [_swapper and _swapper.CPU],
    "STRATA_PIE_SWAPPING_IN": [_swapper and _swapper.SWAPPING_IN],
    "STRATA_PIE_SWAPPING_OUT": [_swapper and _swapper.SWAPPING_OUT],
    "STRATA_PIE_HOST_TO_DEVICE": [_swapper and _swapper.HOST_TO_DEVICE],
    "STRATA_PIE_DISK_TO_HOST": [_swapper and _swapper.DISK_TO_HOST],
    "STRATA_PARAMS_NO_LAYER": [params.NO_LAYER],
}


def _header_without_comments():
    with open(HEADER) as f:
        text = f.read()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def header_structs():
    """{struct name: [field names in order]} of every `typedef struct X { ... } X;`."""
    structs = {}
    text = _header_without_comments()
    for name, body in re.findall(r"typedef\s+struct\s+(\w+)\s*\{(.*?)\}\s*\1\s*;", text, re.S):
        fields = []
        for decl in body.split(";"):
            decl = re.sub(r"\[[^\]]*\]", "", decl).strip()
            if not decl:
                continue
            first, *more = [d.strip() for d in decl.split(",")]
            fields.append(re.findall(r"\w+", first)[-1])
            fields.extend(more)
        structs[name] = fields
    return structs


def header_constants():
    """Names of the header's STRATA_* constants: enum members and object-like #defines."""
    text = _header_without_comments()
    names = []
    for body in re.findall(r"\benum\b[^{;]*\{(.*?)\}", text, re.S):
        names += re.findall(r"\b(STRATA_\w+)\s*=", body)
    names += re.findall(r"^\s*#\s*define\s+(STRATA_\w+)[ \t]+\S", text, re.M)
    return names


def c_layout(structs, constants):
    """Compiles and runs a C program that prints the layout and values the C compiler sees."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise unittest.SkipTest("no C compiler ($CC or cc) to compile include/strata.h")
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "strata.h"', "int main(void) {"]
    for name, fields in structs.items():
        lines.append(f'printf("struct {name} %zu\\n", sizeof({name}));')
        for f in fields:
            lines.append(
                f'printf("field {name} {f} %zu %zu\\n", offsetof({name}, {f}), '
                f"sizeof((({name} *)0)->{f}));"
            )
    for c in constants:
        lines.append(f'printf("const {c} %lld\\n", (long long)({c}));')
    lines += ["return 0;", "}"]
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "layout.c"), os.path.join(tmp, "layout")
        with open(src, "w") as f:
            f.write("\n".join(lines) + "\n")
        subprocess.run([compiler, "-std=c11", "-I", INCLUDE, src, "-o", exe], check=True)
        out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
    sizes, fields, values = {}, {}, {}
    for line in out.splitlines():
        kind, *rest = line.split()
        if kind == "struct":
            sizes[rest[0]] = int(rest[1])
        elif kind == "field":
            fields.setdefault(rest[0], []).append((rest[1], int(rest[2]), int(rest[3])))
        else:
            values[rest[0]] = int(rest[1])
    return sizes, fields, values


@unittest.skipIf(_swapper is None, "" if _swapper else NO_SWAPPER)
class HeaderMirror(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.structs = header_structs()
        cls.constants = header_constants()
        cls.sizes, cls.fields, cls.values = c_layout(cls.structs, cls.constants)

    def test_the_header_parses(self):
        # A parser that found nothing would let every check below pass vacuously.
        self.assertGreaterEqual(len(self.structs), 14)
        self.assertIn("STRATA_OK", self.constants)
        self.assertIn("STRATA_PARAMS_NO_LAYER", self.constants)

    def test_every_struct_has_a_python_copy(self):
        self.assertEqual(sorted(self.structs), sorted(STRUCTS))

    def test_structs_match_field_by_field_with_offsets_and_sizes(self):
        for name, py in STRUCTS.items():
            with self.subTest(struct=name):
                want = self.fields[name]
                got = [
                    (f, getattr(py, f).offset, getattr(py, f).size) for f, *_ in py._fields_
                ]
                self.assertEqual(got, want, f"{py.__module__}.{py.__name__} vs {name}")
                self.assertEqual(ctypes.sizeof(py), self.sizes[name])

    def test_every_constant_has_python_copies_with_the_same_value(self):
        self.assertEqual(sorted(self.constants), sorted(CONSTANTS))
        for name, copies in CONSTANTS.items():
            with self.subTest(constant=name):
                for value in copies:
                    self.assertEqual(value, self.values[name])


if __name__ == "__main__":
    unittest.main()
