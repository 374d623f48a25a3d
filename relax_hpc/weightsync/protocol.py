"""The wire protocol of a weight sync: bucket layout, packing, checksums. No I/O.

A sync moves a named set of tensors from the trainer to the engines as a few large flat
byte buffers ("buckets"), so the transport sees a handful of big messages instead of
hundreds of small ones. What travels, in order, for one round:

1. the *manifest* (JSON, through the rendezvous store): ``policy_version``, ``round``,
   ``checksum_algo``, ``bucket_nbytes`` and, per tensor, ``name``, ``dtype`` (as served),
   ``shape``, ``bucket`` (index) and ``offset`` (bytes from the bucket start);
2. the buckets, bucket 0 first, each one collective broadcast from rank 0 (the trainer);
3. the *digest* (JSON, through the store): one checksum per bucket, sent after the data so
   that the sender can checksum bucket k while bucket k-1 is on the wire.

Both JSON messages are signed by the sender with the run token (see ``rendezvous``).
A receiver verifies every bucket before it switches weights. Any engine backend (a
transformers model here, SGLang's own receive path later) can implement this protocol:
it needs only the manifest, a byte buffer per bucket and ``bucket_checksum``.

Layout rules: each tensor starts at a multiple of ``ALIGN_BYTES`` (so a byte slice can be
viewed as any dtype), bucket sizes are padded to ``ALIGN_BYTES``, a tensor larger than the
bucket size gets a bucket of its own. Floating tensors are converted to the serving dtype
on the sender (fp32 master -> bf16 serving); other dtypes travel unchanged.

Checksums (``checksum_algo``), none cryptographic (the signature covers the digest, not
the data):
- ``xxh3_64``: the 64-bit XXH3 hash of the bucket bytes, for CPU buffers (~25 GB/s per core,
  so checksumming costs a few percent of a loopback broadcast; CRC-32 at ~1.7 GB/s took half
  of it). A corrupted bucket passes with probability about 2**-64.
- ``crc32``: zlib CRC-32 of the bucket bytes; still accepted from a sender that announces it
  (detects every burst of up to 32 bits).
- ``wsum64``: sum over the int32 words ``w_i`` of ``w_i * (i + 1)`` modulo 2**64, computed
  with torch on the buffer's device, for CUDA buffers (no copy to the host).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from functools import cached_property

import torch
import xxhash

ALIGN_BYTES = 64
CHECKSUM_XXH3 = "xxh3_64"
CHECKSUM_CRC32 = "crc32"
CHECKSUM_WSUM64 = "wsum64"
_WSUM_CHUNK_WORDS = 1 << 24  # bounds the int64 temporaries of wsum64 to 128 MiB

_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"weight sync cannot carry tensors of dtype {dtype}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r} in a weight-sync manifest")
    return _DTYPES[name]


def serve_dtype_of(dtype: torch.dtype, serve_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor travels in: floating tensors take ``serve_dtype`` (None = keep)."""
    if serve_dtype is not None and dtype.is_floating_point:
        return serve_dtype
    return dtype


def parse_serve_dtype(name: str) -> torch.dtype | None:
    """``WeightSyncConfig.serve_dtype`` as a torch dtype; ``same`` is None."""
    return None if name == "same" else dtype_from_name(name)


