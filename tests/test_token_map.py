"""Token maps and the reduced-vocabulary draft head (FR-Spec): building maps, the reduced logits,
and losslessness with drafts that can only propose the map's tokens."""

from __future__ import annotations

import collections
import copy
import json
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.commands.main import main
from specdecode.errors import MissingDependencyError
from specdecode.models.torch.hf_loading import load_tokenizer
from specdecode.models.torch.runner import ModelRunner
from specdecode.proposers import get_spec
from specdecode.proposers.draft_model import DraftModelConfig, DraftModelProposer
from specdecode.sampling import logits_to_probs
from specdecode.token_map import (
    DEFAULT_TOKEN_MAP,
    WORD_FORMS,
    build_token_map,
    corpus_counts,
    count_tokens,
    load_token_map,
    mix_counts,
    save_token_map,
    special_token_ids,
    token_map_from_counts,
    word_list_counts,
)

from conftest import CORPUS, TINY_VOCAB, make_tiny_model, perturbed_copy
from reference import exact_marginals, target_only_greedy
from stat_checks import P_MIN, chi_square_p

PROMPTS = [[5, 17, 33, 2, 9, 60, 11], [40, 41, 42], [7]]
NEW = 40


class Recording(DraftModelProposer):
    """A draft-model proposer that records every token it drafts (also shows subclassing works)."""

    def __init__(self, model, config=None) -> None:
        super().__init__(model, config)
        self.drafted: list[int] = []

    def propose(self, context, num_tokens, sampling, generator):
        draft = super().propose(context, num_tokens, sampling, generator)
        self.drafted.extend(draft.ids.tolist())
        return draft


def map_file(tmp_path, ids, name: str = "map.npy") -> str:
    return str(save_token_map(torch.tensor(ids), tmp_path / name))


# ---------------------------------------------------------------- building, files
def test_counts_order_and_special_tokens(tiny_tokenizer) -> None:
    texts = CORPUS + ["def add(a, b): return a + b  # again\n"]
    expected = collections.Counter(i for t in texts for i in tiny_tokenizer.encode(t, add_special_tokens=False))
    counts = count_tokens(tiny_tokenizer, iter(texts), batch_size=2)  # batches split the corpus
    assert counts.shape == (len(tiny_tokenizer),)
    assert {i: int(c) for i, c in enumerate(counts) if c} == dict(expected)

    special = special_token_ids(tiny_tokenizer)
    assert special == sorted(tiny_tokenizer.convert_tokens_to_ids(["<|end|>", "<|user|>", "<|assistant|>"]))
    assert tiny_tokenizer.eos_token_id in special
    token_map = build_token_map(tiny_tokenizer, texts, 30)
    assert token_map.dtype == torch.int64 and token_map.shape == (30,)
    assert token_map[:3].tolist() == special  # always first, whatever their count
    by_frequency = sorted((i for i in expected if i not in special), key=lambda i: (-expected[i], i))
    assert token_map[3:].tolist() == by_frequency[:27]
    freqs = [expected[i] for i in token_map[3:].tolist()]
    assert freqs == sorted(freqs, reverse=True) and freqs[-1] > 0


def test_unseen_ids_fill_a_large_map_and_bounds(tiny_tokenizer) -> None:
    texts = ["def f(): pass\n"]
    seen = set(tiny_tokenizer.encode(texts[0], add_special_tokens=False))
    V = len(tiny_tokenizer)
    full = build_token_map(tiny_tokenizer, texts, V)
    assert sorted(full.tolist()) == list(range(V))
    assert set(full[3 : 3 + len(seen)].tolist()) == seen
    rest = full[3 + len(seen) :].tolist()
    assert rest == sorted(rest)  # unseen ids in ascending order
    for size in (0, V + 1, 2):  # 2 < the 3 special tokens
        with pytest.raises(ValueError, match="size"):
            build_token_map(tiny_tokenizer, texts, size)


@pytest.mark.parametrize("suffix", [".npy", ".pt"])
def test_save_load_round_trip(tmp_path, suffix: str) -> None:
    ids = torch.tensor([7, 151_645, 0, 3, 99_999])
    path = save_token_map(ids, tmp_path / f"m{suffix}")
    loaded = load_token_map(path)
    assert loaded.dtype == torch.int64 and loaded.tolist() == ids.tolist()


