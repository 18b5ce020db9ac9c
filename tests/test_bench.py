"""The benchmark program runs end to end on a small size and writes its JSON (no timing is judged)."""
import json

import pytest

from ds_q8.tools import bench


def test_bench_small_run_writes_every_table(tmp_path, capsys):
    out = tmp_path / "bench.json"
    result = bench.main(["--n", "3000", "--reps", "1", "--many", "3", "700", "--skip", "foreach", "--skip", "DeepSpeedCPUAdam",
                         "--in-cache", "2048", "8192", "--muon", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    names = [r["name"] for r in result["step"]]
    assert "ds_q8 AdamW8bitBlock (kernel)" in names and "torch AdamW fused" in names
    assert "ds_q8 AdamW8bitBlock (reference)" in names
    assert not any("foreach" in n or "DeepSpeed" in n for n in names)  # --skip (DeepSpeedCPUAdam would JIT-build its op)
    assert [r["name"] for r in result["copy"]] == ["copy (dst.copy_(src), fp32)"]
    assert result["many"]["count"] == 3 and len(result["many"]["step"]) >= 2
    # the share per tensor: the rows of PER_TENSOR_ROWS that ran, each against one tensor of 3 x 700
    share = {r["name"]: r for r in result["many"]["per_tensor"]}
    assert set(share) == {"ds_q8 AdamW8bitBlock (kernel)", "ds_q8 AdamW8bitBlock (kernel, nonfinite=off)",
                          "torch AdamW fused"}
    for r in share.values():
        assert r["many_ms"] > 0 and r["one_ms"] > 0
        assert abs(r["us"] - 1e3 * (r["many_ms"] - r["one_ms"]) / 2) < 1e-6 * max(1.0, abs(r["us"]))
    assert share["torch AdamW fused"]["ratio"] is None or abs(share["torch AdamW fused"]["ratio"] - 1) < 1e-9
    assert {r["name"] for r in result["quantization"]} >= {"dequantize_blockwise (kernel, out=)"}
    for r in result["step"] + result["copy"] + result["many"]["step"] + result["quantization"]:
        assert r["ms"] > 0 and r["gbps"] > 0, r
    printed = capsys.readouterr().out
    assert "% of the copy's" in printed and "| torch AdamW fused |" in printed and "us per tensor" in printed
    # the arithmetic-only cost: one row per implementation of IN_CACHE_ROWS that ran, torch's floor
    # set against torch's own measured step
    assert [r["name"] for r in result["in_cache"]] == ["ds_q8 AdamW8bitBlock (kernel, nonfinite=off)", "torch AdamW fused"]
    torch_ms = next(r["ms"] for r in result["step"] if r["name"] == "torch AdamW fused")
    for r in result["in_cache"]:
        assert r["ns_per_param"] >= 0 and r["small_us"] > 0 and r["large_us"] > 0, r
        assert r["floor_ms"] == pytest.approx(r["ns_per_param"] * 1e-6 * 3000 / result["config"]["threads"])
        assert r["floor_ratio"] == pytest.approx(r["floor_ms"] / torch_ms)
    assert "compute floor, ms" in printed
    # the partition table: the same elements as one tensor and as flat partitions of 150 parameters
    assert [r["name"] for r in result["partition"]] == [
        "one tensor", "flat partition of 150 parameters", "flat partition of 150 parameters, cut at both ends",
        "flat partition of 150 parameters of odd sizes"]
    assert all(r["paired_ratio"] > 0 for r in result["partition"]) and "segment overhead" in printed
    # the block-size table: the kernel step at 64, 128, 256 and 2048, ratios to the last
    assert [r["name"] for r in result["blocks"]] == [f"block_size={b}" for b in (64, 128, 256, 2048)]
    assert result["blocks"][-1]["paired_ratio"] == 1.0 and "against block_size=2048" in printed


def test_bench_in_cache_restores_the_thread_count_and_can_be_skipped():
    import torch
    threads = torch.get_num_threads()
    result = bench.main(["--n", "2048", "--reps", "1", "--many", "0", "0", "--no-reference", "--skip", "DeepSpeed",
                         "--in-cache", "0", "0", "--muon"])
    assert result["in_cache"] == [] and torch.get_num_threads() == threads
    assert len(result["partition"]) == 4  # 2048 elements in 150 parameters: sizes of 13-14
    result = bench.main(["--n", "2048", "--reps", "1", "--many", "0", "0", "--no-reference", "--skip", "DeepSpeed",
                         "--in-cache", "0", "0", "--segments", "0", "--muon"])
    assert result["partition"] == []
    result = bench.main(["--n", "2048", "--reps", "1", "--many", "0", "0", "--no-reference", "--skip", "DeepSpeed",
                         "--in-cache", "1024", "2048", "--muon"])
    assert len(result["in_cache"]) == 2 and torch.get_num_threads() == threads


def test_bench_muon_table_sets_deepspeed_muon_against_muon8bitblock(tmp_path, capsys):
    out = tmp_path / "muon.json"
    result = bench.main(["--muon", "96x160", "160x96", "64x64", "--muon-only", "--reps", "2", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    rows = {r["name"]: r for r in result["muon"]["step"]}
    ds, ours = rows["DeepSpeed Muon (muon_update, fp32 momentum)"], rows["ds_q8 Muon8bitBlock (8-bit momentum)"]
    n = 96 * 160 * 2 + 64 * 64
    assert ds["momentum_bytes"] == 4 * n and ds["ratio"] == 1.0
    # one code byte per element and one bfloat16 maximum per 64-element block of each matrix
    assert ours["momentum_bytes"] == n + 2 * (240 + 240 + 64)
    assert rows["ds_q8 Muon8bitBlock (optim_bits=32)"]["momentum_bytes"] == 4 * n
    assert all(r["ms"] > 0 and len(r["runs_ms"]) == 2 for r in rows.values())
    assert result["muon"]["shapes"] == [[96, 160], [160, 96], [64, 64]]
    assert "| ds_q8 Muon8bitBlock (8-bit momentum) |" in capsys.readouterr().out


def test_bench_no_reference_leaves_out_every_reference_row():
    result = bench.main(["--n", "2048", "--reps", "1", "--many", "0", "0", "--no-reference", "--skip", "torch",
                         "--skip", "DeepSpeed", "--muon"])
    rows = result["step"] + result["quantization"]
    assert rows and not any("reference" in r["name"] for r in rows)
    assert not any(r["name"].startswith(("torch", "DeepSpeed")) for r in result["step"])
    assert result["many"]["step"] == []


@pytest.mark.parametrize("argv, message", [
    (["--n", "0"], "--n must be >= 1"),
    (["--reps", "0"], "--reps must be >= 1"),
    (["--many", "0", "5"], "--many needs two positive numbers"),
    (["--device", "tpu"], "--device must be cpu or cuda"),
    (["--in-cache", "4096", "1024"], "--in-cache needs two sizes with 0 < SMALL < LARGE"),
    (["--in-cache", "0", "1024"], "--in-cache needs two sizes with 0 < SMALL < LARGE"),
    (["--n", "100", "--segments", "101"], "--segments must be in [0, --n]"),
    (["--muon", "768"], "a matrix shape is ROWSxCOLS"),
    (["--muon", "0x768"], "a matrix shape is ROWSxCOLS"),
])
def test_bench_rejects_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err
