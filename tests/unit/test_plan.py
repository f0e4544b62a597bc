"""The planner (`python -m hf_fedshard.tools.plan`): its presets give the cost model's own figures for the same
cluster (the paper's: the README's 2.41× / 1.17× row), a Hub config.json counts as its preset, bad input says which
flag to give."""

from __future__ import annotations

import json
import re

import pytest

from hf_fedshard.tools.cost import leonardo_setting, paper_setting, speedups
from hf_fedshard.tools.models import PRESETS
from hf_fedshard.tools.plan import main


def rows(text: str) -> dict[tuple[str, str], tuple[float, float, float, float]]:
    """(H, method) -> the four figures of each table row."""
    found = re.findall(r"^ +(\S+)  (\S+) +([\d.]+) +([\d.]+) +([\d.]+)× +([\d.]+)×$", text, re.M)
    return {(h, m): tuple(map(float, figures)) for h, m, *figures in found}


def test_the_paper_preset_is_the_readme_row_and_the_cost_models_three_tier_projection(capsys):
    main(["--preset", "paper"])
    table = rows(capsys.readouterr().out)
    assert table[("8", "FL+FSDP")][2] == 2.41 and table[("8", "FL+HSDP")][2] == 1.17  # README, "The paper's 8.04×"
    expected = speedups(leonardo_setting().costs())
    for (_, method), figures in table.items():
        assert figures[2] == round(expected[method], 2), method
    assert set(table) == {("-", "FSDP"), ("-", "HSDP"), ("8", "FL+FSDP"), ("8", "FL+HSDP")}


def test_flags_describe_any_cluster_and_a_config_json_counts_as_its_preset(capsys, tmp_path):
    two_tier = ["--nodes", "128", "--gpus-per-node", "4", "--node-gbit", "200", "--intra-gbyte", "300",
                "--peak-tflops", "312", "--sync-steps", "8", "16", "--fl-hsdp-nodes", "8"]  # fmt: skip
    main(two_tier)
    table = rows(capsys.readouterr().out)
    for h in (8, 16):  # the cost model's two-tier paper setting, fp32 FedAvg, at each H
        expected = speedups(paper_setting(sync_steps=h).costs())
        for method in ("FL+FSDP", "FL+HSDP"):
            assert table[(str(h), method)][2] == round(expected[method], 2), (h, method)
    preset = PRESETS["llama-8b"]
    config = {"hidden_size": preset["hidden_size"], "intermediate_size": preset["intermediate_size"],
              "num_hidden_layers": preset["num_hidden_layers"], "num_attention_heads": preset["num_attention_heads"],
              "num_key_value_heads": preset["num_key_value_heads"], "vocab_size": 128_256}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    main([*two_tier, "--config", str(tmp_path / "config.json")])
    assert rows(capsys.readouterr().out) == table


def test_the_choice_is_the_smallest_h_within_5_percent_of_the_faster_methods_best(capsys):
    main(["--preset", "leonardo", "--sync-steps", "4", "8", "16", "32"])
    out = capsys.readouterr().out
    fl_fsdp = {int(h): figures[2] for (h, m), figures in rows(out).items() if m == "FL+FSDP"}
    assert fl_fsdp[32] > fl_fsdp[16] >= 0.95 * fl_fsdp[32] > fl_fsdp[8]  # so the choice is 16, not the largest
    assert "In this model: FL+FSDP, at H = 16 (" in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--nodes", "8"], "error: give --gpus-per-node, --node-gbit, --intra-gbyte, --peak-tflops"),
        (["--preset", "leonardo", "--rack-nodes", "5"], "error: --rack-nodes=5 must divide --nodes=16"),
        (["--preset", "leonardo", "--fl-hsdp-nodes", "16"], "error: --fl-hsdp-nodes=16 must divide --nodes=16 into 2"),
        (["--preset", "leonardo", "--model", "llama-70b"], "error: --model=llama-70b is not a preset"),
        (["--preset", "leonardo", "--nodes", "8"], "error: --fl-hsdp-nodes=8 (its default: --rack-nodes, or 2)"),
        (["--preset", "leonardo", "--gpus-per-node", "0"], "error: --gpus-per-node=0 must be positive."),
        (["--preset", "leonardo", "--sync-steps", "8", "0"], "error: --sync-steps [8, 0]: every H must be at least 1"),
        (
            [
                "--nodes",
                "4",
                "--gpus-per-node",
                "4",
                "--node-gbit",
                "1",
                "--intra-gbyte",
                "1",
                "--peak-tflops",
                "1",
                "--rack-gbit",
                "5",
            ],
            "error: a third tier needs both --rack-nodes",
        ),
        (
            ["--preset", "leonardo", "--config", "/nonexistent/config.json"],
            "error: --config=/nonexistent/config.json is",
        ),
    ],
)
def test_bad_input_names_the_flag(argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert str(exit_info.value).startswith(message)
