"""Simulated hosts on one machine: network namespaces joined by a bridge, with
one torchrun agent per namespace (docs/multihost.md).

    python -m sharc.multihost --hosts 2 --nproc-per-host 2 --rate 200mbit -- \\
        -m sharc.train --steps 20
    bash scripts/multihost.sh ...            # the same

What it builds (PREFIX defaults to "sharcmh"):

    PREFIX-sw   a namespace holding the bridge br0 (the "switch"), no address
    PREFIX-hI   host I: loopback, and rig0 = 10.213.0.(100+I)/24, a veth whose
                peer pI is a port of br0

Nothing is created in the root namespace: the subnet exists only on the
interfaces above, so the ranks' traffic cannot leave them, and deleting the
namespaces removes every interface with them. With --rate, a tbf qdisc
limits each veth end's egress (rig0: what host I sends; pI: what it
receives), so each host has a link of that rate in both directions. Ranks on
one host reach each other's rig0 address through the host's own routing
table, i.e. over loopback, never through the limited link.

[Note: why torchrun needs more than --rdzv-endpoint here]
Every namespace shares the machine's hostname, and that name resolves to an
address no namespace has. torchrun and gloo fall back to the hostname in
three places, so each is given the host's address instead:
  - the c10d rendezvous store is hosted by the agent that thinks the
    endpoint is its own address (a guess from the hostname): --rdzv-conf
    is_host=1 on host 0 and is_host=0 elsewhere;
  - the address the workers' MASTER_ADDR is taken from is node rank 0's
    --local-addr (else its FQDN);
  - gloo binds to the address of GLOO_SOCKET_IFNAME (else the hostname's).
The rendezvous gives node ranks in the sorted order of the agents' addresses
(as strings), so every address has three digits in its last octet: host I is
node rank I, and global ranks I*M .. I*M+M-1 live on host I.

[Note: cleanup]
Whatever ends the job (it finishes, a rank dies, Ctrl-C, SIGTERM, SIGHUP), the
rig stops every process in its namespaces and deletes them: first SIGTERM to
each agent (torchrun forwards it to its workers), then SIGKILL to every
process still in a namespace (`ip netns pids`: workers run in sessions of
their own, so the namespace, not a process group, is what holds them all),
then `ip netns del`. A rig killed with SIGKILL cannot clean up; the next run
removes the leftovers of its prefix before it builds anything.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

EXIT_NO_NAMESPACES = 77
"""Exit status when namespaces cannot be made here (not root, no `ip netns`):
the automake/CTest convention for "skipped", distinct from a job's failure."""
EXIT_TIMEOUT = 124  # as timeout(1)

SUBNET = "10.213.0"
"""The rig's private /24. It lives only on interfaces inside the rig's
namespaces, so it can collide with nothing outside them."""
IFNAME = "rig0"
"""A host's interface: a name no real machine uses, so GLOO_SOCKET_IFNAME can
never pick a real interface by mistake."""
FIRST_OCTET = 100  # host I is SUBNET.(100 + I): three digits, see the note
MAX_HOSTS = 100
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")
_RATE_BITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_TERM_GRACE_S = 5.0
ETC_NETNS = "/etc/netns"


class RigError(RuntimeError):
    """The namespaces could not be made (see `EXIT_NO_NAMESPACES`)."""


@dataclass(kw_only=True, slots=True)
class RigConfig:
    hosts: int = 2
    """Simulated hosts (network namespaces)."""
    rate: str | None = None
    """Each host's link rate in both directions, e.g. "200mbit" (tbf); None:
    unlimited."""
    prefix: str = "sharcmh"
    """Names of the namespaces (PREFIX-sw, PREFIX-h0, ...); leftovers of an
    earlier run with this prefix are removed first."""

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= MAX_HOSTS:
            raise ValueError(f"--hosts must be between 1 and {MAX_HOSTS}, got {self.hosts}")
        if self.rate is not None and not (_RATE.match(self.rate) and rate_bits(self.rate) > 0):
            raise ValueError(f"--rate must be a positive number followed by kbit, mbit or gbit "
                             f"(e.g. 200mbit), got {self.rate!r}")
        # Namespace names become file names under /run/netns; keep them plain.
        if not re.fullmatch(r"[a-z][a-z0-9]{0,11}", self.prefix):
            raise ValueError(f"--prefix must be 1-12 lowercase letters and digits, starting "
                             f"with a letter, got {self.prefix!r}")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RigError(f"'ip {' '.join(args)}' failed: {r.stderr.strip()}")
    return r


