"""Ships ``gpufootprint_probe.pth`` into site-packages, and builds the probe's C buffer callbacks
(everything else is in pyproject.toml).

The ``.pth`` line imports the probe's autostart only when GPUFOOTPRINT_PROBE=1,
so every other interpreter start pays one environment lookup. A ``.pth`` must sit
at the top of site-packages, outside any package, which package-data cannot do:
``build_py`` copies it into the build root, so regular and editable wheels carry it.
"""

from __future__ import annotations

import hashlib
import os
import shutil

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

PTH = "gpufootprint_probe.pth"

# The probe's CUPTI buffer callbacks in C (daemon/gpufootprint/probe/nativecallbacks.py says why). A plain
# shared library loaded with ctypes: it includes no Python header and links against no Python, so one file
# serves every Python 3 and the wheel is tagged py3-none-<platform>. Optional: without a C compiler the
# install goes on and the probe uses its ctypes callbacks (it says so in a warning and a counter).
# GPUFOOTPRINT_NATIVE=0 skips it (the daemon's image: the daemon never loads it).
NATIVE = Extension(
    "gpufootprint.probe.native.cuptibuf",
    sources=["daemon/gpufootprint/probe/native/cuptibuf.c"],
    extra_compile_args=["-O2", "-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-pthread"],
    extra_link_args=["-pthread"],
    optional=True,
)
# The daemon's C core (daemon/gpufootprint/native/__init__.py says what it does): a plain library too,
# optional (without it the daemon runs its numpy and Python paths). GPUFOOTPRINT_NATIVE_CORE=0 skips it;
# GPUFOOTPRINT_NATIVE=0 does not, so the daemon's image can build its core without the probe's library.
CORE_SOURCE = "daemon/gpufootprint/native/core.c"


def _digest(path: str) -> str:
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), path), "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()[:16]


CORE = Extension(
    "gpufootprint.native.core",
    sources=[CORE_SOURCE],
    extra_compile_args=["-O2", "-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-pthread"],
    extra_link_args=["-pthread"],
    # Its source's digest (native/__init__.py's source_digest): a library built from another core.c than
    # the one beside it is refused, so an edited tree not rebuilt never runs (or tests) the old C.
    define_macros=[("GFP_CORE_SOURCE", f'"{_digest(CORE_SOURCE)}"')],
    optional=True,
)
# Names no import statement can reach: they are not Python modules
LIBRARY_FILES = {NATIVE.name: "libgfp-cuptibuf.so", CORE.name: "libgfp-core.so"}


class BuildNative(build_ext):
    def get_ext_filename(self, fullname: str) -> str:
        # Asked with the dotted name (outputs) and with its last part alone (get_ext_fullpath)
        for name, file in LIBRARY_FILES.items():
            if fullname == name:
                return os.path.join(*fullname.split(".")[:-1], file)
            if fullname == name.rsplit(".", 1)[1]:
                return file
        return str(super().get_ext_filename(fullname))

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return [] if ext.name in LIBRARY_FILES else list(super().get_export_symbols(ext))


class BuildWithPth(build_py):
    def run(self) -> None:
        super().run()
        here = os.path.dirname(os.path.abspath(__file__))
        self.mkpath(self.build_lib)
        shutil.copyfile(os.path.join(here, PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


cmdclass: dict[str, type] = {"build_py": BuildWithPth, "build_ext": BuildNative}

try:  # the library serves any Python 3: tag the wheel py3-none-<platform>, not one CPython's ABI
    try:
        from setuptools.command.bdist_wheel import bdist_wheel
    except ImportError:
        from wheel.bdist_wheel import bdist_wheel  # type: ignore[no-redef]

    class AnyPythonWheel(bdist_wheel):  # type: ignore[misc,valid-type]
        def get_tag(self) -> tuple[str, str, str]:
            _, _, platform = super().get_tag()
            return "py3", "none", platform

    cmdclass["bdist_wheel"] = AnyPythonWheel
except ImportError:
    pass

try:  # editable installs (PEP 660) build a wheel of links; add the .pth to it as well
    from setuptools.command.editable_wheel import editable_wheel

    class _WithPth:
        def __init__(self, inner: object) -> None:
            self.inner = inner

        def __enter__(self) -> _WithPth:
            self.inner.__enter__()  # type: ignore[attr-defined]
            return self

        def __exit__(self, *exc: object) -> object:
            return self.inner.__exit__(*exc)  # type: ignore[attr-defined]

        def __call__(self, wheel: object, files: list[str], mapping: dict[str, str]) -> None:
            self.inner(wheel, files, mapping)  # type: ignore[operator]
            with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), PTH)) as fh:
                wheel.writestr(PTH, fh.read())  # type: ignore[attr-defined]

    class EditableWithPth(editable_wheel):  # type: ignore[misc,valid-type]
        def _select_strategy(self, *args: object, **kwargs: object) -> object:
            return _WithPth(super()._select_strategy(*args, **kwargs))

    if hasattr(editable_wheel, "_select_strategy"):
        cmdclass["editable_wheel"] = EditableWithPth
except ImportError:
    pass

ext_modules = [ext for ext, switch in ((NATIVE, "GPUFOOTPRINT_NATIVE"), (CORE, "GPUFOOTPRINT_NATIVE_CORE"))
               if os.environ.get(switch, "1") != "0"]
setup(cmdclass=cmdclass, ext_modules=ext_modules)
