"""``specdecode train-drafter``: features, self-distillation training, validation, checkpoints, CLI."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from specdecode.drafters import build_drafter, load_drafter
from specdecode.drafters.corpus import CHAT_INSTRUCTIONS, chat_texts, function_examples, token_sequences
from specdecode.drafters.features import collect_features, load_features
from specdecode.drafters.heads import DrafterConfig
from specdecode.drafters.losses import _classification_loss, eagle_loss, medusa_loss
from specdecode.drafters.train import TrainConfig, train_drafter
from specdecode.drafters.validation import expected_accepted, validate
from specdecode.engine import SpeculativeGenerator
from specdecode.proposers import make_proposer

from conftest import CORPUS, make_tiny_model
from reference import target_only_greedy

TEXTS = CORPUS * 12


@pytest.fixture(scope="module")
def target(tiny_tokenizer):
    return make_tiny_model(vocab_size=len(tiny_tokenizer), seed=0)


@pytest.fixture(scope="module")
def features(target, tiny_tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("features")
    collect_features(target, tiny_tokenizer, TEXTS, folder, max_tokens=32 * 24, seq_len=32, batch_size=4,
                     shard_sequences=8, progress=False, source="conftest corpus")  # fmt: skip
    return folder


def test_sequences_are_cut_to_length_and_budget(tiny_tokenizer):
    seqs = list(token_sequences(tiny_tokenizer, TEXTS, seq_len=16, max_tokens=100))
    assert len(seqs) == 6 and all(len(s) == 16 for s in seqs)  # 6 * 16 <= 100 < 7 * 16
    joined = sum(seqs, [])
    eos = tiny_tokenizer.eos_token_id
    first = tiny_tokenizer.encode(TEXTS[0], add_special_tokens=False)
    assert joined[: len(first) + 1] == [*first, eos]  # texts joined by EOS, in order


def test_features_are_the_targets_final_hidden_states_and_predictions(target, features):
    data = load_features(features)
    meta = json.loads((features / "features.json").read_text())
    assert data["tokens"].shape == (24, 32) and meta["tokens"] == 24 * 32 and meta["source"] == "conftest corpus"
    assert len(list(features.glob("shard-*.safetensors"))) == 3  # 8 sequences per shard
    assert not list(features.glob("*.partial"))  # shards are written aside, then renamed
    ids = data["tokens"][5:7]
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    hidden = target.model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(data["features"][5:7].float(), hidden.to(torch.bfloat16).float())
    assert torch.equal(data["predictions"][5:7], out.logits.argmax(-1))


def test_collecting_again_resumes_and_another_target_is_refused(target, tiny_tokenizer, features, tmp_path):
    before = sorted(p.stat().st_mtime_ns for p in features.glob("shard-*"))
    collect_features(target, tiny_tokenizer, TEXTS, features, max_tokens=32 * 24, seq_len=32, progress=False)
    assert sorted(p.stat().st_mtime_ns for p in features.glob("shard-*")) == before  # nothing recomputed
    # a run stopped after its first shard: the shard and the metadata say how far it got, and the next
    # run goes on from there
    stopped = tmp_path / "stopped"
    collect_features(target, tiny_tokenizer, TEXTS, stopped, max_tokens=32 * 8, seq_len=32, shard_sequences=8,
                     progress=False)  # fmt: skip
    assert json.loads((stopped / "features.json").read_text())["sequences"] == 8
    collect_features(target, tiny_tokenizer, TEXTS, stopped, max_tokens=32 * 24, seq_len=32, shard_sequences=8,
                     progress=False)  # fmt: skip
    assert json.loads((stopped / "features.json").read_text())["sequences"] == 24
    assert torch.equal(load_features(stopped)["tokens"], load_features(features)["tokens"])
    other = make_tiny_model(vocab_size=target.config.vocab_size, seed=5)
    with pytest.raises(ValueError, match="another target"):
        collect_features(other, tiny_tokenizer, TEXTS, features, max_tokens=32 * 24, seq_len=32, progress=False)
    with pytest.raises(ValueError, match="max_tokens"):
        collect_features(target, tiny_tokenizer, TEXTS, tmp_path, max_tokens=8, seq_len=32, progress=False)


@pytest.mark.parametrize(("kind", "distill"), [("medusa", "top1"), ("eagle", "top1"), ("medusa", "soft"),
                                               ("eagle", "soft")])  # fmt: skip
def test_training_learns_saves_resumes_and_stays_lossless(kind, distill, target, tiny_tokenizer, features, tmp_path):
    config = TrainConfig(kind=kind, draft_vocab_size=64, num_heads=3, intermediate_size=64, batch_size=4,
                         lr=1e-2, max_steps=100, val_every=50, save_every=50, loss_positions=16,
                         distill=distill)  # fmt: skip
    data = load_features(features)
    eos = [tiny_tokenizer.eos_token_id]
    report = train_drafter(target, features, tmp_path, config, eos, progress=False)
    assert report["steps"] == 100 and report["stopped_by"] == "max_steps"
    assert [h["step"] for h in report["history"]] == [50, 100]
    assert report["data"]["train_sequences"] + report["data"]["val_sequences"] == 24
    first = report["val_top1_per_position"][0]
    assert len(report["val_top1_per_position"]) == (3 if kind == "medusa" else 4)
    assert report["expected_accepted_per_step"]["1"] == pytest.approx(first, abs=1e-3)

    drafter = load_drafter(tmp_path, target, kind)
    assert drafter.config.training["steps"] == 100 and int(drafter.head_ids[0]) == eos[0]  # special tokens first
    # trained, the drafter agrees with the target's predictions more often than before training
    labels = _labels(data, drafter)
    trained = validate(drafter.float(), data["tokens"], data["features"], labels, depth=1)[0]
    fresh = build_drafter(drafter.config, drafter.head_ids).attach(target, dtype=torch.float32)
    if distill == "top1":
        assert trained > validate(fresh, data["tokens"], data["features"], labels, depth=1)[0] + 0.04
    else:  # a random tiny target's distributions are nearly flat, so top-1 barely moves: the loss must fall
        assert _loss(drafter.float(), data, labels) < _loss(fresh, data, labels) - 0.05

    # resume: continue from the checkpoint to a larger step budget
    longer = TrainConfig(**{**config.__dict__, "max_steps": 110})
    again = train_drafter(target, features, tmp_path, longer, eos, resume=True, progress=False)
    assert again["steps"] == 110 and [h["step"] for h in again["history"]] == [50, 100]

    # the trained drafter is lossless: greedy output equals the target's alone (float32)
    proposer = make_proposer(kind, target=target, drafter=str(tmp_path))
    generator = SpeculativeGenerator(target, tokenizer=tiny_tokenizer, proposer=proposer)
    prompt = tiny_tokenizer.encode(CORPUS[0])
    result = generator.generate(prompt, num_speculative_tokens=3, sampling=None)
    assert result.token_ids == target_only_greedy(target, prompt, len(result.token_ids))
    assert result.stats.accepted_tokens > 0  # and it drafts tokens the target keeps


@torch.no_grad()
def _loss(drafter, data, labels):
    """The soft-label training loss at every position (no noise)."""
    if drafter.config.kind == "medusa":
        return float(medusa_loss(drafter, data["features"].float(), labels, distill="soft")[0])
    return float(eagle_loss(drafter, data["tokens"], data["features"].float(), labels, 0.0, 1.0, distill="soft")[0])


def _labels(data, drafter):
    column = torch.full((drafter.config.vocab_size,), -100, dtype=torch.int64)
    column[drafter.head_ids] = torch.arange(drafter.head_ids.shape[0])
    return column[data["predictions"]]


def test_soft_labels_are_the_targets_distribution_over_the_token_map(target):
    """Soft cross-entropy = the teacher's entropy + KL(teacher || student): least, and equal to the
    entropy, when the student's scores are the teacher's; top-1 labels are a plain cross-entropy."""
    torch.manual_seed(0)
    head_ids = torch.arange(40)
    drafter = build_drafter(DrafterConfig.for_target("medusa", target, 40, 2), head_ids).attach(
        target, dtype=torch.float32
    )
    teacher = torch.randn(3, 5, target.config.hidden_size)
    probs = torch.softmax(drafter.logits(teacher), dim=-1)
    entropy = float(-(probs * probs.log()).sum(-1).mean())
    same = _classification_loss(drafter, drafter.logits(teacher), torch.zeros(3, 5, dtype=torch.int64), teacher)
    assert float(same) == pytest.approx(entropy, rel=1e-5)
    other = drafter.logits(torch.randn(3, 5, target.config.hidden_size))
    assert float(_classification_loss(drafter, other, torch.zeros(3, 5, dtype=torch.int64), teacher)) > entropy + 0.01
    labels = torch.tensor([[1, 2, -100, 3, 4]] * 3)
    hard = _classification_loss(drafter, other, labels, None)
    expected = torch.nn.functional.cross_entropy(other.flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert float(hard) == pytest.approx(float(expected))


def test_time_budget_stops_training(target, features, tmp_path):
    config = TrainConfig(kind="medusa", draft_vocab_size=32, max_steps=10_000, time_budget_s=1.0, val_every=10_000,
                         save_every=10_000)  # fmt: skip
    report = train_drafter(target, features, tmp_path, config, progress=False)
    assert report["stopped_by"] == "time_budget" and 0 < report["steps"] < 10_000


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="kind"):
        TrainConfig(kind="hydra")
    with pytest.raises(ValueError, match="max_steps"):
        TrainConfig(max_steps=0)
    with pytest.raises(ValueError, match="val_fraction"):
        TrainConfig(val_fraction=1.0)
    with pytest.raises(ValueError, match="distill"):
        TrainConfig(distill="kl")
    with pytest.raises(ValueError, match="cls_weight"):
        TrainConfig(cls_weight=-0.1)
    with pytest.raises(ValueError, match="ttt_steps"):
        TrainConfig(ttt_steps=0)


def _eagle(target, seed=0, std=None):
    """A random EAGLE head; with ``std``, its decoder layer's matrices drawn that wide, so that what
    each position attends to moves its top-1 (at the default init the residual path dominates)."""
    torch.manual_seed(seed)
    config = DrafterConfig.for_target("eagle", target, 64, intermediate_size=64)
    drafter = build_drafter(config, torch.arange(64))
    if std is not None:
        with torch.no_grad():
            for weight in drafter.decoder.layers.parameters():
                if weight.dim() == 2:
                    weight.normal_(0.0, std)
    return drafter.attach(target, dtype=torch.float32)


def test_unrolled_eagle_loss_drafts_as_the_head_drafts(target, features):
    """With ttt_steps D, step j of the loss is the head's own autoregressive draft j, as drafting runs
    it: one rollout at a time on a cache (the true pairs up to p, then its own features): the same
    top-1 hits at every step, to the count; ``validate`` reports the same agreement."""
    data = load_features(features)
    drafter = _eagle(target, std=0.5)
    labels = _labels(data, drafter)
    tokens, feats, y = data["tokens"][:3], data["features"][:3].float(), labels[:3]
    D, L = 3, tokens.shape[1]
    with torch.no_grad():
        _, correct, counted = eagle_loss(drafter, tokens, feats, y, 0.0, 0.1, ttt_steps=D)
        hits, seen = torch.zeros(D, dtype=torch.int64), torch.zeros(D, dtype=torch.int64)
        for b in range(3):
            for p in range(L - D):
                cache = drafter.new_cache()
                out = drafter(
                    feats[b : b + 1, : p + 1], tokens[b : b + 1, 1 : p + 2], torch.arange(1, p + 2)[None], cache
                )
                predicted = out[:, -1:]  # f^_{p+1}
                for j in range(1, D + 1):
                    if j > 1:
                        position = torch.tensor([[p + j]])
                        predicted = drafter(predicted, tokens[b : b + 1, p + j : p + j + 1], position, cache)
                    label = int(y[b, p + j])
                    if label >= 0:
                        seen[j - 1] += 1
                        hits[j - 1] += int(drafter.logits(predicted)[0, -1].argmax()) == label
    assert torch.equal(counted, seen) and torch.equal(correct, hits)
    assert int(correct.sum()) > 0  # a head that hits something: the equality is not 0 == 0
    expected = (hits.double() / seen.double()).tolist()
    assert validate(drafter, tokens, feats, y, depth=D) == pytest.approx(expected, abs=1e-12)


def test_one_step_eagle_loss_is_teacher_forcing(target, features):
    """ttt_steps 1 (the default) is EAGLE-1's loss: every position from the true feature, no cache."""
    data = load_features(features)
    drafter = _eagle(target)
    labels = _labels(data, drafter)
    tokens, feats = data["tokens"][:4], data["features"][:4].float()
    with torch.no_grad():
        loss = eagle_loss(drafter, tokens, feats, labels[:4], 0.0, 0.5)[0]
        L = tokens.shape[1]
        predicted = drafter(feats[:, :-1], tokens[:, 1:], torch.arange(1, L).expand(4, L - 1))
        logits = drafter.logits(predicted)
        expected = torch.nn.functional.smooth_l1_loss(
            predicted, feats[:, 1:]
        ) + 0.5 * torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:4, 1:].flatten(), ignore_index=-100)
    torch.testing.assert_close(loss, expected)
    with pytest.raises(ValueError, match="ttt_steps"):
        eagle_loss(drafter, tokens, feats, labels[:4], 0.0, 0.5, ttt_steps=L)


