"""Builds the two Rust libraries into the `strata` package (pyproject.toml holds the metadata).

setuptools-rust names a library without Python bindings like an extension module
(`libstrata.cpython-311-x86_64-linux-gnu.so`); `strata._lib` loads `libstrata.so` by that name
and LD_PRELOAD users name `libstrata_preload.so`, so the copies keep the plain names.
`SETUPTOOLS_RUST_CARGO_PROFILE=dev` builds unoptimised libraries (the wheel test does).
setuptools' own build files go under the ignored target/ folder, not into the source tree.
"""

import os

from setuptools import setup
from setuptools_rust import Binding, RustExtension, Strip
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools_rust.build import build_rust

BUILD_DIR = os.path.join("target", "python-build")
os.makedirs(BUILD_DIR, exist_ok=True)


class build_rust_plain_names(build_rust):
    def get_dylib_ext_path(self, ext, target_fname):
        path = super().get_dylib_ext_path(ext, target_fname)
        directory, name = os.path.split(path)
        return os.path.join(directory, name.split(".", 1)[0] + ".so")


class bdist_wheel_any_python(bdist_wheel):
    """The libraries do not link Python: one wheel serves every Python 3 on the platform."""

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


def library(module, manifest):
    # No Python binding: a plain C library loaded with ctypes or LD_PRELOAD. The copies shipped
    # lose their debug info (`strip -S`, as the release profile keeps it for profiling and
    # backtraces of the cargo builds); their symbol tables stay, so backtraces still name
    # functions.
    return RustExtension(
        module, path=manifest, binding=Binding.NoBinding, py_limited_api=False, strip=Strip.Debug
    )


setup(
    rust_extensions=[
        library("strata.libstrata", "ffi/Cargo.toml"),
        library("strata.libstrata_preload", "ffi/preload/Cargo.toml"),
    ],
    cmdclass={"build_rust": build_rust_plain_names, "bdist_wheel": bdist_wheel_any_python},
    options={"build": {"build_base": BUILD_DIR}, "egg_info": {"egg_base": BUILD_DIR}},
)
