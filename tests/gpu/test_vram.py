"""The VRAM estimate: read from a real GGUF header and a llama-server command line."""

from __future__ import annotations

import pytest

from contextpaw.gpu.vram import ModelShape, estimate, read_shape, server_plan
from support.backends import locate_smollm2


def test_the_shape_of_the_bundled_model_comes_from_its_gguf_header() -> None:
    model = locate_smollm2()
    if model.path is None:
        pytest.skip(model.reason)
    shape = read_shape(model.path)
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.trained_ctx) == (30, 3, 64, 8192)
    assert 90_000_000 < shape.weights_bytes <= model.path.stat().st_size
    need = estimate(shape, 2048)
    assert need.kv_bytes == 47_185_920  # 45 MiB: 30 layers, 2048 tokens, 3 KV heads of 64, K and V, 2 bytes (f16)
    assert need.compute_bytes == 268_435_456  # the 256 MiB floor: a twentieth of ~100 MB of weights is less
    assert need.total_bytes == shape.weights_bytes + 47_185_920 + 268_435_456


def test_a_file_that_is_not_gguf_is_a_clear_error(tmp_path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        read_shape(bogus)


def test_big_models_get_a_compute_margin_that_grows_and_cpu_only_needs_nothing() -> None:
    shape = ModelShape(weights_bytes=15 * 10**9, layers=48, kv_heads=8, head_dim=128)
    need = estimate(shape, 32768, kv_type="q8_0")
    assert need.compute_bytes == 750_000_000  # a twentieth of 15 GB, above the 256 MiB floor
    assert need.kv_bytes == 3_422_552_064  # 3 Gi elements (48 layers × 32768 × 8 KV heads × 128 × K and V), 1.0625 bytes each (q8_0)
    assert need.total_bytes == 19_172_552_064
    assert estimate(shape, 32768, offloaded=False).total_bytes == 0


@pytest.mark.parametrize(
    ("command", "plan"),
    [
        ("llama-server -m /m/q.gguf -c 8192 -ngl 99 --port 8091", ("/m/q.gguf", 8192, True, "f16")),
        ("llama-server --model=/m/q.gguf --ctx-size 4096 -ngl 0", ("/m/q.gguf", 4096, False, "f16")),
        ("llama-server -m m.gguf -ctk q8_0", ("m.gguf", None, True, "q8_0")),
    ],
)
def test_the_memory_a_command_line_asks_for(command: str, plan: tuple) -> None:
    found = server_plan(command)
    assert found is not None and (found.model, found.ctx, found.offloaded, found.kv_type) == plan


def test_a_command_without_a_model_has_no_plan() -> None:
    assert server_plan("llama-server --hf-repo x/y") is None and server_plan('llama-server -m "open') is None
