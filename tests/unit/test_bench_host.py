import os
import subprocess
import sys
import time

from tokenyard.bench.host import OtherLoad

BUSY = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 1.0: pass"


def _spin(seconds: float) -> None:
    t = time.monotonic()
    while time.monotonic() - t < seconds:
        pass


def test_other_load_leaves_out_our_own_cpu_and_our_reaped_children() -> None:
    cores = os.cpu_count() or 1
    load = OtherLoad()
    start = time.monotonic()
    _spin(1.0)
    subprocess.run([sys.executable, "-c", BUSY], check=True)
    share = load.share(time.monotonic() - start)
    assert share is not None and share * cores < 0.5  # under half a core of anything else


def test_other_load_counts_a_process_we_did_not_wait_for() -> None:
    cores = os.cpu_count() or 1
    load = OtherLoad()
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", BUSY])
    time.sleep(1.2)
    share = load.share(time.monotonic() - start)
    proc.wait()
    assert share is not None and share * cores > 0.6  # most of one core, not ours