def test_unrolled_loss_trains_later_draft_positions_through_earlier_steps(target, features, tmp_path):
    """The loss of step 2 reaches the weights through step 1's predicted feature (not detached), and
    a run with ttt_steps records it and reports training hits for every unrolled step."""
    data = load_features(features)
    drafter = _eagle(target)
    labels = _labels(data, drafter)
    tokens, feats = data["tokens"][:4], data["features"][:4].float()
    first = drafter.fc.weight
    one = torch.autograd.grad(eagle_loss(drafter, tokens, feats, labels[:4], 0.0, 0.1, ttt_steps=1)[0], first)[0]
    two = torch.autograd.grad(eagle_loss(drafter, tokens, feats, labels[:4], 0.0, 0.1, ttt_steps=2)[0], first)[0]
    assert not torch.allclose(one, two)
    config = TrainConfig(kind="eagle", draft_vocab_size=64, intermediate_size=64, max_steps=4, val_every=4,
                         save_every=4, loss_positions=8, ttt_steps=3)  # fmt: skip
    report = train_drafter(target, features, tmp_path, config, progress=False)
    assert report["config"]["ttt_steps"] == 3 and report["steps"] == 4
    assert load_drafter(tmp_path, target, "eagle").config.training["config"]["ttt_steps"] == 3


