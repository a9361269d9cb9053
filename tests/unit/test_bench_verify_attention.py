from __future__ import annotations

import pytest

from tests.helpers import load_bench_module


def test_forwards_are_one_token_and_a_chain_and_a_tree_per_length():
    bench = load_bench_module("verify_attention")
    assert bench.forwards([4]) == {"1": (1, None), "chain4": (4, None), "tree4": (4, [0, 0, 0])}


@pytest.mark.parametrize("argv", [["--verify-lengths", "1"], ["--rounds", "0"], ["--contexts", "0"]])
def test_bad_arguments_are_refused_by_name(argv, capsys):
    bench = load_bench_module("verify_attention")
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert "--verify-lengths >= 2" in capsys.readouterr().err


def test_the_plot_is_a_png(tmp_path):
    bench = load_bench_module("verify_attention")
    ms = {"64": {"1": 1.0, "chain4": 1.2, "chain4_gqa": 1.1, "tree4": 1.2, "tree4_gqa": 1.1},
          "256": {"1": 1.1, "chain4": 1.5, "chain4_gqa": 1.2, "tree4": 1.5, "tree4_gqa": 1.2}}
    bench.plot(ms, [4], tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
