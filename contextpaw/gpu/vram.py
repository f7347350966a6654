"""What a runtime will take on the GPU, estimated before it is started or loaded.

From the GGUF header (read with the `gguf` package): the weights (every tensor's bytes), plus the KV
cache at the context it runs with (layers × context × KV heads × head dim × 2 for K and V × bytes
per element, f16 unless told), plus a margin for llama.cpp's compute buffers. `estimate` is pure;
`read_shape` reads a file (call it off the event loop).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20
COMPUTE_MARGIN_BYTES = 256 * MIB
COMPUTE_SHARE = 0.05
"""The compute buffers: at least 256 MiB, or a twentieth of the weights for big models."""
KV_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 1.0625, "q4_0": 0.5625, "q4_1": 0.625, "q5_0": 0.6875, "q5_1": 0.75}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the estimate needs from a GGUF file."""

    weights_bytes: int
    layers: int
    kv_heads: int
    head_dim: int
    trained_ctx: int | None = None


@dataclass(frozen=True, slots=True)
class Need:
    weights_bytes: int
    kv_bytes: int
    compute_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.compute_bytes

    def as_json(self) -> dict[str, int]:
        return {"weights": self.weights_bytes, "kv_cache": self.kv_bytes, "compute": self.compute_bytes, "total": self.total_bytes}


def estimate(shape: ModelShape, ctx: int, kv_type: str = "f16", offloaded: bool = True) -> Need:
    """VRAM for `shape` at `ctx` tokens of KV cache; nothing when no layer is offloaded (-ngl 0)."""
    if not offloaded:
        return Need(0, 0, 0)
    kv = int(shape.layers * ctx * shape.kv_heads * shape.head_dim * 2 * KV_BYTES.get(kv_type, 2))
    compute = max(COMPUTE_MARGIN_BYTES, int(shape.weights_bytes * COMPUTE_SHARE))
    return Need(shape.weights_bytes, kv, compute)


def read_shape(path: str | Path) -> ModelShape:
    """The shape of a GGUF model; ValueError when the file is not one (or lacks the keys)."""
    import gguf  # imported here: reading a header is rare, and the package pulls numpy in

    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from None

    def number(key: str) -> int | None:
        field = reader.fields.get(key)
        return int(field.parts[-1][0]) if field is not None else None

    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        raise ValueError(f"{path}: no general.architecture")
    arch = bytes(arch_field.parts[-1]).decode()
    layers, heads, embedding = number(f"{arch}.block_count"), number(f"{arch}.attention.head_count"), number(f"{arch}.embedding_length")
    if not layers or not heads or not embedding:
        raise ValueError(f"{path}: the header lacks the layer count, head count or embedding length")
    kv_heads = number(f"{arch}.attention.head_count_kv") or heads
    head_dim = number(f"{arch}.attention.key_length") or embedding // heads
    weights = sum(int(t.n_bytes) for t in reader.tensors)
    return ModelShape(weights, layers, kv_heads, head_dim, number(f"{arch}.context_length"))


@dataclass(frozen=True, slots=True)
class ServerPlan:
    """What a llama-server command line says about its memory: the model, the context, the offload."""

    model: str
    ctx: int | None
    offloaded: bool
    kv_type: str = "f16"


def server_plan(command: str) -> ServerPlan | None:
    """Read `-m`, `-c`, `-ngl` and `-ctk` from a llama-server command; None without a model file."""
    try:
        argv = shlex.split(command)
    except ValueError:
        return None
    values: dict[str, str] = {}
    names = {
        "-m": "model",
        "--model": "model",
        "-c": "ctx",
        "--ctx-size": "ctx",
        "-ngl": "ngl",
        "--n-gpu-layers": "ngl",
        "--gpu-layers": "ngl",
        "-ctk": "kv",
        "--cache-type-k": "kv",
    }
    for i, arg in enumerate(argv):
        name, eq, inline = arg.partition("=")
        if name in names:
            value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            values[names[name]] = value
    if not values.get("model"):
        return None
    ctx = int(values["ctx"]) if values.get("ctx", "").isdigit() and int(values["ctx"]) > 0 else None
    offloaded = values.get("ngl", "auto") != "0"  # llama-server offloads what fits unless told 0
    return ServerPlan(values["model"], ctx, offloaded, values.get("kv", "f16"))
