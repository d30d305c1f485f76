"""One-row linear layers computed as two rows (specdecode.models.torch.one_row_linear): same results, hooks removed."""

from __future__ import annotations

import torch

from specdecode.models.torch.one_row_linear import pad_single_rows
from specdecode.models.torch.runner import ModelRunner


class _Shapes:
    """Records the input shape every Linear of the wrapped model sees."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seen: list[tuple[int, ...]] = []
        self.handles = [
            m.register_forward_hook(lambda mod, args, out: self.seen.append(tuple(args[0].shape)))
            for m in model.modules()
            if isinstance(m, torch.nn.Linear)
        ]


def test_one_row_is_computed_as_two_and_the_result_is_unchanged(tiny_target) -> None:
    ids = torch.tensor([5, 17, 3, 42, 8, 9])
    plain = ModelRunner(tiny_target)
    expected = [plain.forward(ids[:4])] + [plain.forward(ids[i : i + 1]) for i in (4, 5)]
    padded = ModelRunner(tiny_target)
    with pad_single_rows(tiny_target):
        shapes = _Shapes(tiny_target)  # registered after the padding hooks: sees the padded input
        got = [padded.forward(ids[:4])] + [padded.forward(ids[i : i + 1]) for i in (4, 5)]
        for h in shapes.handles:
            h.remove()
    for e, g in zip(expected, got, strict=True):
        assert g.shape == e.shape
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    assert padded.length == plain.length == 6
    rows = [s[-2] for s in shapes.seen]
    assert 4 in rows and 1 not in rows and 2 in rows  # prompt rows unchanged; one-token steps padded


def test_hooks_are_removed_on_exit_and_after_an_error(tiny_target) -> None:
    linears = [m for m in tiny_target.modules() if isinstance(m, torch.nn.Linear)]
    before = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in linears]
    try:
        with pad_single_rows(tiny_target):
            assert all(len(m._forward_pre_hooks) == b[0] + 1 for m, b in zip(linears, before, strict=True))
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in linears] == before
    assert not any(hasattr(m, "_specdecode_padded_row") for m in linears)


def test_other_shapes_pass_unchanged() -> None:
    layer = torch.nn.Linear(4, 3)
    x = torch.randn(2, 1, 4)  # two rows in all (batch of two): not padded
    with pad_single_rows(layer):
        assert layer(x).shape == (2, 1, 3)
        assert layer(torch.randn(4)).shape == (3,)  # 1-D: unchanged
        torch.testing.assert_close(layer(x[:1])[0, 0], layer.weight @ x[0, 0] + layer.bias, rtol=1e-6, atol=1e-6)
