"""What a GPU device call carries (bench/device_bundle.py) places every run-time dependency of warmgate: a new one is
caught here, on the CPU, rather than by a device call whose engines cannot import it."""

from __future__ import annotations

import subprocess
import sys

from processes import REPO


def test_every_run_time_dependency_has_a_place_in_the_device_bundle() -> None:
    check = subprocess.run([sys.executable, str(REPO / "bench" / "device_bundle.py"), "--check"],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert check.returncode == 0, check.stderr
    assert "dependencies placed" in check.stdout