def rate_bits(rate: str) -> float:
    """Bits per second of a --rate such as "200mbit" (tc's units: 10^3)."""
    value, unit = _RATE.match(rate).groups()
    return float(value) * _RATE_BITS[unit]


def _tbf_args(rate: str) -> list[str]:
    """tbf for `rate`: a burst of 2 ms at that rate (at least a few full
    frames; veth's 64 KiB GSO packets are split by tbf when larger), and a
    queue of 20 ms, so TCP sees drops and backs off instead of queueing for
    seconds."""
    bytes_per_s = rate_bits(rate) / 8
    burst = max(int(bytes_per_s * 0.002), 3 * 1514)
    return ["tbf", "rate", rate, "burst", str(burst), "latency", "20ms"]


def preflight() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or skip the multi-host rig)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' (iproute2) is not installed"
    probe = f"sharcmhprobe{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"'ip netns add' failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Rig:
    """The namespaces, built on entering and removed on leaving (also after
    an exception). Processes are started in a host with `exec_argv`."""

    def __init__(self, config: RigConfig) -> None:
        self.config = config
        self.switch = f"{config.prefix}-sw"
        self.hosts = [f"{config.prefix}-h{i}" for i in range(config.hosts)]

    @staticmethod
    def addr(i: int) -> str:
        return f"{SUBNET}.{FIRST_OCTET + i}"

    def exec_argv(self, i: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[i], *argv]

    def __enter__(self) -> Rig:
        remove_namespaces(self.config.prefix)  # a run killed with SIGKILL left them
        try:
            self._build()
        except BaseException:
            remove_namespaces(self.config.prefix)
            raise
        return self

    def __exit__(self, *exc) -> None:
        remove_namespaces(self.config.prefix)

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.hosts):
            _ip("netns", "add", ns)
            # IPv4 only: gloo takes the first address of GLOO_SOCKET_IFNAME,
            # which could otherwise be an IPv6 link-local one.
            for conf in ("all", "default"):
                subprocess.run(["ip", "netns", "exec", ns, "sh", "-c",
                                f"echo 1 > /proc/sys/net/ipv6/conf/{conf}/disable_ipv6"],
                               check=True)
            # Both ends are created inside their namespaces: nothing ever
            # appears in the root namespace, even if the rig dies half-way.
            _ip("link", "add", IFNAME, "netns", ns, "type", "veth",
                "peer", "name", f"p{i}", "netns", self.switch)
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self._write_etc(ns)
            if self.config.rate:
                self._limit(ns, IFNAME)
                self._limit(self.switch, f"p{i}")

    def _write_etc(self, ns: str) -> None:
        """`ip netns exec` mounts /etc/netns/NS/* over /etc/*: each host
        resolves the rig's addresses to names from a hosts file of its own
        (gloo and the TCP store look peers' names up), and has no name
        server, so no lookup ever leaves for the machine's resolver."""
        etc = os.path.join(ETC_NETNS, ns)
        os.makedirs(etc, exist_ok=True)
        # The TCP store listens on IPv6 sockets too and names its clients
        # by their IPv4-mapped addresses: map those as well.
        names = "".join(f"{self.addr(i)} {h}\n::ffff:{self.addr(i)} {h}\n"
                        for i, h in enumerate(self.hosts))
        with open(os.path.join(etc, "hosts"), "w") as f:
            f.write(f"127.0.0.1 localhost\n{names}")
        with open(os.path.join(etc, "resolv.conf"), "w") as f:
            f.write("# sharc.multihost: no name server inside the rig\n")

    def _limit(self, ns: str, dev: str) -> None:
        r = subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root",
                            *_tbf_args(self.config.rate)], capture_output=True, text=True)
        if r.returncode != 0:
            raise RigError(f"tc tbf on {ns}/{dev} failed: {r.stderr.strip()}")

    def link_bytes(self) -> list[dict]:
        """Bytes each host sent and received over its link (not loopback)."""
        out = []
        for i, ns in enumerate(self.hosts):
            r = _ip("-j", "-s", "-n", ns, "link", "show", "dev", IFNAME)
            stats = json.loads(r.stdout)[0]["stats64"]
            out.append({"host": i, "addr": self.addr(i), "tx_bytes": stats["tx"]["bytes"],
                        "rx_bytes": stats["rx"]["bytes"]})
        return out


