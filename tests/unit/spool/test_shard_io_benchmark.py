"""benchmarks/shard_io.py in miniature (3 shards), so it never rots: it writes and reads real
shards of the current schema and prints every figure docs/performance.md quotes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_the_shard_benchmark_reports_datasets_write_read_and_load():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    out = subprocess.run(
        [sys.executable, "benchmarks/shard_io.py", "--repeats", "3"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env=env,
        timeout=300,
    ).stdout
    assert re.search(r"^1 datasets, \d+ bytes per shard, 3 shards$", out, re.M), out
    for phase in ("write", "read"):
        assert re.search(rf"^{phase}: median \d+\.\d\d ms CPU, mean \d+\.\d\d$", out, re.M), out
    assert re.search(r"^load \(1 min\) \d+\.\d\d -> \d+\.\d\d$", out, re.M), out
