"""The wheel holds the package, its card template, `py.typed`, the license and the TRL extra (built from a copy of the
checkout)."""

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
                "hf_fedshard/integrations/trainer.py", "hf_fedshard/tools/data.py", "hf_fedshard/py.typed"}  # fmt: skip
    assert expected <= names
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "recipes/"))]
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("/METADATA"))).decode()
    assert "Provides-Extra: trl" in metadata and 'extra == "trl"' in metadata
    (license_file,) = [n for n in names if ".dist-info/" in n and n.endswith("/LICENSE")]
    license_text = zipfile.ZipFile(wheel).read(license_file).decode()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "License: Apache-2.0" in metadata or "License-Expression: Apache-2.0" in metadata
