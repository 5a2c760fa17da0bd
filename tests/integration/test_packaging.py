"""The package as a user gets it: ``python -m build`` from the source tree, the wheel installed
into a fresh venv without ``-e`` (no source tree on the path), and a probe started there by
``GPUFOOTPRINT_PROBE=1`` through the ``.pth`` startup hook the wheel puts into site-packages."""

from __future__ import annotations

import email
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import gpufootprint
import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
# One worker runs this file's tests (pytest-xdist --dist loadgroup): its module fixture is built once.
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("test_packaging")]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sdist and wheel, the wheel built from the sdist (build's default), so a file the sdist
    leaves out is missing from the wheel too."""
    if not (ROOT / ".git").exists() and not (ROOT / "pyproject.toml").exists():
        pytest.fail("not a source tree")
    src = tmp_path_factory.mktemp("src")
    # A copy without the developer's build outputs, as a clean clone has it.
    shutil.copytree(ROOT, src, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info", "__pycache__",
                                                  ".pytest_cache", ".mypy_cache", "tests", "bench"))
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(src)],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # setuptools' license-format deprecation ("stops building in February 2027") is gone
    log = r.stdout + r.stderr
    assert "is deprecated" not in log and "no longer be supported" not in log, log[-3000:]
    return out


def _one(dist: Path, pattern: str) -> Path:
    found = sorted(dist.glob(pattern))
    assert len(found) == 1, f"{pattern}: {found}"
    return found[0]


def test_sdist_and_wheel_carry_the_startup_hook_and_the_license(dist: Path) -> None:
    version = gpufootprint.__version__
    sdist = _one(dist, f"gpufootprint-{version}.tar.gz")
    # The probe's C callbacks (a library that links against no Python): any Python 3, this platform
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    wheel = _one(dist, f"gpufootprint-{version}-py3-none-{platform}.whl")
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    assert {"gpufootprint_probe.pth", "LICENSE", "constraints.txt", "setup.py", "pyproject.toml",
            "daemon/gpufootprint/probe/native/cuptibuf.c", "daemon/gpufootprint/native/core.c"} <= names
    with zipfile.ZipFile(wheel) as zf:
        wnames = set(zf.namelist())
        meta = email.message_from_bytes(zf.read(f"gpufootprint-{version}.dist-info/METADATA"))
        pth = zf.read("gpufootprint_probe.pth").decode()
    assert "gpufootprint/probe/_autostart.py" in wnames
    assert "gpufootprint/probe/native/libgfp-cuptibuf.so" in wnames
    assert "gpufootprint/native/libgfp-core.so" in wnames  # the daemon's C core
    assert not [n for n in wnames if n.endswith(".c")], "the wheel carries the library, not its source"
    assert f"gpufootprint-{version}.dist-info/licenses/LICENSE" in wnames
    assert pth == (ROOT / "gpufootprint_probe.pth").read_text()
    # SPDX metadata (PEP 639), the version from gpufootprint/__init__.py, extras by who needs what
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["Version"] == version
    assert set(meta.get_all("Provides-Extra") or []) == {"probe", "daemon", "report", "test"}
    requires = meta.get_all("Requires-Dist") or []
    base = [r for r in requires if "extra ==" not in r]
    assert not [r for r in base if r.split("<")[0].split(">")[0].split("=")[0].strip() in
                {"cupti-python", "nvidia-cuda-cupti", "cuda-bindings", "nvidia-ml-py", "pytest"}], base
    assert all("==" not in r.split(";")[0] for r in requires if 'extra == "test"' not in r), requires


def test_an_sdist_made_with_GPUFOOTPRINT_NATIVE_0_still_carries_the_c_source(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """GPUFOOTPRINT_NATIVE=0 skips building the library (the daemon's image); an sdist made where it is set
    must still carry the source, or every wheel later built from that sdist silently lacks the C callbacks."""
    src = tmp_path_factory.mktemp("src_native0")
    shutil.copytree(ROOT, src, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info", "__pycache__",
                                                  ".pytest_cache", ".mypy_cache", "tests", "bench", "*.so"))
    out = tmp_path_factory.mktemp("dist_native0")
    r = subprocess.run([sys.executable, "-m", "build", "--sdist", "--outdir", str(out), str(src)],
                       env={**os.environ, "GPUFOOTPRINT_NATIVE": "0"},
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with tarfile.open(_one(out, "gpufootprint-*.tar.gz")) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    assert {"daemon/gpufootprint/probe/native/cuptibuf.c", "daemon/gpufootprint/native/core.c"} <= names


def test_dependencies_are_ranges_and_the_constraints_file_pins_each_of_them() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    runtime = [*project["dependencies"], *project["optional-dependencies"]["probe"],
               *project["optional-dependencies"]["daemon"]]
    for req in runtime:
        assert "==" not in req and "<" in req and ">=" in req, f"{req}: want a range (>=oldest,<next major)"
        name = req.split(">")[0].split("<")[0].strip().lower()
        assert name in pins, f"constraints.txt has no pin for {name}"


def test_the_image_tags_and_the_package_version_agree() -> None:
    version = gpufootprint.__version__
    for path in [*sorted((ROOT / "deploy").rglob("*.yaml")), ROOT / "Dockerfile", ROOT / "README.md"]:
        for line in path.read_text().splitlines():
            if "gpufootprint/gpufootprint:" in line:
                tag = line.split("gpufootprint/gpufootprint:", 1)[1].split()[0].strip("\"'`")
                assert tag == version, f"{path.relative_to(ROOT)}: image tag {tag}, package {version}"


def test_the_wheel_installs_into_a_fresh_venv_and_GPUFOOTPRINT_PROBE_starts_a_probe(
        dist: Path, tmp_path: Path) -> None:
    wheel = _one(dist, "gpufootprint-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    # A workload image: the probe extra, the tested versions.
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"),
                        f"{wheel}[probe]"], capture_output=True, text=True, timeout=900, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUFOOTPRINT", "PYTHON"))}
    code = ("import json, sys, gpufootprint, gpufootprint.probe as p\n"
            "c = p.current()\n"
            "from gpufootprint.probe import nativecallbacks as n\n"
            "print(json.dumps({'file': gpufootprint.__file__, 'autostart': 'gpufootprint.probe._autostart' in "
            "sys.modules, 'probe': c is not None, 'started': bool(c and c.started), "
            "'errors': c.errors if c else [], 'native': n.load()[1] or str(n.LIBRARY)}))\n")
    r = subprocess.run([str(py), "-c", code], env={**env, "GPUFOOTPRINT_PROBE": "1",
                                                  "GPUFOOTPRINT_PROBE_SOCKET": str(tmp_path / "none.sock")},
                       cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert Path(got["file"]).is_relative_to(venv), got  # the installed copy, not the source tree
    assert got["autostart"] and got["probe"], got
    assert Path(got["native"]).is_relative_to(venv), got  # the wheel's C callbacks load (else: why not)
    # Here there is no GPU: the probe reached CUPTI through the installed cupti-python and stopped at
    # the missing driver (a GPU node gets started=True). An ImportError would mean a missing extra.
    assert got["started"] or any("CUDA driver" in e or "libcuda" in e for e in got["errors"]), got
    assert not any("No module named" in e for e in got["errors"]), got
    # Without the variable the hook imports nothing.
    r = subprocess.run([str(py), "-c", "import sys; print('gpufootprint' in sys.modules)"], env=env,
                       cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True)
    assert r.stdout.strip() == "False"
    r = subprocess.run([str(venv / "bin" / "gpufootprint"), "--version"], env=env, capture_output=True,
                       text=True, timeout=120, check=True)
    assert r.stdout.strip() == f"gpufootprint {gpufootprint.__version__}"


def test_ci_installs_and_tests_exactly_as_the_readme_says() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    setup = "python3 -m venv .venv && .venv/bin/pip install -c constraints.txt -e '.[test]'"
    assert f"{setup} && .venv/bin/gpufootprint start" in readme
    assert setup in ci
    assert ".venv/bin/python -m pytest -q" in readme and ".venv/bin/python -m pytest -q" in ci


def test_the_sdist_carries_what_readme_links_to(dist: Path) -> None:
    """README's relative links (the configuration reference, deploy/, docs/ and its images) resolve
    inside the sdist, as they do in the source tree (issue 30, item 7)."""
    import re

    sdist = _one(dist, f"gpufootprint-{gpufootprint.__version__}.tar.gz")
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    readme = (ROOT / "README.md").read_text()
    links = {m.split("#", 1)[0] for m in re.findall(r"\]\(([^)\s]+)\)", readme)
             if "://" not in m and not m.startswith(("#", "mailto:"))}
    assert "config/gpufootprint.yaml" in links and any(ln.startswith("docs/") for ln in links), links
    missing = sorted(ln for ln in links if ln.rstrip("/") not in names
                     and not any(n.startswith(ln.rstrip("/") + "/") for n in names))
    assert not missing, f"README links to files the sdist lacks: {missing}"
    for must in ("config/gpufootprint.yaml", "deploy/k8s/daemonset.yaml", "deploy/prometheus/rules.yml",
                 "deploy/grafana/gpufootprint.json", "docs/metrics.md", "docs/img/report-footprint.png"):
        assert must in names, must
    assert not [n for n in names if "__pycache__" in n]
