"""`tokenyard bench gateway --workers 2`: the harness starts `tokenyard serve --workers 2` in
front of the mock replica and counts tokenyard's CPU over its whole process tree (the
parent and its workers), not the parent's alone. Real processes, no model.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tokenyard.bench.proctree import sample_proc, sample_tree, tree_pids
from tokenyard.cli import main as cli_main

#: A child that starts a grandchild which spins on the CPU, prints its pid, then waits.
_SPINNER = """
import subprocess, sys
spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
print(spin.pid, flush=True)
spin.wait()
"""


def test_sample_tree_counts_descendants_and_leaves_out_excluded() -> None:
    child = subprocess.Popen([sys.executable, "-c", _SPINNER], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        assert set(tree_pids(child.pid)) == {child.pid, grandchild}
        assert tree_pids(child.pid, exclude={grandchild}) == [child.pid]
        before, alone0 = sample_tree(child.pid), sample_tree(child.pid, {grandchild})
        spin0 = sample_proc(grandchild)
        # Until the spinner has had 0.2 s of CPU (however busy the machine is).
        deadline = time.monotonic() + 30.0
        while (spun := sample_proc(grandchild).cpu_s - spin0.cpu_s) < 0.2:
            assert time.monotonic() < deadline, "the spinner got no CPU"
            time.sleep(0.05)
        after, alone1 = sample_tree(child.pid), sample_tree(child.pid, {grandchild})
        # The tree counts the grandchild's CPU; the child itself (waiting) and the tree
        # without the grandchild barely move.
        # (CPU times are in clock ticks of 10 ms; float sums of them round, hence a tick.)
        assert after.cpu_s - before.cpu_s >= spun - 0.011, (before, after, spun)
        assert after.root_cpu_s - before.root_cpu_s < 0.05, (before, after)
        assert alone1.cpu_s - alone0.cpu_s < 0.05, (alone0, alone1)
        assert after.processes == 2 and alone1.processes == 1
        assert after.rss_mib > alone1.rss_mib > 0
    finally:
        for pid in tree_pids(child.pid)[1:]:
            subprocess.run(["kill", str(pid)], check=False)
        child.wait(10)


def test_bench_gateway_with_two_workers_counts_the_whole_tree(tmp_path: Path) -> None:
    out = tmp_path / "gateway.json"
    assert cli_main(["bench", "gateway", "--workers", "2", "--rates", "25", "--duration",
                     "2", "--modes", "stream", "--quiet", "--output-len", "4",
                     "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["workers"] == [2]
    [point] = doc["points"]
    assert (point["workers"], point["rate"], point["stream"]) == (2, 25, True)
    for side in ("direct", "gateway"):
        report = point[side]["report"]
        assert report["completed"] == report["sent"] > 0, report
        assert report["e2e_ms"]["p50"] > 0
        assert point[side]["client_cpu_pct"] > 0  # the load generator's own cost
        assert point[side]["machine_cpu_pct"] > 0  # and everyone's, others included
    assert set(point["overhead_e2e_ms"]) >= {"p50", "p99"}
    gateway = point["gateway"]
    # The serve parent and its two workers; the mock and this process are not counted.
    assert gateway["tokenyard_processes"] == 3, gateway
    # The workers serve, the parent only supervises (and holds the shared limiter): the
    # tree's CPU is more than the parent's, by at least the workers' share.
    tree, parent = (gateway["tokenyard_cpu_ms_per_request"],
                    gateway["tokenyard_parent_cpu_ms_per_request"])
    assert 0 < tree < 100 and parent >= 0, gateway
    assert tree > 2 * parent, gateway
    assert gateway["tokenyard_rss_mib"] > 0
    assert doc["tokenyard_peak_rss_mib_by_workers"]["2"] > 0