def test_load_rejects_bad_files(tmp_path) -> None:
    with pytest.raises(ValueError, match=".npy or .pt"):
        save_token_map(torch.tensor([1, 2]), tmp_path / "m.txt")
    with pytest.raises(FileNotFoundError):
        load_token_map(tmp_path / "missing.npy")
    bad = {"dup": np.array([1, 2, 1]), "neg": np.array([-1, 2]), "flat": np.zeros((2, 2), np.int64)}
    bad |= {"float": np.array([1.0, 2.0]), "empty": np.zeros(0, np.int64)}
    for name, array in bad.items():
        np.save(tmp_path / f"{name}.npy", array)
        with pytest.raises(ValueError, match="token map"):
            load_token_map(tmp_path / f"{name}.npy")
    (tmp_path / "junk.npy").write_bytes(b"not a numpy file")
    with pytest.raises(ValueError, match="cannot read"):
        load_token_map(tmp_path / "junk.npy")


def test_the_shipped_default_map() -> None:
    assert DEFAULT_TOKEN_MAP.stat().st_size < 300_000
    ids = load_token_map("default")
    assert ids.shape == (65_536,) and ids.unique().numel() == 65_536
    assert int(ids.max()) < 151_936  # the Qwen2.5 vocabulary
    assert {151_643, 151_645} <= set(ids[:22].tolist())  # <|endoftext|>, <|im_end|> (EOS) come first
    # code and everyday English both within the first 32,768 (the code-only map of the first release
    # left out the words): " def", " self", " played", " actress", " vehicle", " film", " Clinton"
    assert {707, 656, 6342, 23654, 7310, 4531, 8120} <= set(ids[:32_768].tolist())


