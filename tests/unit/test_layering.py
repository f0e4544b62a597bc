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
    """`hf_fedshard.transports.TRANSPORTS`: each built-in's factory is named in its own module (torchft's imported on
    use), and its settings derive from `OneJob` or `GroupLaunch`."""
    from hf_fedshard.transports import TRANSPORTS, GroupLaunch, OneJob

    assert list(TRANSPORTS)[:2] == ["mesh", "torchft"]  # then any a test registered (tests/store_transport.py)
    for transport in [TRANSPORTS["mesh"], TRANSPORTS["torchft"]]:
        module, name = transport.factory.split(":")
        assert module.startswith("hf_fedshard.transports.") and issubclass(transport.settings, OneJob | GroupLaunch)
        assert f"def {name}(" in (PACKAGE / "transports" / f"{module.rsplit('.', 1)[1]}.py").read_text()


def test_no_module_outside_the_transports_branches_on_one():
    """Above `transports/`, a transport is reached through the registry and its settings' methods: no comparison
    with a transport's name, no launch-per-group flag, no transport module but shared helpers (mesh's process
    groups, the members' fingerprint). ``lighthouse.py`` is torchft's own command (``python -m``)."""
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name == "transports" or path.name == "lighthouse.py":
            continue
        text = path.read_text()
        for pattern in ("fed_transport ==", "fed_transport !=", '== "torchft"', '== "mesh"', "launch_per_group"):
            assert pattern not in text, f"{path.relative_to(PACKAGE)}: {pattern}"
        transports = {n for n in imported_modules(path) if n.startswith("hf_fedshard.transports.")}
        shared = {"hf_fedshard.transports.mesh", "hf_fedshard.transports.members"}
        assert transports <= shared, f"{path.relative_to(PACKAGE)}: {sorted(transports)}"


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


def test_every_override_of_a_trainer_method_says_why_in_its_first_line():
    """Each `Trainer` method the mixin's parts (and TRL's) override opens with one comment line saying why Trainer's
    own code cannot do it (a private method of Trainer may change between releases: the reason says what to check)."""
    from transformers import Trainer

    paths = [*sorted((PACKAGE / "integrations").glob("trainer*.py")), PACKAGE / "trl.py"]
    silent = []
    for path in paths:
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            methods = node.body if isinstance(node, ast.ClassDef) else []
            for method in [m for m in methods if isinstance(m, ast.FunctionDef) and hasattr(Trainer, m.name)]:
                if method.name == "__init__":
                    continue
                opening = lines[method.body[0].lineno - 2].strip()  # the line above its first statement
                if not opening.startswith("#"):
                    silent.append(f"{path.name}: {method.name}")
    assert silent == []