def as_named_list(named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    return [(name, tensor.detach()) for name, tensor in items]


def _align(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN_BYTES) * ALIGN_BYTES


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_from_name(self.dtype).itemsize


@dataclass(frozen=True)
class Layout:
    """Where every tensor lives in the buckets; equal layouts let buffers be reused."""

    tensors: tuple[TensorSpec, ...]
    bucket_nbytes: tuple[int, ...]

    @property
    def total_nbytes(self) -> int:
        return sum(self.bucket_nbytes)

    @cached_property
    def buckets(self) -> tuple[list[TensorSpec], ...]:
        """The specs of each bucket, in bucket order."""
        per_bucket: tuple[list[TensorSpec], ...] = tuple([] for _ in self.bucket_nbytes)
        for spec in self.tensors:
            per_bucket[spec.bucket].append(spec)
        return per_bucket

    @cached_property
    def tensors_json(self) -> tuple[dict, ...]:
        """``asdict`` of every spec, once per layout: the layout is the same every sync, and
        ``asdict`` of ~30 specs cost the sender ~0.15 ms a round."""
        return tuple(asdict(spec) for spec in self.tensors)


def plan_layout(
    named_tensors: list[tuple[str, torch.Tensor]],
    bucket_nbytes: int,
    serve_dtype: torch.dtype | None,
) -> Layout:
    """Greedy, order-preserving assignment of tensors to buckets of ~``bucket_nbytes``."""
    specs: list[TensorSpec] = []
    sizes: list[int] = []
    used = 0
    for name, tensor in named_tensors:
        dtype = serve_dtype_of(tensor.dtype, serve_dtype)
        nbytes = tensor.numel() * dtype.itemsize
        if not sizes or (used > 0 and used + nbytes > bucket_nbytes):
            sizes.append(0)
            used = 0
        spec = TensorSpec(name, dtype_name(dtype), tuple(tensor.shape), len(sizes) - 1, used)
        specs.append(spec)
        used = _align(used + nbytes)
        sizes[-1] = used
    if len({spec.name for spec in specs}) != len(specs):
        raise ValueError("weight sync needs unique tensor names")
    return Layout(tuple(specs), tuple(max(size, ALIGN_BYTES) for size in sizes))


def tensor_view(bucket_u8: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The region of one tensor inside its bucket, viewed with its dtype and shape."""
    region = bucket_u8[spec.offset : spec.offset + spec.nbytes]
    return region.view(dtype_from_name(spec.dtype)).view(spec.shape)


def pack_bucket(
    bucket_u8: torch.Tensor, specs: list[TensorSpec], tensors: Mapping[str, torch.Tensor]
) -> None:
    """Copy (and convert) the tensors of one bucket into its flat buffer."""
    for spec in specs:
        tensor_view(bucket_u8, spec).copy_(tensors[spec.name])


def unpack(buckets_u8: list[torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """Named views into received buckets (no copy); valid while the buckets are."""
    return {spec.name: tensor_view(buckets_u8[spec.bucket], spec) for spec in layout.tensors}


def checksum_algo_for(device: torch.device) -> str:
    return CHECKSUM_WSUM64 if device.type == "cuda" else CHECKSUM_XXH3


def bucket_checksum(bucket_u8: torch.Tensor, algo: str) -> int:
    """Checksum of one bucket's bytes (see the module docstring)."""
    assert bucket_u8.dtype == torch.uint8 and bucket_u8.numel() % ALIGN_BYTES == 0
    if algo == CHECKSUM_WSUM64:
        return _wsum64(bucket_u8.view(torch.int32))
    return host_checksum(bucket_u8.cpu().numpy(), algo)


def host_checksum(data, algo: str) -> int:
    """A host-side checksum of a byte buffer (anything with the buffer protocol)."""
    if algo == CHECKSUM_XXH3:
        return xxhash.xxh3_64_intdigest(data)
    if algo == CHECKSUM_CRC32:
        return zlib.crc32(data)
    raise ValueError(f"unknown checksum algorithm {algo!r}")


def _wsum64(words: torch.Tensor) -> int:
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _WSUM_CHUNK_WORDS):
        chunk = words[start : start + _WSUM_CHUNK_WORDS].to(torch.int64)
        weights = torch.arange(
            start + 1, start + 1 + chunk.numel(), dtype=torch.int64, device=words.device
        )
        total += (chunk * weights).sum()  # int64 arithmetic wraps: modulo 2**64
    return int(total.item()) & (2**64 - 1)


@dataclass(frozen=True)
class Manifest:
    """Everything a receiver needs before the buckets arrive."""

    policy_version: int
    round: int
    checksum_algo: str
    layout: Layout

    def to_json(self) -> dict:
        return {
            "policy_version": self.policy_version,
            "round": self.round,
            "checksum_algo": self.checksum_algo,
            "bucket_nbytes": list(self.layout.bucket_nbytes),
            "tensors": [dict(spec) for spec in self.layout.tensors_json],
        }

    @classmethod
    def from_json(cls, data: dict) -> Manifest:
        specs = tuple(
            TensorSpec(t["name"], t["dtype"], tuple(t["shape"]), t["bucket"], t["offset"])
            for t in data["tensors"]
        )
        layout = Layout(specs, tuple(data["bucket_nbytes"]))
        return cls(data["policy_version"], data["round"], data["checksum_algo"], layout)


def canonical_bytes(message: dict) -> bytes:
    """The bytes a signature covers: sorted keys, no whitespace."""
    return json.dumps(message, sort_keys=True, separators=(",", ":")).encode("utf-8")
