"""The engines are pure: no hardware, exporter, clock, thread or socket imports."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import gpufootprint.engines

FORBIDDEN = {"pynvml", "cupti", "prometheus_client", "cuda", "torch", "socket", "subprocess", "threading",
             "time", "http", "urllib", "selectors", "os"}
PURE_FILES = sorted(Path(gpufootprint.engines.__file__).parent.glob("*.py"))


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_engine_modules_import_nothing_forbidden() -> None:
    assert len(PURE_FILES) >= 9, PURE_FILES
    bad = {p.name: sorted(_imports(p) & FORBIDDEN) for p in PURE_FILES if _imports(p) & FORBIDDEN}
    assert bad == {}


def test_engine_modules_import_only_pure_parts_of_the_package() -> None:
    allowed = {"gpufootprint.config", "gpufootprint.snapshot", "gpufootprint.records", "gpufootprint.errors"}
    for path in PURE_FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gpufootprint"):
                ok = node.module in allowed or node.module.startswith(("gpufootprint.engines",
                                                                        "gpufootprint.features"))
                assert ok, f"{path.name} imports {node.module}"


def test_importing_the_engines_loads_no_gpu_or_exporter_library() -> None:
    code = ("import sys, gpufootprint.engines.runner, gpufootprint.engines.kernels\n"
            "print(sorted(m for m in ('pynvml','cupti','prometheus_client','torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
