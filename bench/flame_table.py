#!/usr/bin/env python3
"""Where a decision's CPU goes, from a folded perf profile (inferno-collapse-perf output).

    bench/flame_table.py FOLDED [CPU_US_PER_DECISION]

FOLDED comes from `inferno-collapse-perf --all` (kernel frames marked). A sample in the kernel
is the kernel's, by the system call it is in; any other is given to the first part, from its
innermost frame outwards, that one of its frames belongs to; the table gives each part's share of the samples and, with the CPU per
decision measured beside it, its microseconds. Used by bench/path.sh (ONLY=flame bench/run).
"""
import re
import sys

# (part, frame pattern) for tollgate's own frames and its libraries, innermost match wins:
# allocation inside h2 counts as allocation.
PARTS = [
    ("allocation (mimalloc)", r"^_?mi_|mimalloc"),
    ("Redis client (redis crate, RESP)", r"^redis::|<redis::|combine::"),
    ("tollgate: Redis store and coalescer", r"tollgate::store::redis"),
    ("tollgate: pre-check", r"tollgate::store::precheck"),
    ("tollgate: decision (limiter, matching, keys)", r"tollgate::(limiter|matcher|identity|config|bucket)"),
    ("tollgate: RLS edge (validate, encode, headers)", r"tollgate::edge::rls"),
    ("metrics and traces", r"^metrics|<metrics|metrics_exporter|metrics_util|tracing"),
    ("protobuf (prost)", r"prost::|<prost"),
    ("HTTP/2 and gRPC (h2, hyper, tonic, tower, axum)", r"h2::|<h2::|hyper::|<hyper|tonic::|<tonic|tower::|<tower|axum::|<axum|http::"),
    ("Tokio runtime (tasks, timers, I/O driver)", r"tokio::|<tokio|mio::"),
]
# A sample whose innermost frame is the kernel's (inferno marks them `_[k]`) is the kernel's,
# by the system call it is in.
KERNEL = [
    ("kernel: socket I/O and loopback delivery", r"writev|readv|sendmsg|recvmsg|recvfrom|sendto|sys_write|sys_read|tcp_|sock_"),
    ("kernel: scheduling, wake-ups, futex, epoll", r"futex|schedule|epoll|wake_up|nanosleep"),
]


def part_of(frames, compiled, kernel):
    if frames and frames[-1].endswith("_[k]"):
        stack = ";".join(frames)
        return next((name for name, regex in kernel if regex.search(stack)), "kernel: other")
    for frame in reversed(frames):
        hit = next((name for name, regex in compiled if regex.search(frame)), None)
        if hit:
            return hit
    return "other"


def main():
    folded = sys.argv[1]
    cpu_us = float(sys.argv[2]) if len(sys.argv) > 2 else None
    compiled = [(name, re.compile(pattern)) for name, pattern in PARTS]
    kernel = [(name, re.compile(pattern)) for name, pattern in KERNEL]
    counts = {}
    total = 0
    with open(folded) as lines:
        for line in lines:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            n = int(n)
            total += n
            part = part_of(stack.split(";"), compiled, kernel)
            counts[part] = counts.get(part, 0) + n
    header = "| part | share of tollgate's CPU |" + (" µs per decision |" if cpu_us else "")
    print(header)
    print("|---|---:|" + ("---:|" if cpu_us else ""))
    for name, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        if n == 0:
            continue
        share = n / max(1, total)
        row = f"| {name} | {share * 100:.1f} % |"
        if cpu_us:
            row += f" {share * cpu_us:.1f} |"
        print(row)
    print(f"\n{total / 1e9:.2f} s of CPU sampled (perf cpu-clock).")


if __name__ == "__main__":
    main()
