"""Test base images that QEMU accepts: an empty qcow2 (version 2) written byte by byte, so the
agent's overlay path (`qemu-img create -b`) runs over a real image wherever qemu-img exists, and
the copy path still sees a qcow2 where it does not.

Layout, one 64 KiB cluster each: header, refcount table, one refcount block, an all-zero L1
table (nothing allocated: every guest read returns zeros)."""

from __future__ import annotations

import struct
from pathlib import Path

_CLUSTER_BITS = 16
_CLUSTER = 1 << _CLUSTER_BITS


def empty_qcow2(virtual_size: int = 1 << 20) -> bytes:
    l2_span = _CLUSTER * (_CLUSTER // 8)  # guest bytes one L2 table maps
    l1_entries = max(1, -(-virtual_size // l2_span))
    header = struct.pack(
        ">IIQIIQIIQQIIQ",
        0x514649FB,  # "QFI\xfb"
        2,  # version
        0,  # backing_file_offset
        0,  # backing_file_size
        _CLUSTER_BITS,
        virtual_size,
        0,  # crypt_method
        l1_entries,
        3 * _CLUSTER,  # l1_table_offset
        1 * _CLUSTER,  # refcount_table_offset
        1,  # refcount_table_clusters
        0,  # nb_snapshots
        0,  # snapshots_offset
    )
    refcount_table = struct.pack(">Q", 2 * _CLUSTER)
    refcount_block = struct.pack(">4H", 1, 1, 1, 1)  # clusters 0-3 are in use, once each
    image = bytearray(4 * _CLUSTER)
    image[0 : len(header)] = header
    image[_CLUSTER : _CLUSTER + len(refcount_table)] = refcount_table
    image[2 * _CLUSTER : 2 * _CLUSTER + len(refcount_block)] = refcount_block
    return bytes(image)


def write_base_image(path: Path) -> bytes:
    """Write an empty qcow2 base image at `path`; its bytes (for the catalog's sha256)."""
    content = empty_qcow2()
    path.write_bytes(content)
    return content
