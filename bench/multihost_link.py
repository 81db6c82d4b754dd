"""The rig's link rate: TCP goodput between two simulated hosts (network
namespaces, sharc.multihost), with each link at --rate or unlimited.

    python bench/multihost_link.py --rate 200mbit [--mbytes 50]

Host 1 listens, host 0 connects and sends --mbytes MB (then the reverse
direction); the receiver times from its first byte to the last. Bounded in
bytes and in time (sockets time out after 30 s). Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

PORT = 29555
CHUNK = 1 << 16
SOCKET_TIMEOUT_S = 30


def serve(nbytes: int) -> None:
    """Receives nbytes on one connection; prints bytes and seconds as JSON."""
    with socket.create_server(("0.0.0.0", PORT)) as srv:
        srv.settimeout(SOCKET_TIMEOUT_S)
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(SOCKET_TIMEOUT_S)
            got, first = 0, None
            while got < nbytes:
                data = conn.recv(CHUNK)
                if not data:
                    break
                first = first or time.perf_counter()
                got += len(data)
            seconds = time.perf_counter() - first
    print(json.dumps({"bytes": got, "seconds": seconds}))


def send(addr: str, nbytes: int) -> None:
    deadline = time.monotonic() + 10
    while True:  # the server may not be listening yet
        try:
            conn = socket.create_connection((addr, PORT), timeout=SOCKET_TIMEOUT_S)
            break
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    payload = os.urandom(CHUNK)
    with conn:
        sent = 0
        while sent < nbytes:
            conn.sendall(payload[:min(CHUNK, nbytes - sent)])
            sent += min(CHUNK, nbytes - sent)


def _transfer(rig, src: int, dst: int, nbytes: int) -> dict:
    me = [sys.executable, os.path.abspath(__file__)]
    server = subprocess.Popen(rig.exec_argv(dst, [*me, "--serve", str(nbytes)]),
                              stdout=subprocess.PIPE, text=True)
    subprocess.run(rig.exec_argv(src, [*me, "--send", rig.addr(dst), str(nbytes)]),
                   check=True, timeout=SOCKET_TIMEOUT_S * 2)
    out, _ = server.communicate(timeout=SOCKET_TIMEOUT_S * 2)
    result = json.loads(out)
    result["mbit_per_s"] = result["bytes"] * 8 / result["seconds"] / 1e6
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", default=None, help="e.g. 200mbit (default unlimited)")
    p.add_argument("--mbytes", type=float, default=50.0)
    p.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--send", nargs=2, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve is not None:
        serve(a.serve)
        return 0
    if a.send is not None:
        send(a.send[0], int(a.send[1]))
        return 0
    # Imported here, not above: the sender and receiver need only sockets.
    from sharc.multihost import Rig, RigConfig, preflight

    reason = preflight()
    if reason:
        print(f"multihost_link: {reason}", file=sys.stderr)
        return 77
    nbytes = int(a.mbytes * 1e6)
    with Rig(RigConfig(hosts=2, rate=a.rate, prefix="sharcmhlink")) as rig:
        for src, dst in ((0, 1), (1, 0)):
            r = _transfer(rig, src, dst, nbytes)
            print(f"link {a.rate or 'unlimited'}: host {src} -> host {dst}: "
                  f"{r['bytes'] / 1e6:.1f} MB in {r['seconds']:.2f} s = "
                  f"{r['mbit_per_s']:.1f} Mbit/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
