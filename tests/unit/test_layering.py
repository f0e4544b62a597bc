"""The package's folders are its layers: the engine imports no Transformers, the callback nothing of the federation
but the engine, and no training path imports the tooling. Checked on the import statements, so a change that
breaks a layer fails here, not in a user's plain loop."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from ..launch import REPO

PACKAGE = REPO / "hf_fedshard"


def imported_modules(path: Path) -> set[str]:
    """Every module an ``import`` or ``from ... import`` in ``path`` names, at any depth (absolute names)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import of {node.module}"
            names.add(node.module)
    return names


def modules_of(folder: str) -> list[Path]:
    return sorted((PACKAGE / folder).glob("*.py"))


@pytest.mark.parametrize("path", modules_of("engine"), ids=lambda p: p.name)
def test_the_engine_imports_no_transformers_and_no_other_layer(path):
    names = imported_modules(path)
    assert not {n for n in names if n.split(".")[0] in ("transformers", "accelerate", "datasets", "peft", "trl")}
    ours = {n for n in names if n.startswith("hf_fedshard.")}
    allowed = {"hf_fedshard.errors", "hf_fedshard.notices"}  # no transport, no topology: a communicator is given
    assert {n for n in ours if not n.startswith("hf_fedshard.engine")} <= allowed


def test_every_transport_is_one_module_whose_factory_the_registry_loads():
    """`hf_fedshard.transports.TRANSPORTS`: each entry's factory imports from its own module (torchft's on use)."""
    from hf_fedshard.transports import TRAINER_TRANSPORTS, TRANSPORTS

    assert list(TRANSPORTS) == ["mesh", "torchft", "simulated"] and TRAINER_TRANSPORTS == ("mesh", "torchft")
    for transport in TRANSPORTS.values():
        module = transport.factory.split(":")[0]
        assert callable(transport.load()) and module.startswith("hf_fedshard.transports.")
        assert (PACKAGE / "transports" / f"{module.rsplit('.', 1)[1]}.py").is_file()


def test_the_callback_imports_only_the_engine_and_transformers():
    names = imported_modules(PACKAGE / "integrations" / "callback.py")
    ours = {n for n in names if n.startswith("hf_fedshard")}
    assert ours == {"hf_fedshard.engine"}


@pytest.mark.parametrize("folder", ["engine", "transports", "integrations", "checkpointing"])
def test_no_training_path_imports_the_tooling(folder):
    for path in modules_of(folder):
        assert not {n for n in imported_modules(path) if n.startswith("hf_fedshard.tools")}, path


@pytest.mark.parametrize("folder", ["engine", "transports", "checkpointing"])
def test_no_layer_below_the_trainer_imports_it(folder):
    """The checkpoints, the transports and the engine take what they need of the Trainer's arguments as their own small
    types (e.g. `hf_fedshard.checkpointing.resume.ResumeSettings`): no import climbs back up to the integrations."""
    for path in modules_of(folder):
        assert not {n for n in imported_modules(path) if n.startswith("hf_fedshard.integrations")}, path


def test_importing_the_engine_loads_no_transformers():
    code = (
        "import sys; from hf_fedshard import FederatedAverager, FederationLayout; import hf_fedshard.engine; "
        "print(sorted(m for m in ('transformers', 'accelerate', 'datasets') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert result.stdout.strip() == "[]"
