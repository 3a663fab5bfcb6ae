"""The KV budget is the container's: cgroup v2 / v1 limits from fake cgroup trees, and sizing.

Unit tests (no torch) for the reading and the arithmetic, then one load of the tiny model under
a fake container limit: the runner allocates only the slot rows that the limit holds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from slotserve.engine.core.memory import (
    KVCacheSize,
    MemorySources,
    available_memory_bytes,
    size_kv_cache,
)

GiB = 1 << 30
MiB = 1 << 20
NODE_AVAILABLE = 64 * GiB


def fake_host(tmp_path: Path, proc_self_cgroup: str) -> MemorySources:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "cgroup").write_text(proc_self_cgroup)
    (tmp_path / "proc" / "meminfo").write_text(
        f"MemTotal: {128 * GiB // 1024} kB\nMemAvailable: {NODE_AVAILABLE // 1024} kB\n"
    )
    return MemorySources(
        cgroup_root=tmp_path / "cgroup",
        proc_self_cgroup=tmp_path / "proc" / "cgroup",
        meminfo=tmp_path / "proc" / "meminfo",
    )


def write(directory: Path, **files: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("__", ".")).write_text(text + "\n")


def test_no_cgroup_limit_means_the_nodes_memavailable(tmp_path):
    sources = fake_host(tmp_path, "0::/\n")
    write(sources.cgroup_root, memory__max="max", memory__current=str(GiB))
    assert available_memory_bytes(sources) == NODE_AVAILABLE


def test_cgroup_v2_memory_max_minus_working_set(tmp_path):
    # A pod with a 4 GiB limit using 1.5 GiB, 0.5 GiB of it reclaimable page cache.
    sources = fake_host(tmp_path, "0::/\n")
    write(
        sources.cgroup_root,
        memory__max=str(4 * GiB),
        memory__current=str(1536 * MiB),
        memory__stat=f"anon {GiB}\nfile {512 * MiB}\ninactive_file {512 * MiB}\n",
    )
    assert available_memory_bytes(sources) == 3 * GiB


def test_cgroup_v2_limit_on_an_ancestor_counts(tmp_path):
    # No cgroup namespace: /proc/self/cgroup names the full path; the limit is two levels up.
    sources = fake_host(tmp_path, "0::/kubepods.slice/pod1.slice/ctr.scope\n")
    pod = sources.cgroup_root / "kubepods.slice" / "pod1.slice"
    write(pod, memory__max=str(2 * GiB), memory__current=str(GiB))
    write(pod / "ctr.scope", memory__max="max", memory__current=str(GiB))
    assert available_memory_bytes(sources) == GiB


def test_cgroup_v1_limit_in_bytes(tmp_path):
    # A v1 host: the memory controller has its own hierarchy; the container's own cgroup is
    # mounted as the root, so the host path in /proc/self/cgroup does not exist here.
    sources = fake_host(tmp_path, "4:memory:/docker/abc123\n3:cpu,cpuacct:/docker/abc123\n0::/\n")
    write(
        sources.cgroup_root / "memory",
        memory__limit_in_bytes=str(8 * GiB),
        memory__usage_in_bytes=str(3 * GiB),
        memory__stat=f"cache {GiB}\ntotal_inactive_file {GiB}\n",
    )
    assert available_memory_bytes(sources) == 6 * GiB


def test_cgroup_v1_unlimited_is_no_limit(tmp_path):
    sources = fake_host(tmp_path, "4:memory:/process_api/x\n0::/\n")
    write(
        sources.cgroup_root / "memory" / "process_api" / "x",
        memory__limit_in_bytes="9223372036854771712",
        memory__usage_in_bytes=str(GiB),
    )
    write(sources.cgroup_root / "memory", memory__limit_in_bytes="9223372036854771712")
    assert available_memory_bytes(sources) == NODE_AVAILABLE


def test_a_node_with_less_available_than_the_limit_wins(tmp_path):
    sources = fake_host(tmp_path, "0::/\n")
    write(sources.cgroup_root, memory__max=str(512 * GiB), memory__current="0")
    assert available_memory_bytes(sources) == NODE_AVAILABLE


def test_unreadable_cgroup_files_fall_back_to_the_node(tmp_path):
    sources = fake_host(tmp_path, "0::/\n")  # no cgroup tree at all
    assert available_memory_bytes(sources) == NODE_AVAILABLE


def test_sizing_by_budget_keeps_rows_inside_it():
    # 32 slots x 2048 positions x 46 KiB (SmolLM2 fp32) = 2.9 GiB; 1 GiB buys 11 rows.
    per_token = 46 * 1024
    size = size_kv_cache(
        max_batch_size=32, max_model_len=2048, bytes_per_token=per_token, budget_bytes=GiB
    )
    assert size == KVCacheSize(num_slots=11, num_tokens=11 * 2048)
    assert size.num_slots * 2048 * per_token <= GiB
    roomy = size_kv_cache(
        max_batch_size=32, max_model_len=2048, bytes_per_token=per_token, budget_bytes=64 * GiB
    )
    assert roomy == KVCacheSize(32, 32 * 2048)


def test_an_explicit_token_budget_keeps_every_slot():
    size = size_kv_cache(
        max_batch_size=4,
        max_model_len=64,
        bytes_per_token=1024,
        budget_bytes=0,
        kv_cache_tokens=48,
    )
    assert size == KVCacheSize(num_slots=4, num_tokens=48)


def test_a_budget_below_one_sequence_refuses_to_start():
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len 2048"):
        size_kv_cache(
            max_batch_size=8, max_model_len=2048, bytes_per_token=46 * 1024, budget_bytes=50 * MiB
        )


def test_the_engine_sizes_its_cache_by_the_container_limit(tmp_path, tiny_model_dir):
    """The tiny model's KV is 2 (k, v) x 2 layers x 2 heads x 16 dims x 4 bytes = 512 bytes a
    token; a container with 1 MiB of headroom at fraction 0.5 holds 1024 tokens: 4 rows of 256,
    not the 8 asked for."""
    from slotserve.engine.core.model.loader import build_runner
    from slotserve.engine.settings import EngineSettings

    sources = fake_host(tmp_path, "0::/\n")
    write(sources.cgroup_root, memory__max=str(MiB + 4096), memory__current="4096")
    settings = EngineSettings(
        model=str(tiny_model_dir), device="cpu", max_batch_size=8, max_model_len=256, num_threads=1
    )
    runner, _tokenizer, kv_cache_tokens = build_runner(settings, str(tiny_model_dir), sources)
    per_token = runner.shape.kv_bytes_per_token(runner.dtype)
    assert per_token == 512 and runner.num_slots == 4
    assert kv_cache_tokens == runner.num_slots * 256
    allocated = sum(t.numel() * t.element_size() for t in (*runner.k_cache, *runner.v_cache))
    assert allocated <= 0.5 * MiB
