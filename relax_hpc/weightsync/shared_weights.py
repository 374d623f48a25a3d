"""Named CPU tensors in one anonymous shared-memory file, for a process of the same host.

The trainer writes a policy version's weights into the file (one copy, as its snapshot
for a background send would make anyway) and hands another process only a small
placement: the wire protocol's ``Layout`` with one bucket (per tensor its name, dtype,
shape and byte offset). That process maps the same file and sees the tensors as views
(``protocol.unpack``), without a copy and without pickling them.

The file is a ``memfd`` (Linux): it has no name in any filesystem, so nothing is left
behind when both processes end, and only a process handed its descriptor can map it.
Offsets are aligned as on the wire, so that each byte slice can be viewed as its dtype. The
writer must not write while the reader still uses the previous placement
(``SenderProcess`` waits for a sync's reply before the next write). Must not: know what
the tensors are for.
"""

from __future__ import annotations

import mmap
import os
import sys
from collections.abc import Mapping

import torch

from relax_hpc.weightsync.protocol import Layout, as_named_list, plan_layout, unpack

# The whole file is one bucket of the wire protocol's layout (aligned offsets, known dtypes,
# unique names): no bucket size splits it.
_ONE_BUCKET = sys.maxsize


def place(named: Mapping[str, torch.Tensor]) -> Layout:
    """Where each of ``named`` lies in the file, in their order: one bucket of the wire
    protocol's layout (``protocol.plan_layout``), dtypes kept."""
    return plan_layout(as_named_list(named), _ONE_BUCKET, None)


class SharedWeights:
    """One memfd and its mapping, on either side; ``fd`` is what the other process needs.

    Both sides keep the views of the last placement: every version of a policy has the
    same names, dtypes and shapes, so a write is one ``copy_`` per tensor and the same
    ``Layout`` object comes back (the trainer then need not send it again)."""

    def __init__(self, fd: int | None = None) -> None:
        self.fd = os.memfd_create("relax-hpc-weights") if fd is None else fd
        self._map: mmap.mmap | None = None
        self._bytes: torch.Tensor | None = None  # the whole mapping as uint8
        self._key: tuple = ()  # (name, dtype, shape) of each tensor of the last write
        self._placement: Layout | None = None
        self._views: dict[str, torch.Tensor] = {}

    def write(self, named: Mapping[str, torch.Tensor]) -> Layout:
        """Copy ``named`` (any device) into the file, growing it when they need more room."""
        key = tuple((name, t.dtype, t.shape) for name, t in named.items())
        if key != self._key or self._placement is None:
            placement = place(named)
            if os.fstat(self.fd).st_size < placement.total_nbytes:
                os.ftruncate(self.fd, placement.total_nbytes)
            self._remember(placement)
            self._key = key
        for view, tensor in zip(self._views.values(), named.values(), strict=True):
            view.copy_(tensor.detach())
        return self._placement

    def read(self, placement: Layout) -> dict[str, torch.Tensor]:
        """Views of the tensors of ``placement`` (valid until the writer writes again)."""
        if placement != self._placement:
            size = os.fstat(self.fd).st_size
            if size < placement.total_nbytes:
                raise ValueError(
                    f"shared weights: the file holds {size} bytes, the placement needs "
                    f"{placement.total_nbytes}"
                )
            self._remember(placement)
        return dict(self._views)

    def read_last(self) -> dict[str, torch.Tensor]:
        """The views of the placement read last (the writer wrote the same layout again)."""
        if self._placement is None:
            raise ValueError("shared weights: no placement was read yet")
        return dict(self._views)

    def close(self) -> None:
        self._views, self._placement, self._bytes = {}, None, None
        self._map = None  # unmapped once the last view of it is gone
        os.close(self.fd)

    def _remember(self, placement: Layout) -> None:
        region = self._mapped(placement.total_nbytes)
        self._views = unpack([region], placement)
        self._placement = placement

    def _mapped(self, num_bytes: int) -> torch.Tensor:
        if self._bytes is None or self._bytes.numel() < num_bytes:
            # A larger file gets a new mapping; views of the old one keep it alive.
            self._map = mmap.mmap(self.fd, os.fstat(self.fd).st_size)
            self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        return self._bytes

