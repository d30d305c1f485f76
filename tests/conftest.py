"""Tiny, seeded, randomly initialised models and a tiny BPE tokenizer for fast tests (float32)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

TINY_VOCAB = 96

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "def is_prime(n):\n    if n < 2:\n        return False\n    return all(n % d for d in range(2, n))\n",
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens.",
    "for i in range(10):\n    print(i * i)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tiny_model(
    vocab_size: int = TINY_VOCAB, seed: int = 0, layers: int = 2, init: float = 0.2
) -> Qwen2ForCausalLM:
    """A 2-layer Qwen2 with random weights, float32, eval mode. ``init`` is the weights' std:
    larger than the usual 0.02 so that logits have clear maxima (no near-ties in the argmax)."""
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=init,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float().eval()


def perturbed_copy(model: Qwen2ForCausalLM, noise: float, seed: int = 1) -> Qwen2ForCausalLM:
    """The same model with Gaussian noise of std ``noise`` added to every weight: a draft that
    agrees with the target on some tokens and not others."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    return draft


def constant_target() -> Qwen2ForCausalLM:
    """A target whose greedy output is always token 0: its final norm is zeroed, so every logit
    is exactly 0 and the argmax is the first index, in any batch shape (a draft that proposes 0s
    agrees fully)."""
    model = make_tiny_model(seed=0)
    with torch.no_grad():
        model.model.norm.weight.zero_()
    return model


def make_tiny_tokenizer(vocab_size: int = TINY_VOCAB) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on a few lines of code and prose, with a chat template and an
    end-of-turn token ``<|end|>`` as EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|end|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine two threads
    per process oversubscribe the cores and slow tests down many times."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def serve_cost_cache_in_tmp(tmp_path_factory, monkeypatch):
    """``specdecode serve`` stores its measured cost model in the user's cache
    (:mod:`specdecode.cost.cache`); tests that run the command, in this process or in a
    subprocess, store theirs in a folder of their own instead (the default models stay in the real
    cache)."""
    monkeypatch.setenv("SPECDECODE_SERVE_COST_CACHE", str(tmp_path_factory.mktemp("serve-cost")))


@pytest.fixture(scope="session")
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    # byte-level BPE needs >= 256 + 3 entries; the models below use the tokenizer's real size
    return make_tiny_tokenizer(vocab_size=300)


@pytest.fixture(scope="session")
def tiny_target() -> Qwen2ForCausalLM:
    return make_tiny_model(seed=0)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tiny_tokenizer):
    """Folders (target, draft) of a tiny target and a perturbed copy as draft, saved with the tiny
    tokenizer, for command-line tests (one pair per test module)."""
    root = tmp_path_factory.mktemp("models")
    target = make_tiny_model(vocab_size=len(tiny_tokenizer), seed=0)
    for name, model in (("target", target), ("draft", perturbed_copy(target, noise=0.01))):
        model.save_pretrained(root / name)
        tiny_tokenizer.save_pretrained(root / name)
    return root / "target", root / "draft"


@pytest.fixture(scope="module")
def chat_models(tiny_tokenizer) -> tuple[Qwen2ForCausalLM, Qwen2ForCausalLM]:
    """(target, draft) over the tiny tokenizer's vocabulary, the draft a perturbed copy (part of
    its drafts accepted): the pair the server tests serve (one pair per test module)."""
    target = make_tiny_model(vocab_size=len(tiny_tokenizer), seed=0)
    return target, perturbed_copy(target, noise=0.01)


@pytest.fixture(scope="session")
def tiny_pair(tiny_target: Qwen2ForCausalLM) -> dict[str, Qwen2ForCausalLM]:
    """Target and three drafts: identical (all accepted), unrelated (almost none), perturbed (part)."""
    return {
        "target": tiny_target,
        "identical": copy.deepcopy(tiny_target),
        "unrelated": make_tiny_model(seed=123),
        "perturbed": perturbed_copy(tiny_target, noise=0.01),
    }


def load_default_gguf(role: str, **options: Any) -> Any:
    """The default pair's GGUF ``role`` (``"target"`` / ``"draft"``) on llama.cpp with
    :class:`~specdecode.models.llamacpp.LlamaCppOptions` ``options`` (none: the defaults, exact
    mode); the test is skipped where llama-cpp-python or the default models are not installed."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/setup.sh builds it)")
    from specdecode.errors import ModelNotFoundError
    from specdecode.models.backends import load_llamacpp
    from specdecode.models.llamacpp.model import LlamaCppOptions

    try:
        return load_llamacpp(None, role, LlamaCppOptions(**options))
    except ModelNotFoundError as error:
        pytest.skip(f"default models not installed: {error}")
