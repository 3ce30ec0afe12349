"""pid 1 of a test host (tests/cluster/netns.py): make the host's own hostname, /etc/hosts, /tmp, /dev/shm and
/root (HOME: its ~/.ray, ~/.ssh, ~/.aws, kept across reboots like a disk),
say "ready", then reap orphans until killed. Runs inside fresh mount, UTS and PID namespaces.

usage: host_init.py NAME HOSTS_FILE HOME
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys


def _software_under_root() -> list[str]:
    real = os.path.realpath(sys.executable)
    if real.startswith("/root/"):
        return [real.split("/")[2]]
    return []


def main() -> None:
    name, hosts_file, home = sys.argv[1], sys.argv[2], sys.argv[3]
    socket.sethostname(name)
    subprocess.run(["mount", "--bind", hosts_file, "/etc/hosts"], check=True)
    # software this machine keeps under /root (pyenv's Python behind the virtualenv) stays visible
    for keep in _software_under_root():
        os.makedirs(os.path.join(home, keep), exist_ok=True)
        subprocess.run(["mount", "--bind", os.path.join("/root", keep), os.path.join(home, keep)], check=True)
    subprocess.run(["mount", "--rbind", home, "/root"], check=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2g", "tmpfs", "/tmp"], check=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1g", "tmpfs", "/dev/shm"], check=True)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    print("ready", flush=True)
    os.close(1)
    while True:  # pid 1 inherits every orphan of its namespace: reap them
        try:
            os.wait()
        except ChildProcessError:
            signal.pause()  # woken by SIGCHLD when a child is orphaned to us and exits


if __name__ == "__main__":
    signal.signal(signal.SIGCHLD, lambda *_: None)
    main()
