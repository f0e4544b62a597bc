"""The test launcher's promise under a hang: a launch that outlives its timeout fails the test, naming where each
rank is stuck, and its launcher (forked by the session's launch server, not a child of the test) and its workers are
all killed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ..launch import finish, start_torchrun


@pytest.mark.timeout(120)
def test_a_hung_launch_is_killed_with_everything_below_it(tmp_path):
    script = tmp_path / "hang.py"
    # one write per worker line, so that the two ranks' lines never interleave
    script.write_text("import os, time\nos.write(1, f'worker {os.getpid()}\\n'.encode())\ntime.sleep(600)\n")
    proc = start_torchrun(2, script, [])
    with pytest.raises(TimeoutError, match="hung for 15s") as caught:
        finish(proc, 15)
    workers = [int(line.split()[1]) for line in str(caught.value).splitlines() if line.startswith("worker ")]
    assert len(workers) == 2, str(caught.value)
    assert str(caught.value).count(f'File "{script}", line 3 in <module>') == 2  # each rank's stack, where it hangs
    time.sleep(1)
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists() and not _zombie(pid)]


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