def test_expected_accepted_is_the_sum_of_running_products():
    assert expected_accepted([0.5, 0.5, 1.0]) == pytest.approx(0.5 + 0.25 + 0.25)
    assert expected_accepted([]) == 0.0


def test_cli_trains_on_a_folder_corpus_into_the_default_folder(target, tiny_tokenizer, tmp_path, monkeypatch, capsys):
    from specdecode.commands.main import main
    from specdecode.drafters import default_drafter_dir

    target_dir, corpus = tmp_path / "tiny-target", tmp_path / "corpus"
    target.save_pretrained(target_dir)
    tiny_tokenizer.save_pretrained(target_dir)
    corpus.mkdir()
    for i, text in enumerate(TEXTS):
        (corpus / f"f{i}.py").write_text(text)
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    argv = ["train-drafter", "--kind", "eagle", "--target", str(target_dir), "--dtype", "float32", "--data",
            str(corpus), "--max-tokens", "512", "--seq-len", "32", "--max-steps", "4", "--draft-vocab-size", "50",
            "--intermediate-size", "32", "--val-every", "2", "--save-every", "2", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    folder = default_drafter_dir("eagle", target_dir)
    saved = json.loads((folder / "drafter.json").read_text())
    assert saved["kind"] == "eagle" and saved["training"]["steps"] == 4 and saved["draft_vocab_size"] == 50
    assert saved["training"]["data"]["source"] == str(corpus)
    assert "saved eagle drafter" in capsys.readouterr().out
    assert main(["train-drafter", "--kind", "eagle", "--data", str(tmp_path / "nowhere")]) == 2
    assert main(["train-drafter", "--kind", "eagle", "--extra-features", str(tmp_path / "nowhere")]) == 2
    assert "--extra-features" in capsys.readouterr().err
    chat = tmp_path / "chat-features"
    (corpus / "documented.py").write_text(SOURCE)
    argv = ["train-drafter", "--kind", "eagle", "--target", str(target_dir), "--dtype", "float32", "--data",
            str(corpus), "--chat", "--collect-only", "--features", str(chat), "--max-tokens", "64", "--seq-len",
            "32", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    meta = json.loads((chat / "features.json").read_text())
    assert meta["sequences"] == 2 and meta["source"] == f"{corpus} (chat examples of its functions)"
    assert "--collect-only" in capsys.readouterr().out


SOURCE = '''
def documented(a, b):
    """Add two numbers.

    Returns their sum.
    """
    total = a + b
    total += 0
    return total


def undocumented(a):
    x = a
    y = x
    return y


def short(a):
    """Too short to teach anything."""
    return a


class Box:
    def method(self, item):
        """Put ``item`` in the box."""
        self.items = []
        self.items.append(item)
'''


def test_chat_examples_are_the_corpus_functions_in_the_chat_template(tiny_tokenizer):
    examples = list(function_examples(SOURCE))
    assert [whole.split("(")[0] for _, whole in examples] == ["def documented", "def method"]
    header, whole = examples[1]
    assert header == 'def method(self, item):\n    """Put ``item`` in the box."""\n'  # dedented
    assert whole == header + "    self.items = []\n    self.items.append(item)\n"
    assert list(function_examples("def broken(:\n")) == []
    chats = list(chat_texts(tiny_tokenizer, [SOURCE, "x = 1\n"], seed=0))
    assert len(chats) == 2
    user, assistant = chats[1].split("<|assistant|>")
    assert user.startswith("<|user|>") and f"```python\n{header}```" in user
    assert any(instruction in user for instruction in CHAT_INSTRUCTIONS)
    assert assistant.startswith(f"```python\n{whole}```")
    plain = copy.deepcopy(tiny_tokenizer)
    plain.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        next(chat_texts(plain, [SOURCE]))


def test_training_on_several_feature_folders(target, tiny_tokenizer, features, tmp_path):
    chat = tmp_path / "chat"
    collect_features(target, tiny_tokenizer, chat_texts(tiny_tokenizer, [SOURCE] * 20), chat, max_tokens=32 * 20,
                     seq_len=32, progress=False, source="chat")  # fmt: skip
    config = TrainConfig(kind="eagle", draft_vocab_size=40, max_steps=3, val_every=10, save_every=10)
    report = train_drafter(target, [features, chat], tmp_path / "out", config, progress=False)
    data = report["data"]
    assert data["source"] == "conftest corpus + chat" and data["val_sequences"] == 1 + 1  # 5% of 24 and of 20
    assert data["train_sequences"] == 24 + 20 - 2
    assert set(report["val_top1_per_position_by_source"]) == {"conftest corpus", "chat"}
    other = tmp_path / "other"
    collect_features(target, tiny_tokenizer, TEXTS, other, max_tokens=16 * 8, seq_len=16, progress=False)
    with pytest.raises(ValueError, match="seq_len"):
        train_drafter(target, [features, other], tmp_path / "out2", config, progress=False)
    with pytest.raises(FileNotFoundError, match="features.json"):
        train_drafter(target, [features, tmp_path / "nowhere"], tmp_path / "out3", config, progress=False)


def test_saved_weights_are_bfloat16_unless_float32_is_asked(target, features, tmp_path):
    from safetensors.torch import load_file

    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        config = TrainConfig(kind="eagle", draft_vocab_size=40, max_steps=2, val_every=10, save_every=10,
                             save_dtype=name)  # fmt: skip
        train_drafter(target, features, tmp_path / name, config, progress=False)
        state = load_file(str(tmp_path / name / "model.safetensors"))
        assert state["head_ids"].dtype == torch.int64
        assert {v.dtype for key, v in state.items() if key != "head_ids"} == {dtype}
    # the same seeded training: the bfloat16 file holds the float32 weights rounded
    half, full = load_drafter(tmp_path / "bfloat16"), load_drafter(tmp_path / "float32")
    torch.testing.assert_close(half.fc.weight, full.fc.weight.to(torch.bfloat16).float(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="save_dtype must be one of"):
        TrainConfig(save_dtype="float16")


def test_warm_start_takes_the_saved_weights_and_a_new_token_map(target, features, tmp_path):
    first = TrainConfig(kind="eagle", draft_vocab_size=40, max_steps=3, val_every=10, save_every=10)
    train_drafter(target, features, tmp_path / "a", first, progress=False)
    saved = load_drafter(tmp_path / "a")
    second = TrainConfig(kind="eagle", draft_vocab_size=30, max_steps=1, lr=1e-12, val_every=10, save_every=10)
    train_drafter(target, features, tmp_path / "b", second, progress=False, init_from=tmp_path / "a")
    warm = load_drafter(tmp_path / "b")
    assert warm.head_ids.shape == (30,) and saved.head_ids.shape == (40,)
    torch.testing.assert_close(warm.fc.weight, saved.fc.weight)  # lr ~ 0: the saved weights, unchanged
    cold = load_drafter(tmp_path / "a")
    train_drafter(target, features, tmp_path / "c", second, progress=False)
    assert not torch.allclose(load_drafter(tmp_path / "c").fc.weight, cold.fc.weight)
    with pytest.raises(ValueError, match="eagle"):
        train_drafter(target, features, tmp_path / "d", TrainConfig(kind="medusa", draft_vocab_size=30, max_steps=1),
                      progress=False, init_from=tmp_path / "a")  # fmt: skip
    wide = TrainConfig(kind="eagle", draft_vocab_size=30, max_steps=1, intermediate_size=48)
    with pytest.raises(ValueError, match="another shape"):
        train_drafter(target, features, tmp_path / "e", wide, progress=False, init_from=tmp_path / "a")
