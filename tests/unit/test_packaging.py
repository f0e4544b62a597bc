"""The wheel holds the package, its card template, its type marker, its license and the TRL extra (built from a copy
of the checkout), and the README's Install section that says how to get them."""

from __future__ import annotations

import configparser
import re
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


def test_readme_install_names_every_extra_the_python_version_and_the_pinned_torch():
    """The README's Install section is read before setup.cfg and the Makefile: an extra added there, a raised
    python_requires or a new torch pin must show up in it (cheap: text only, no wheel built)."""
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    readme = (REPO / "README.md").read_text()
    install = readme.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    for extra in config["options.extras_require"]:
        assert f"- `{extra}`:" in install, extra
    minimum = config["options"]["python_requires"].removeprefix(">=")
    assert f"Python {minimum} or newer" in install
    torch_pin = re.search(r"install (torch==\S+)", (REPO / "Makefile").read_text()).group(1)
    assert f"pip install {torch_pin} " in install
    assert not re.search(r"pip install [\"']?hf_fedshard", readme)  # not on PyPI: installs are from the clone