def _own_namespaces(prefix: str) -> list[str]:
    """The rig's namespaces, and any /etc/netns folder of its naming left."""
    names = set(_ip("netns", "list", check=False).stdout.split())
    if os.path.isdir(ETC_NETNS):
        names.update(os.listdir(ETC_NETNS))
    pattern = re.compile(rf"{re.escape(prefix)}-(sw|h\d+)")
    return sorted(n for n in names if pattern.fullmatch(n))


def remove_namespaces(prefix: str) -> None:
    """Kills every process left in the rig's namespaces (started by a rig of
    this prefix) and deletes them, with their interfaces and the bridge.
    A second Ctrl-C meanwhile waits until this is done."""
    stops = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    try:
        _remove(prefix)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _remove(prefix: str) -> None:
    for ns in _own_namespaces(prefix):
        pids = _ip("netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        _ip("netns", "del", ns, check=False)
        shutil.rmtree(os.path.join(ETC_NETNS, ns), ignore_errors=True)
    try:
        os.rmdir(ETC_NETNS)  # only if empty: another rig may be using it
    except OSError:
        pass


# ----------------------------------------------------------- the job


@dataclass(kw_only=True, slots=True)
class JobConfig:
    nproc_per_host: int = 1
    port: int = 29400
    """The rendezvous port on host 0."""
    timeout_s: float | None = None
    """Stop the job after this many seconds (exit status 124)."""
    grace_s: float = 10.0
    """After one agent fails, how long the others get to stop on their own
    before they are stopped."""


class _Stop(Exception):
    """SIGINT, SIGTERM or SIGHUP arrived: unwind so that cleanup runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _agent_argv(rig: Rig, i: int, job: JobConfig, rdzv_id: str, target: list[str]) -> list[str]:
    """torchrun on host i (see [Note: why torchrun needs more than
    --rdzv-endpoint here])."""
    return rig.exec_argv(i, [
        "env", f"GLOO_SOCKET_IFNAME={IFNAME}",
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(len(rig.hosts)), "--nproc-per-node", str(job.nproc_per_host),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{rig.addr(0)}:{job.port}",
        "--rdzv-id", rdzv_id, "--rdzv-conf", f"is_host={int(i == 0)}",
        "--local-addr", rig.addr(i), "--max-restarts", "0", *target])


def run_job(rig: Rig, job: JobConfig, target: list[str]) -> int:
    """Runs torchrun's `target` (a script and its arguments, or -m MODULE ...)
    with one agent per host; returns 0 when every agent succeeds, else the
    first failing agent's exit status (or 124 on timeout)."""
    rdzv_id = uuid.uuid4().hex[:12]
    # Sessions of their own: a Ctrl-C in the terminal reaches only the rig,
    # which then stops the agents in order.
    agents = [subprocess.Popen(_agent_argv(rig, i, job, rdzv_id, target),
                               start_new_session=True) for i in range(len(rig.hosts))]
    try:
        return _supervise(agents, job)
    finally:
        _stop_agents(agents)


def _supervise(agents: list[subprocess.Popen], job: JobConfig) -> int:
    deadline = None if job.timeout_s is None else time.monotonic() + job.timeout_s
    while True:
        codes = [a.poll() for a in agents]
        if all(c == 0 for c in codes):
            return 0
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            i, code = failed[0]
            _say(f"host {i}'s agent exited with status {code}; stopping the other hosts "
                 f"(they get {job.grace_s:g}s to stop on their own)")
            _wait_all(agents, time.monotonic() + job.grace_s)
            return code
        if deadline is not None and time.monotonic() > deadline:
            _say(f"the job ran past --timeout {job.timeout_s:g}s; stopping it")
            return EXIT_TIMEOUT
        time.sleep(0.2)


def _wait_all(agents: list[subprocess.Popen], deadline: float) -> None:
    for a in agents:
        try:
            a.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def _stop_agents(agents: list[subprocess.Popen]) -> None:
    """SIGTERM to agents still running (torchrun stops its workers), then,
    after a grace, SIGKILL; what is left in the namespaces is killed when
    they are removed."""
    running = [a for a in agents if a.poll() is None]
    for a in running:
        a.send_signal(signal.SIGTERM)
    _wait_all(running, time.monotonic() + _TERM_GRACE_S)
    for a in running:
        if a.poll() is None:
            a.kill()
            a.wait()


# ----------------------------------------------------------- command line


def _parse(argv: list[str] | None) -> tuple[RigConfig, JobConfig, list[str], str | None]:
    p = argparse.ArgumentParser(
        prog="multihost", description=__doc__.split("\n")[0],
        usage="%(prog)s [options] -- (SCRIPT | -m MODULE) [ARGS...]")
    p.add_argument("--hosts", type=int, default=2, help="simulated hosts (default 2)")
    p.add_argument("--nproc-per-host", type=int, default=1, help="ranks per host (default 1)")
    p.add_argument("--rate", default=None,
                   help="each host's link rate in both directions, e.g. 200mbit "
                        "(default unlimited)")
    p.add_argument("--prefix", default="sharcmh", help="namespace names' prefix")
    p.add_argument("--port", type=int, default=29400, help="rendezvous port on host 0")
    p.add_argument("--timeout", type=float, default=None, help="stop the job after S seconds")
    p.add_argument("--grace", type=float, default=10.0,
                   help="after a host's agent fails, seconds the others get to stop on "
                        "their own before they are stopped (default 10)")
    p.add_argument("--report", default=None,
                   help="write a JSON report (exit status, hosts, bytes over each link)")
    p.add_argument("target", nargs=argparse.REMAINDER, help="what torchrun runs")
    a = p.parse_args(argv)
    target = a.target[1:] if a.target[:1] == ["--"] else a.target
    if not target:
        p.error("give what to run after --, e.g. -- -m sharc.train --steps 20")
    rig = RigConfig(hosts=a.hosts, rate=a.rate, prefix=a.prefix)
    if a.nproc_per_host < 1:
        p.error("--nproc-per-host must be at least 1")
    if a.grace < 0 or (a.timeout is not None and a.timeout <= 0):
        p.error("--grace must not be negative, --timeout must be positive")
    return rig, JobConfig(nproc_per_host=a.nproc_per_host, port=a.port, timeout_s=a.timeout,
                          grace_s=a.grace), target, a.report


def _on_signal(signum, _frame):
    raise _Stop(signum)


def main(argv: list[str] | None = None) -> int:
    try:
        rig_config, job, target, report = _parse(argv)
    except ValueError as e:
        print(f"multihost: {e}", file=sys.stderr)
        return 2
    reason = preflight()
    if reason is not None:
        print(f"multihost: cannot build simulated hosts: {reason}", file=sys.stderr)
        return EXIT_NO_NAMESPACES
    # SIGINT too: Python leaves it ignored when the rig was started with it
    # ignored (a background job of a script), and Ctrl-C must still clean up.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _on_signal)
    code, links = 1, []
    try:
        with Rig(rig_config) as rig:
            _say(f"{len(rig.hosts)} hosts ({', '.join(map(rig.addr, range(len(rig.hosts))))} "
                 f"on {SUBNET}.0/24), {job.nproc_per_host} rank(s) each, links "
                 f"{rig_config.rate or 'unlimited'}")
            code = run_job(rig, job, target)
            links = rig.link_bytes()
    except RigError as e:
        _say(f"cannot build simulated hosts: {e}")
        code = EXIT_NO_NAMESPACES
    except _Stop as e:
        code = 128 + e.signum
    for link in links:
        _say(f"host {link['host']} ({link['addr']}) sent {link['tx_bytes'] / 2**20:.2f} MiB, "
             f"received {link['rx_bytes'] / 2**20:.2f} MiB over its link")
    if report:
        with open(report, "w") as f:
            json.dump({"exit_status": code, "hosts": rig_config.hosts,
                       "nproc_per_host": job.nproc_per_host, "rate": rig_config.rate,
                       "links": links}, f, indent=1)
    return code


def _say(text: str) -> None:
    print(f"multihost: {text}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
