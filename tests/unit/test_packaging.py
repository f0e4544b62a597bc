"""The wheel holds the package, its card template, its type marker, its license and the TRL extra (built from a copy
of the checkout)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

from ..launch import REPO


def test_wheel_contents(tmp_path):
    source = tmp_path / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", "build", "outputs", "runs", "*.egg-info"))
    cmd = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q",
           "-w", str(tmp_path / "dist")]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    (wheel,) = (tmp_path / "dist").glob("hf_fedshard-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {"hf_fedshard/integrations/templates/card_section.md", "hf_fedshard/tools/cost.py", "hf_fedshard/trl.py",
                "hf_fedshard/integrations/trainer.py", "hf_fedshard/tools/data.py", "hf_fedshard/py.typed",
                "hf_fedshard/engine/rounds.py", "hf_fedshard/topology.py"}  # fmt: skip
    assert expected <= names
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "recipes/"))]
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("/METADATA"))).decode()
    assert "Provides-Extra: trl" in metadata and 'extra == "trl"' in metadata
    assert "License-File: LICENSE" in metadata and any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
