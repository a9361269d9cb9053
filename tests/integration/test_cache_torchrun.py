"""Building the target cache with 2 CPU ranks under torchrun: one manifest, shards byte-identical to a
single-process build (each sample is captured alone, and shard k always holds input rows [k*S, (k+1)*S))."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.integration.test_cache_crash import (
    cache_args,
    make_prepared,
    make_tiny_target,
    shard_hashes,
    subprocess_env,
)


def _torchrun() -> list[str]:
    exe = Path(sys.executable).parent / "torchrun"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


def test_two_cpu_ranks_write_the_same_cache_as_one_process(tmp_path):
    repo = Path(__file__).resolve().parents[2]
    target = make_tiny_target(tmp_path / "target")
    prepared = make_prepared(tmp_path / "prepared.jsonl", 11)  # 6 shards of 2 rows (the last has 1)
    single, multi = tmp_path / "single", tmp_path / "multi"
    env = subprocess_env()
    one = subprocess.run([sys.executable, "-m", "deepspec.cli", *cache_args(target, prepared, single)], cwd=repo,
                         env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([*_torchrun(), "--standalone", "--nproc-per-node", "2", "-m", "deepspec.cli",
                          *cache_args(target, prepared, multi)], cwd=repo, env=env, capture_output=True, text=True,
                         timeout=600)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]

    m1 = json.loads((single / "manifest.json").read_text())
    m2 = json.loads((multi / "manifest.json").read_text())
    assert [s["file"] for s in m2["shards"]] == [f"shard-0000{k}.safetensors" for k in range(6)]
    assert shard_hashes(multi) == shard_hashes(single) == {s["file"]: s["sha256"] for s in m2["shards"]}
    assert (multi / "manifest.json").read_bytes() == (single / "manifest.json").read_bytes()
    assert m1["num_samples"] == m2["num_samples"] == 9 and m2["num_heldout"] == 2
    # each rank kept its own progress file, listing only its shards (k % 2 == rank)
    for rank in (0, 1):
        progress = json.loads((multi / f"progress-rank{rank}.json").read_text())
        assert [s["index"] for s in progress["shards"]] == [k for k in range(6) if k % 2 == rank]
    assert not list(multi.glob(".*.tmp"))
    assert two.stdout.count("cache: wrote") == 1  # only rank 0 reports