# ---------------------------------------------------------------- the reduced head
@pytest.mark.parametrize("tied", [False, True])
def test_reduced_logits_equal_full_logits_at_the_maps_rows(tied: bool) -> None:
    model = make_tiny_model(seed=3)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randperm(TINY_VOCAB, generator=torch.Generator().manual_seed(0))[:37]
    tokens = torch.tensor([3, 14, 15, 92, 65, 35, 89, 79, 32, 38])
    full, reduced = ModelRunner(model), ModelRunner(model, head_ids=ids)
    assert reduced.vocab_size == TINY_VOCAB and reduced.head_ids.tolist() == ids.tolist()
    a, b = full.forward(tokens[:8], num_logits=5), reduced.forward(tokens[:8], num_logits=5)
    assert b.shape == (5, 37) and b.dtype == torch.float32
    torch.testing.assert_close(b, a[:, ids], rtol=1e-5, atol=1e-5)
    full.truncate(6), reduced.truncate(6)  # rollback keeps them in step
    a, b = full.forward(tokens[6:], num_logits=4), reduced.forward(tokens[6:], num_logits=4)
    torch.testing.assert_close(b, a[:, ids], rtol=1e-5, atol=1e-5)
    # the shared model is untouched
    assert model.get_output_embeddings().weight.shape == (TINY_VOCAB, 32)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_sampled_q_is_the_reduced_distribution_scattered(tmp_path, tiny_pair) -> None:
    """q = temperature / top-k / top-p over the map's logits, zero elsewhere; drafts come from the map."""
    draft = tiny_pair["perturbed"]
    ids = list(range(0, TINY_VOCAB, 3))
    proposer = DraftModelProposer(draft, DraftModelConfig(token_map=map_file(tmp_path, ids)))
    sampling = SamplingParams(temperature=0.9, top_k=5, top_p=0.9)
    context = torch.tensor(PROMPTS[0])
    out = proposer.propose(context, 3, sampling, torch.Generator().manual_seed(0))
    assert out.probs.shape == (3, TINY_VOCAB)
    torch.testing.assert_close(out.probs.sum(-1), torch.ones(3))
    outside = torch.ones(TINY_VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert (out.probs[:, outside] == 0).all() and set(out.ids.tolist()) <= set(ids)
    first = ModelRunner(draft).forward(context, num_logits=1)[0]  # (V,)
    expected = torch.zeros(TINY_VOCAB)
    expected[ids] = logits_to_probs(first[ids], sampling)  # top-k = the 5 most likely of the map
    torch.testing.assert_close(out.probs[0], expected, rtol=1e-5, atol=1e-6)
    assert int((out.probs[0] > 0).sum()) <= 5


# ---------------------------------------------------------------- greedy: exact, with known acceptance
@pytest.fixture(scope="module")
def greedy_outputs(tiny_pair) -> list[list[int]]:
    return [target_only_greedy(tiny_pair["target"], p, NEW) for p in PROMPTS]


def identical_draft_acceptance(full: list[int], in_map: set[int], k: int) -> tuple[int, int]:
    """(accepted, drafted) for a draft identical to the target: at each step it drafts the target's
    tokens while they are in the map, and is rejected at the first one outside (engine's k schedule)."""
    accepted = drafted = 0
    g = 1  # the prefill gives the first token
    while g < len(full):
        k_step = min(k, len(full) - g - 1)
        n = 0
        while n < k_step and full[g + n] in in_map:
            n += 1
        accepted, drafted, g = accepted + n, drafted + k_step, g + n + 1
    return accepted, drafted


@pytest.mark.parametrize("draft_name", ["identical", "unrelated", "perturbed"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_exact_when_target_tokens_are_outside_the_map(tmp_path, tiny_pair, greedy_outputs, draft_name, k):
    target = tiny_pair["target"]
    frequent = [t for t, _ in collections.Counter(sum(greedy_outputs, [])).most_common(3)]
    shuffled = torch.randperm(TINY_VOCAB, generator=torch.Generator().manual_seed(1)).tolist()
    ids = [i for i in shuffled if i not in frequent][:60]  # the target's 3 commonest tokens are never drafted
    proposer = Recording(tiny_pair[draft_name], DraftModelConfig(token_map=map_file(tmp_path, ids)))
    spec = SpeculativeGenerator(target, proposer=proposer)
    accepted = drafted = 0
    for prompt, expected in zip(PROMPTS, greedy_outputs, strict=True):
        result = spec.generate(prompt, SamplingParams(max_new_tokens=NEW), num_speculative_tokens=k)
        assert result.token_ids == expected
        accepted, drafted = accepted + result.stats.accepted_tokens, drafted + result.stats.draft_tokens
        if draft_name == "identical":
            assert (result.stats.accepted_tokens, result.stats.draft_tokens) == identical_draft_acceptance(
                expected, set(ids), k
            )
    assert proposer.drafted and set(proposer.drafted) <= set(ids)
    assert 0 < accepted < drafted or draft_name == "unrelated"


@pytest.mark.parametrize("draft_name", ["identical", "unrelated", "perturbed"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_a_map_of_every_token_accepts_like_the_full_head(tmp_path, tiny_pair, greedy_outputs, draft_name, k):
    target, draft = tiny_pair["target"], tiny_pair[draft_name]
    every = torch.randperm(TINY_VOCAB, generator=torch.Generator().manual_seed(2)).tolist()  # any order
    full = SpeculativeGenerator(target, draft)
    mapped = SpeculativeGenerator(
        target, proposer=DraftModelProposer(draft, DraftModelConfig(token_map=map_file(tmp_path, every)))
    )
    for prompt, expected in zip(PROMPTS, greedy_outputs, strict=True):
        a = full.generate(prompt, SamplingParams(max_new_tokens=NEW), num_speculative_tokens=k)
        b = mapped.generate(prompt, SamplingParams(max_new_tokens=NEW), num_speculative_tokens=k)
        assert a.token_ids == b.token_ids == expected
        assert b.stats.accepted_per_position == a.stats.accepted_per_position
        assert b.stats.drafted_per_position == a.stats.drafted_per_position


def test_a_config_subclass_and_the_early_exit_proposer_take_the_map(tmp_path, tiny_pair, greedy_outputs) -> None:
    @dataclass(frozen=True)
    class SubConfig(DraftModelConfig):
        extra: int = field(default=1, metadata={"help": "x"})

    path = map_file(tmp_path, list(range(50)))
    proposer = DraftModelProposer(tiny_pair["identical"], SubConfig(token_map=path, draft_vocab_size=20))
    assert proposer.runner.head_ids.tolist() == list(range(20))
    early_exit = pytest.importorskip("specdecode.proposers.early_exit")
    target = tiny_pair["target"]
    config = early_exit.EarlyExitConfig(exit_layer=1, token_map=path)
    spec = SpeculativeGenerator(target, proposer=early_exit.EarlyExitProposer(target, config))
    result = spec.generate(PROMPTS[0], SamplingParams(max_new_tokens=NEW), num_speculative_tokens=3)
    assert result.token_ids == greedy_outputs[0]
    assert target.get_output_embeddings().weight.shape == (TINY_VOCAB, 32)


# ---------------------------------------------------------------- sampling: the residual supplies the rest
V_SMALL = 12
SAMPLING = SamplingParams(temperature=0.8, top_k=9, top_p=0.95, max_new_tokens=3)


def test_sampled_tokens_follow_the_target_with_a_partial_map(tmp_path) -> None:
    """Temperature 0.8, top-k 9, top-p 0.95, k = 2: the map leaves out the target's 2nd and 3rd most
    likely first tokens (24% of its mass; 6% and 18% at the next positions), which the draft can
    never propose: only the residual can produce them. The first three tokens still follow the
    exact target marginals (chi-square p > P_MIN, 1,000 seeded samples)."""
    target = make_tiny_model(vocab_size=V_SMALL, seed=5, init=0.3)
    draft = perturbed_copy(target, noise=0.1, seed=6)
    prompt = [3, 1, 4]
    exact = exact_marginals(target, prompt, 3, SAMPLING)
    excluded = exact[0].argsort(descending=True)[1:3].tolist()
    assert all(float(e[excluded].sum()) > 0.05 for e in exact)
    proposer = Recording(
        draft, DraftModelConfig(token_map=map_file(tmp_path, [i for i in range(12) if i not in excluded]))
    )
    spec = SpeculativeGenerator(target, proposer=proposer)
    samples = [
        spec.generate(prompt, SamplingParams(**{**SAMPLING.__dict__, "seed": s}), num_speculative_tokens=2)
        for s in range(1_000)
    ]
    drafted = sum(r.stats.draft_tokens for r in samples)
    accepted = sum(r.stats.accepted_tokens for r in samples)
    assert drafted >= 1_000 and 0.3 < accepted / drafted < 0.9, (accepted, drafted)
    assert not set(proposer.drafted) & set(excluded)
    for pos in range(3):
        tokens = [r.token_ids[pos] for r in samples]
        assert sum(t in excluded for t in tokens) > 20  # the residual did supply them
        assert chi_square_p(tokens, exact[pos]) > P_MIN, f"position {pos} differs from the target's"


# ---------------------------------------------------------------- options and errors
@pytest.fixture(scope="module")
def small_map(tmp_path_factory) -> str:
    return map_file(tmp_path_factory.mktemp("maps"), list(range(0, TINY_VOCAB, 2)), "small.npy")


def test_options(small_map) -> None:
    config = get_spec("draft_model").make_config(token_map=small_map, draft_vocab_size="7")  # CLI passes strings
    assert config.draft_vocab_size == 7 and config.head_ids().tolist() == list(range(0, 14, 2))
    assert DraftModelConfig().head_ids() is None
    assert len(DraftModelConfig(token_map="default", draft_vocab_size=16_384).head_ids()) == 16_384


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"token_map": 3}, "token_map"),
        ({"token_map": ""}, "token_map"),
        ({"token_map": "/no/such/map.npy"}, "token_map"),
        ({"token_map": "SMALL", "draft_vocab_size": 0}, "draft_vocab_size"),
        ({"token_map": "SMALL", "draft_vocab_size": -3}, "draft_vocab_size"),
        ({"token_map": "SMALL", "draft_vocab_size": True}, "draft_vocab_size"),
        ({"token_map": "SMALL", "draft_vocab_size": 2.5}, "draft_vocab_size"),
        ({"token_map": "SMALL", "draft_vocab_size": "many"}, "draft_vocab_size"),
        ({"token_map": "SMALL", "draft_vocab_size": TINY_VOCAB // 2 + 1}, "draft_vocab_size"),
        ({"draft_vocab_size": 10}, "draft_vocab_size"),
    ],
)
def test_bad_options_name_the_option(small_map, options: dict, name: str) -> None:
    options = {k: small_map if v == "SMALL" else v for k, v in options.items()}
    with pytest.raises(ValueError, match=name):
        DraftModelConfig(**options)


def test_models_a_reduced_head_cannot_serve(tmp_path, tiny_target) -> None:
    too_big = DraftModelConfig(token_map=map_file(tmp_path, [1, TINY_VOCAB], "big.npy"))
    with pytest.raises(ValueError, match="token_map.*another tokenizer"):
        DraftModelProposer(tiny_target, too_big)
    config = DraftModelConfig(token_map=map_file(tmp_path, [1, 2, 3]))
    capped = copy.deepcopy(tiny_target)
    capped.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="token_map.*final_logit_softcapping"):
        DraftModelProposer(capped, config)
    scaled = copy.deepcopy(tiny_target)  # logits rescaled in a way no config attribute tells
    scaled.lm_head.register_forward_hook(lambda module, args, out: out * 0.5)
    with pytest.raises(ValueError, match="token_map.*not lm_head"):
        DraftModelProposer(scaled, config)
    DraftModelProposer(tiny_target, config)  # the plain model is fine


# ---------------------------------------------------------------- command line
def test_cli_options_reach_the_proposer(model_dirs, tmp_path, capsys, monkeypatch) -> None:
    built: list[DraftModelProposer] = []
    init = DraftModelProposer.__init__

    def spy(self, model, config=None) -> None:
        init(self, model, config)
        built.append(self)

    monkeypatch.setattr(DraftModelProposer, "__init__", spy)
    target, draft = model_dirs
    path = map_file(tmp_path, list(range(300)))
    args = ["generate", "def add(a, b):", "--target", str(target), "--draft", str(draft), "--dtype", "float32"]
    args += ["--max-new-tokens", "16", "-k", "3", "--json", "--compare"]
    assert main([*args, "--token-map", path, "--draft-vocab-size", "200"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["identical"] is True and out["draft_tokens"] > 0
    assert built[-1].config.token_map == path and built[-1].config.draft_vocab_size == 200
    assert built[-1].runner.head_ids.tolist() == list(range(200))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--token-map", "/no/such/map.npy"], "token_map"),
        (["--token-map", "default", "--draft-vocab-size", "0"], "draft_vocab_size"),
        (["--draft-vocab-size", "10"], "draft_vocab_size"),
        (["--proposer", "prompt_lookup", "--token-map", "default"], "--token-map"),
    ],
)
def test_cli_errors_name_the_option(model_dirs, capsys, args: list[str], message: str) -> None:
    target, _ = model_dirs
    assert main(["generate", "hi", "--target", str(target), *args]) == 2
    assert message in capsys.readouterr().err


def test_build_token_map_command(model_dirs, tmp_path, capsys) -> None:
    target, _ = model_dirs
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(CORPUS[:3]):
        (corpus / f"f{i}.py").write_text(text)
    (corpus / "README.md").write_text(CORPUS[3])
    (corpus / "numbers.txt").write_text("1 2 3 4 5 6 7 8 9 " * 50)  # data, not prose: skipped
    out = tmp_path / "m.npy"
    args = ["build-token-map", "--target", str(target), "--size", "40", "--out", str(out), "--corpus", str(corpus)]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["files"] == 4 and summary["characters"] == sum(len(t) for t in CORPUS[:4])
    texts, tokenizer = CORPUS[:4], load_tokenizer(target)  # as saved with the model (may split differently)
    assert summary["file_tokens"] == sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in texts)
    assert 0 < summary["coverage"]["40"] <= 1
    assert load_token_map(out).tolist() == build_token_map(tokenizer, texts, 40).tolist()
    assert main([*args[:-1], str(tmp_path / "missing")]) == 2
    assert "corpus" in capsys.readouterr().err
    assert main([*args[:3], "--size", "100000", "--out", str(out), "--corpus", str(corpus)]) == 2
    assert "size" in capsys.readouterr().err


# ---------------------------------------------------------------- word-frequency lists
def test_word_list_counts_weigh_each_form_by_frequency(tiny_tokenizer) -> None:
    import wordfreq

    words = wordfreq.top_n_list("en", 30)
    counts = word_list_counts(tiny_tokenizer, "en", 30)
    expected = np.zeros(len(tiny_tokenizer))
    total = 0.0
    for word in words:
        f = wordfreq.word_frequency(word, "en")
        total += f
        for prefix, capitalise, share in WORD_FORMS:
            text = prefix + (word[:1].upper() + word[1:] if capitalise else word)
            for i in tiny_tokenizer.encode(text, add_special_tokens=False):
                expected[i] += f * share
    np.testing.assert_allclose(counts, expected / total, rtol=1e-9)
    assert counts.shape == (len(tiny_tokenizer),) and counts.sum() >= 1.0  # tokens per word occurrence
    the = tiny_tokenizer.encode(" the", add_special_tokens=False)
    assert all(counts[i] > 0 for i in the)
    with pytest.raises(ValueError, match="no wordfreq list for language 'xx'"):
        word_list_counts(tiny_tokenizer, "xx")
    with pytest.raises(ValueError, match="words"):
        word_list_counts(tiny_tokenizer, "en", 0)


def test_word_lists_need_wordfreq(tiny_tokenizer, monkeypatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "wordfreq", None)  # import wordfreq now fails
    with pytest.raises(MissingDependencyError, match=r"pip install 'specdecode\[tokenmap\]'"):
        word_list_counts(tiny_tokenizer, "en")


def test_mix_counts_gives_each_part_its_weight() -> None:
    a = np.array([6, 2, 0, 0])  # int counts
    b = np.array([0.0, 0.5, 0.5, 0.0])
    np.testing.assert_allclose(mix_counts([(a, 0.75), (b, 0.25)]), [0.5625, 0.3125, 0.125, 0.0])
    np.testing.assert_allclose(mix_counts([(a, 0.5), (np.zeros(4), 0.5)]), a / 8)  # empty part: left out
    np.testing.assert_allclose(mix_counts([(np.zeros(4), 1.0)]), np.zeros(4))
    for parts, message in [([], "at least one"), ([(a, 0.0)], "weights"), ([(a, 1.0), (np.zeros(3), 1.0)], "sizes")]:
        with pytest.raises(ValueError, match=message):
            mix_counts(parts)


def test_corpus_counts_mix_files_and_word_lists(tiny_tokenizer, tmp_path) -> None:
    (tmp_path / "a.py").write_text(CORPUS[0])
    files_only, summary = corpus_counts(tiny_tokenizer, [str(tmp_path)])
    file_counts = count_tokens(tiny_tokenizer, [CORPUS[0]])
    np.testing.assert_allclose(files_only, file_counts / file_counts.sum())
    assert summary["files"] == 1 and summary["word_lists"] == {} and summary["word_list_weight"] is None
    mixed, summary = corpus_counts(tiny_tokenizer, [str(tmp_path), "wordfreq-en"], word_list_weight=0.25, words=50)
    words = word_list_counts(tiny_tokenizer, "en", 50)
    np.testing.assert_allclose(mixed, 0.75 * file_counts / file_counts.sum() + 0.25 * words / words.sum())
    assert summary["word_lists"] == {"en": 50} and summary["word_list_weight"] == 0.25
    lists_only, _ = corpus_counts(tiny_tokenizer, ["wordfreq-en", "wordfreq-de"], words=50)
    german = word_list_counts(tiny_tokenizer, "de", 50)
    np.testing.assert_allclose(lists_only, 0.5 * words / words.sum() + 0.5 * german / german.sum())
    for sources, weight, message in [
        ([], 0.5, "--corpus is empty"),
        (["wordfreq-"], 0.5, "needs a language"),
        (["wordfreq-en"], 1.0, "--word-list-weight"),
        (["wordfreq-en"], 0.0, "--word-list-weight"),
        (["no-such-corpus"], 0.5, "corpus"),
    ]:
        with pytest.raises(ValueError, match=message):
            corpus_counts(tiny_tokenizer, sources, weight)


def test_build_token_map_command_with_a_word_list(model_dirs, tmp_path, capsys) -> None:
    """A word list moves everyday words into the map that a code corpus alone leaves out."""
    target, _ = model_dirs
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "f.py").write_text(CORPUS[0])
    tokenizer = load_tokenizer(target)
    out = tmp_path / "m.npy"
    args = ["build-token-map", "--target", str(target), "--size", "60", "--out", str(out), "--words", "200"]
    assert main([*args, "--corpus", f"{corpus},wordfreq-en", "--word-list-weight", "0.5"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["word_lists"] == {"en": 200} and summary["word_list_weight"] == 0.5
    counts, _ = corpus_counts(tokenizer, [str(corpus), "wordfreq-en"], 0.5, 200)
    expected = token_map_from_counts(counts, 60, special_token_ids(tokenizer))
    assert load_token_map(out).tolist() == expected.tolist()
    code_only = build_token_map(tokenizer, [CORPUS[0]], 60).tolist()
    assert load_token_map(out).tolist() != code_only
    assert main([*args, "--corpus", str(corpus), "--word-list-weight", "1.5"]) == 2
    assert "--word-list-weight" in capsys.readouterr().err
