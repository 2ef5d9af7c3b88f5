"""A worker's compatibility fingerprint: what produced its KV cache, in one short digest.

Two workers may exchange KV only if they would compute the same KV for the same tokens: the same
Tandem version, the same model (its config and its weights), the same dtype, block size and KV
layout. ``compute`` hashes exactly that. The weights part is cheap: the safetensors headers
(tensor names, shapes, dtypes, offsets), file sizes and a fixed sample of the bytes, so a
rollout to another checkpoint of the same architecture changes it while a restart does not.
Workers put the digest in their registration (the router pairs prefill and decode only when
equal) and in the KV handshake (a pull from a different fingerprint is refused before a byte
moves).

Torch-free; the router compares digests and never computes one.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

DIGEST_CHARS = 16  # 64 bits, short enough for a Kubernetes label value
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
SAMPLES = 32
SAMPLE_BYTES = 64 * 1024


def tandem_version() -> str:
    try:
        return metadata.version("tandem")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def model_digest(model_path: Path) -> str:
    """config.json (canonical JSON) and, for each ``*.safetensors`` file, its size, its header
    and a sample of its data: ``SAMPLES`` reads of ``SAMPLE_BYTES`` spread evenly over the file,
    so two checkpoints of the same shapes (a retrain, another seed) differ while a 100 GB model
    costs a few MiB of reads."""
    h = hashlib.sha256()
    config = json.loads((model_path / "config.json").read_text())
    h.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    for f in sorted(model_path.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f.name.encode() + b"\0" + struct.pack("<Q", size))
        with f.open("rb") as fh:
            raw = fh.read(8)
            if len(raw) == 8:
                (n,) = struct.unpack("<Q", raw)
                if n <= min(_MAX_HEADER_BYTES, size - 8):
                    h.update(fh.read(n))
            for i in range(SAMPLES):
                fh.seek(size * i // SAMPLES)
                h.update(fh.read(SAMPLE_BYTES))
    return h.hexdigest()[:DIGEST_CHARS]


@dataclass(frozen=True, slots=True)
class Fingerprint:
    version: str
    model: str  # model_digest
    dtype: str
    block_size: int
    kv_shape: str  # "layers x kv_heads x head_dim"

    @property
    def digest(self) -> str:
        text = f"{self.version}|{self.model}|{self.dtype}|{self.block_size}|{self.kv_shape}"
        return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]

    def describe(self) -> str:
        """For logs and refusals: what differs is readable without the digest."""
        return (
            f"tandem {self.version}, model {self.model}, {self.dtype}, block {self.block_size}, "
            f"kv {self.kv_shape}"
        )


def compute(
    model_path: Path, dtype: str, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int
) -> Fingerprint:
    return Fingerprint(
        tandem_version(),
        model_digest(model_path),
        dtype,
        block_size,
        f"{num_layers}x{num_kv_heads}x{head_dim}",
    )
