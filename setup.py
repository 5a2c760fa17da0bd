"""Ships ``gpufootprint_probe.pth`` into site-packages (everything else is in pyproject.toml).

The ``.pth`` line imports the probe's autostart only when GPUFOOTPRINT_PROBE=1,
so every other interpreter start pays one environment lookup. A ``.pth`` must sit
at the top of site-packages, outside any package, which package-data cannot do:
``build_py`` copies it into the build root, so regular and editable wheels carry it.
"""

from __future__ import annotations

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "gpufootprint_probe.pth"


class BuildWithPth(build_py):
    def run(self) -> None:
        super().run()
        here = os.path.dirname(os.path.abspath(__file__))
        self.mkpath(self.build_lib)
        shutil.copyfile(os.path.join(here, PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


cmdclass: dict[str, type] = {"build_py": BuildWithPth}

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

setup(cmdclass=cmdclass)
