"""Every byte a rank sends, whatever the socket and however short its life (issue 40 item 3): a counter in the kernel.

The witness counts bytes at the rank's TCP sockets (tests/harness_sockets.py): the parent lists them every 50 ms
through NETLINK_SOCK_DIAG and reads each one's counters. A connection opened and closed between two listings is
never seen (issue 40: sixteen connections of 1 MiB each counted as 384 bytes). A socket's final counters do reach a
NETLINK_SOCK_DIAG listener bound to the SKNLGRP_INET_TCP_DESTROY groups, but that needs CAP_NET_ADMIN, and the
message names no process (its inode is 0 by then; its uid is the rank user's, which every rank shares).

Here instead the kernel adds up the packets themselves: a BPF program of type cgroup_skb, attached to the egress of a
cgroup v2 the rank joins before it opens any socket, adds each packet's length (``skb->len``: from the IP header
on) to a map the parent reads. It sees every packet sent by a socket created in that cgroup: TCP (gloo's and any
other, short or long), and UDP or raw where the filter would let them through. It counts headers and the receiver's
acknowledgements too (measured: 16 connections of 1 MiB plus 0.96 MB of UDP, 17,737,216 bytes of payload, counted
18,006,844: 1.5% more), so ``sent()`` also gives the packets, and a bound on payload is ``bytes - 40 * packets``.

It needs a writable cgroup v2 hierarchy (/sys/fs/cgroup, or /sys/fs/cgroup/unified on a hybrid machine) and the
right to load BPF programs (root with CAP_SYS_ADMIN or CAP_BPF): a Gradescope container (Docker: cgroup file system
read-only, no CAP_SYS_ADMIN) has neither, and there ``CgroupTraffic.create`` returns None.

Not wired into the harness yet (tests/harness.py and tests/harness_sockets.py are another room's): see the module's
staff test, tests/staff/test_rank_traffic.py, for what it counts.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct

_NR_BPF = {"x86_64": 321, "aarch64": 280}
_BPF_MAP_CREATE, _BPF_MAP_LOOKUP_ELEM, _BPF_PROG_LOAD, _BPF_PROG_ATTACH, _BPF_PROG_DETACH = 0, 1, 5, 8, 9
_BPF_MAP_TYPE_ARRAY, _BPF_PROG_TYPE_CGROUP_SKB, _BPF_CGROUP_INET_EGRESS = 2, 8, 1
V2_ROOTS = ("/sys/fs/cgroup/unified", "/sys/fs/cgroup")


def _v2_root() -> str | None:
    """The cgroup v2 hierarchy (only v2 has cgroup.controllers): all of /sys/fs/cgroup, or its unified part."""
    for root in V2_ROOTS:
        if os.path.isfile(os.path.join(root, "cgroup.controllers")):
            return root
    return None


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


class CgroupTraffic:
    """A cgroup v2 whose sockets' outgoing packets are counted: ``add(pid)`` before the process opens a socket,
    ``sent()`` -> (bytes, packets), ``remove()`` at the end."""

    def __init__(self, path: str, map_fd: int, prog_fd: int):
        self.path, self.map_fd, self.prog_fd = path, map_fd, prog_fd

    @classmethod
    def create(cls, name: str) -> "CgroupTraffic | None":
        """The cgroup and its counter, or None where this machine allows neither (not root, no cgroup v2 to
        write, no BPF)."""
        root = _v2_root()
        if os.geteuid() != 0 or root is None or platform.machine() not in _NR_BPF:
            return None
        path = os.path.join(root, name)
        try:
            os.mkdir(path, 0o755)
        except OSError:
            return None
        map_fd = prog_fd = -1
        try:
            map_fd = _bpf(_BPF_MAP_CREATE, struct.pack("<IIII", _BPF_MAP_TYPE_ARRAY, 4, 8, 2))
            prog_fd = _load(map_fd)
            cgroup = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                _bpf(_BPF_PROG_ATTACH, struct.pack("<IIII", cgroup, prog_fd, _BPF_CGROUP_INET_EGRESS, 0))
            finally:
                os.close(cgroup)
        except OSError:
            for fd in (map_fd, prog_fd):
                if fd >= 0:
                    os.close(fd)
            os.rmdir(path)
            return None
        return cls(path, map_fd, prog_fd)

    def add(self, pid: int) -> bool:
        try:
            with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
                f.write(str(pid))
            return True
        except OSError:
            return False

    def sent(self) -> tuple[int, int]:
        """(bytes, packets) sent so far by the sockets created in the cgroup, open or closed."""
        return self._read(0), self._read(1)

    def _read(self, index: int) -> int:
        key, value = ctypes.c_uint32(index), ctypes.c_uint64(0)
        _bpf(_BPF_MAP_LOOKUP_ELEM, struct.pack("<IIQQ", self.map_fd, 0, ctypes.addressof(key),
                                               ctypes.addressof(value)))
        return value.value

    def remove(self) -> None:
        """Close the counter (the program goes with the cgroup) and remove the cgroup once its processes are gone."""
        for fd in (self.prog_fd, self.map_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def _bpf(cmd: int, attr: bytes) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(attr, max(len(attr), 128))
    result = libc.syscall(ctypes.c_long(_NR_BPF[platform.machine()]), ctypes.c_int(cmd), buf,
                          ctypes.c_uint(len(buf)))
    if result < 0:
        raise OSError(ctypes.get_errno(), f"bpf({cmd}): {os.strerror(ctypes.get_errno())}")
    return result


def _load(map_fd: int) -> int:
    """The program: map[0] += skb->len, map[1] += 1, let the packet go."""
    count = []
    for index, add in ((0, "len"), (1, "one")):
        count += [
            _insn(0x62, 10, 0, -4, index),            # *(u32 *)(r10 - 4) = index (the key)
            _insn(0x18, 1, 1, 0, map_fd), _insn(0),   # r1 = the map (ld_imm64, BPF_PSEUDO_MAP_FD)
            _insn(0xBF, 2, 10), _insn(0x07, 2, 0, 0, -4),  # r2 = r10 - 4
            _insn(0x85, 0, 0, 0, 1),                  # call bpf_map_lookup_elem
            _insn(0x15, 0, 0, 1, 0),                  # if r0 == 0: skip the add
            _insn(0xDB, 0, 7 if add == "len" else 8, 0, 0),  # lock *(u64 *)(r0 + 0) += r7 (length) or r8 (1)
        ]
    program = b"".join([
        _insn(0x61, 7, 1, 0),      # r7 = *(u32 *)(r1 + 0): skb->len
        _insn(0xB7, 8, 0, 0, 1),   # r8 = 1
        *count,
        _insn(0xB7, 0, 0, 0, 1),   # r0 = 1: let the packet go
        _insn(0x95),               # exit
    ])
    code, licence = ctypes.create_string_buffer(program), ctypes.create_string_buffer(b"GPL")
    # bpf_attr for BPF_PROG_LOAD: type, insn_cnt, insns, license, log_level, log_size, log_buf, kern_version,
    # prog_flags, prog_name[16], prog_ifindex, expected_attach_type
    attr = struct.pack("<IIQQIIQII16sII", _BPF_PROG_TYPE_CGROUP_SKB, len(program) // 8, ctypes.addressof(code),
                       ctypes.addressof(licence), 0, 0, 0, 0, 0, b"fsdp_rank_sent", 0, _BPF_CGROUP_INET_EGRESS)
    return _bpf(_BPF_PROG_LOAD, attr)
