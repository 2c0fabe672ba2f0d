"""Preflight: can this node reach the rank-0 host before a rendezvous hangs on it?

`accel-train preflight --host H --port P --rank R` (launch.sh --preflight runs it) checks, within
--timeout seconds:
  1. H resolves (DNS or /etc/hosts);
  2. rank 0: H is an address of this machine and P is free on it (the rendezvous will listen there);
     other ranks: H:P accepts a TCP connection (retried until rank 0 is up or time runs out).
Both the name lookup and the connection are retried until --timeout (a lookup is never cut short
before it: one dead nameserver makes each take over 5 s), so a node that starts minutes before
rank 0 waits for it (launch.sh passes --rdzv_wait, default 600 s) instead of failing.
Each failure is one line naming what to set. Exit 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import errno
import socket
import sys
import threading
import time

from ..parser import Parser


def resolve(host: str, timeout: float) -> list[str]:
    """IPv4/IPv6 addresses of host, or [] if it does not resolve within timeout."""
    result: list[str] = []

    def work():
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            result.extend(dict.fromkeys(info[4][0] for info in infos))
        except OSError:
            pass

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(timeout)
    return result


def outgoing_interface(ip: str) -> str | None:
    """Name of the interface the kernel would use to reach ip (Linux), for the GLOO_SOCKET_IFNAME
    hint."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))
            local = s.getsockname()[0]
        import fcntl
        import struct

        for _, name in socket.if_nameindex():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                try:
                    # SIOCGIFADDR
                    packed = fcntl.ioctl(
                        s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15])
                    )
                except OSError:
                    continue
            if socket.inet_ntoa(packed[20:24]) == local:
                return name
    except (OSError, ImportError):
        return None
    return None


def check_port_free(ip: str, port: int) -> str | None:
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return (
                    f"port {port} is already in use on this rank-0 host; stop what holds it or "
                    "choose another MASTER_PORT / --main_process_port"
                )
            if e.errno == errno.EADDRNOTAVAIL:
                return (
                    f"{ip} is not an address of this machine, but this node has rank 0; "
                    "set MASTER_ADDR (or VC_WORKER_HOSTS / --init_method) to this node's own "
                    "address"
                )
            return f"cannot bind {ip}:{port} ({e.strerror})"
    return None


def check_reachable(ip: str, port: int, deadline: float) -> str | None:
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    last = "no attempt"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(min(3.0, remaining))
            try:
                s.connect((ip, port))
                return None
            except TimeoutError:
                last = "timed out (firewall, or a wrong address)"
            except OSError as e:
                last = {
                    errno.ECONNREFUSED: (
                        "connection refused (nothing listens there yet: is rank 0 up?)"
                    ),
                    errno.EHOSTUNREACH: "host unreachable (no route)",
                    errno.ENETUNREACH: "network unreachable (no route)",
                }.get(e.errno, e.strerror or str(e))
        time.sleep(min(0.5, max(deadline - time.monotonic(), 0)))
    iface = outgoing_interface(ip) if family == socket.AF_INET else None
    hint = (
        f"; traffic to {ip} leaves by {iface}: set GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME={iface}"
        if iface
        else ""
    )
    return (
        f"cannot reach rank 0 at {ip}:{port}: {last}; check that rank 0 is running, that the "
        f"firewall or security group opens port {port} between the nodes, and "
        f"MASTER_ADDR{hint}"
    )


def preflight(host: str, port: int, rank: int, timeout: float, log=print) -> list[str]:
    """Run the checks; return the failures (empty list = all good)."""
    deadline = time.monotonic() + timeout
    # A rank-0 pod's DNS name often appears only once that pod is up: ask again after each failed
    # answer, until the deadline. Each lookup may take the rest of the time: glibc waits 5 s per
    # nameserver that does not answer, so one dead nameserver makes every lookup longer than any
    # fixed cap (and a late answer is still an answer).
    while True:
        addresses = resolve(host, max(deadline - time.monotonic(), 0.1))
        if addresses or time.monotonic() >= deadline:
            break
        time.sleep(min(1.0, max(deadline - time.monotonic(), 0)))
    if not addresses:
        return [
            f"rank-0 host {host!r} does not resolve within {timeout:.0f}s; set MASTER_ADDR to "
            "an address or a name in DNS or /etc/hosts"
        ]
    ip = next((a for a in addresses if ":" not in a), addresses[0])
    log(f"preflight: {host} resolves to {ip}")
    if rank == 0:
        failure = check_port_free(ip, port)
        if failure is None:
            log(f"preflight: rank 0 can listen on {ip}:{port}")
    else:
        failure = check_reachable(ip, port, deadline)
        if failure is None:
            log(f"preflight: {ip}:{port} is reachable from this node")
    return [failure] if failure else []


def main_preflight(argv: list[str]) -> int:
    p = Parser(
        prog="accel-train preflight",
        description=(
            "Check, within a time bound, that the rank-0 host resolves and its "
            "rendezvous port is usable (rank 0) or reachable (other nodes)."
        ),
    )
    p.add_argument("--host", required=True, help="rank-0 host (MASTER_ADDR)")
    p.add_argument("--port", type=int, default=29500, help="rendezvous port (MASTER_PORT)")
    p.add_argument("--rank", type=int, default=0, help="this node's rank (NODE_RANK)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before giving up")
    args = p.parse_args(argv)
    failures = preflight(args.host, args.port, args.rank, args.timeout)
    for failure in failures:
        print(f"preflight: FAILED: {failure}", file=sys.stderr, flush=True)
    if not failures:
        print("preflight: ok", flush=True)
    return 1 if failures else 0
