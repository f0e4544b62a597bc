"""The GPU check (`python -m tests.gpu_check`) itself works: with ``--device cpu`` each of its four checks runs the
GPU's code path's CPU twin on both sides, and passes; without a GPU, the default says so and exits 2."""

from __future__ import annotations

import torch

from ..gpu_check import main


def test_the_gpu_check_runs_every_check_on_cpu(capsys):
    assert main(["--device", "cpu"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("ok", "FAIL"))]
    assert len(lines) == 4 and all(line.startswith("ok   ") for line in lines), lines
    if not torch.cuda.is_available():
        assert main([]) == 2
