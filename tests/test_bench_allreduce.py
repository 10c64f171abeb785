"""`python -m tinyvit.bench.allreduce`: the data-parallel step's timing record (one process here, two
ranks with mpirun) and the arithmetic of the 8-GPU projection. Speed itself is never tested."""
import json
import math

import pytest
from helpers import run_ranks

from tinyvit.bench import allreduce
from tinyvit.distributed import BUCKET_BYTES


def test_allreduce_time_is_nccl_tests_bus_bandwidth_read_backwards():
    """busbw = algbw * 2(n-1)/n (nccl-tests, doc/PERFORMANCE.md), algbw = S / t; at a size of the table."""
    size = 2**24
    t = allreduce.allreduce_seconds(size, 8)
    assert size / t * 2 * 7 / 8 == pytest.approx(allreduce.NVLINK4_BUSBW[size] * 1e9)
    assert allreduce.allreduce_seconds(size, 2) == pytest.approx(t * (2 * 1 / 2) / (2 * 7 / 8))


def test_bus_bandwidth_between_and_beyond_the_table():
    small, big = min(allreduce.NVLINK4_BUSBW), max(allreduce.NVLINK4_BUSBW)
    assert allreduce.busbw(small / 4) == allreduce.NVLINK4_BUSBW[small]          # clamped
    assert allreduce.busbw(big * 4) == allreduce.NVLINK4_BUSBW[big]
    middle = allreduce.busbw(math.sqrt(2**23 * 2**24))                           # halfway in log size
    assert middle == pytest.approx((allreduce.NVLINK4_BUSBW[2**23] + allreduce.NVLINK4_BUSBW[2**24]) / 2)


def test_projection_buckets_and_speedup():
    assert allreduce.bucket_sizes(2 * BUCKET_BYTES + 5) == [BUCKET_BYTES, BUCKET_BYTES, 5]
    assert allreduce.bucket_sizes(BUCKET_BYTES) == [BUCKET_BYTES]
    rows = {r["model"]: r for r in allreduce.projection(8, 128, 0.5)}
    b16 = rows["vit-b/16"]
    assert b16["gradient_bytes"] == 4 * 86_567_656 and b16["buckets"] == 14
    assert b16["speedup"] == pytest.approx(8 * b16["compute_s"] / (b16["compute_s"] + b16["allreduce_s"]))
    assert all(0 < r["speedup"] < 8 for r in rows.values())


def test_one_process_record():
    r = allreduce.run("vit-mnist/7", batch_size=4, steps=2, warmup=0, threads=1)
    assert r["ranks"] == 1 and r["rows_per_rank"] == 4 and len(r["step_times_s"]) == 2
    assert r["allreduce_alone_s"] is None and r["images_per_s"] == pytest.approx(4 / r["step_time_s"])
    assert "images/s" in allreduce.format_report(r)


def test_two_ranks_record(mpirun, tmp_path):
    code, out, err = run_ranks(mpirun, 2, "-m", "tinyvit.bench.allreduce", "--model", "vit-mnist/7", "--batch-size",
                               "8", "--steps", "2", "--warmup", "1", "--json", tmp_path / "r.json")
    assert code == 0, err[-3000:]
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["ranks"] == 2 and r["rows_per_rank"] == 4 and r["command"].startswith("mpirun -n 2 python -m")
    assert r["allreduce_alone_s"] > 0 and r["wait_after_backward_s"] >= 0 and 0 < r["allreduce_share"] < 1
    assert out.count("images/s") == 1                                           # rank 0 reports
