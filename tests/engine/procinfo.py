"""What /proc says of another process: the nice value of each of its threads, and its environment."""
from __future__ import annotations

import os


def thread_nices_and_env(pid: int) -> tuple[set[int], dict[str, str]]:
    """The nice value of every thread of process `pid`, and its environment."""
    nices = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            nices.add(int(f.read().rsplit(")", 1)[1].split()[16]))     # field 19: nice
    with open(f"/proc/{pid}/environ") as f:
        env = dict(kv.split("=", 1) for kv in f.read().split("\0") if "=" in kv)
    return nices, env
