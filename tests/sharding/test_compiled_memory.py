"""The compiler's memory figure: HBM only.

The report below is the head of each memory space of the deviceless TPU compiler's
memory-usage report for tests/sharding/test_memory_tpu.py's program (v5e, 2026-12-03):
its `temp_size_in_bytes` (445,993,984) counted the 112 MiB the compiler placed in VMEM.
"""

from sharding.compiled_memory import compiled_memory, memory_spaces

REPORT = """Memory Space: default (color=0)
Total bytes: 405420544 (386.64MiB)
  cumulative_size;       size;       offset; used_by_n_values; shapes_list
  ------------------------------------------------------------
   64.00MiB( 16%);   64.00MiB;      9060352;                5; 5×bf16[8,8,1024,512]

Memory Space: vmem (color=1)
Total bytes: 117440512 (112.00MiB)

Memory Space: smem (color=2)
Total bytes: 148 (148B)
"""
STATS = {"argument": 53569536, "output": 53505024, "alias": 53504000, "temp": 445993984,
         "host_argument": 0, "host_output": 0, "host_temp": 0}


def test_the_memory_spaces_of_the_usage_report():
    assert memory_spaces(REPORT) == {"default": 405420544, "vmem": 117440512, "smem": 148}
    assert memory_spaces("no report here") == {}


def test_the_verdict_counts_the_hbm_temporaries_only():
    outputs = 53505024 - 53504000
    hbm_temp = 405420544 - 53569536 - outputs  # the default space spans the arguments too
    mem = compiled_memory({**STATS, "hbm_temp": hbm_temp, "other_spaces": 117440660},
                          on_cpu=False)
    assert dict(mem.components)["temporaries"] == hbm_temp
    assert mem.program_bytes == 405420544
    assert ("the compiler's memory analysis counts 445.99 MB of temporaries; its buffer "
            "assignment places 351.85 MB in HBM and 117.44 MB in other memory spaces (VMEM, "
            "host): the verdict counts the HBM assignment") in mem.notes
    # a small program's figures keep their digits: a tiny model on v5e 2x4 read "counts
    # 0.00 GB of temporaries ... places 0.00 GB in HBM" beside "1.90 MB temporaries"
    small = compiled_memory({**STATS, "temp": 2_600_000, "hbm_temp": 1_900_000,
                             "other_spaces": 700_000}, on_cpu=False)
    assert ("counts 2.60 MB of temporaries; its buffer assignment places 1.90 MB in HBM and "
            "700.00 KB in other memory spaces") in small.notes[0]
    # without the report (a cached entry of an older version, XLA:CPU): the analysis' figure
    assert dict(compiled_memory(STATS, on_cpu=False).components)["temporaries"] == 445993984
