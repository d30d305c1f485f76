"""How often does a quantized draft predict what the float32 draft predicts?

Runs the default draft (float32) and its quantized copies (``specdecode.models.torch.quant``) over the same
tokens of Python standard-library source (never benchmark prompts) in one pass each, and prints the
share of positions where each copy's argmax equals the float32 draft's, with the mean absolute
logit error. A cheap probe of what a quantization costs in acceptance before a benchmark run.

    python lab/scripts/draft_quant_agreement.py [--tokens 1024] [--variants int8,int8-all]

``int8`` is the default int8 copy (``down_proj`` float32), ``int8-all`` quantizes every linear.
"""

from __future__ import annotations

import argparse
import inspect
import json
import textwrap

import torch

from specdecode.models.default import ensure_default_model
from specdecode.models.torch.hf_loading import load_model, load_tokenizer
from specdecode.models.torch.quant import quantize_int8

VARIANTS = {
    "int8": {},
    "int8-all": {"keep_float": ()},
}


def source_ids(tokenizer: object, n: int) -> torch.Tensor:
    """The first ``n`` token ids of a few standard-library modules' source, int64 ``[n]``."""
    text = "\n\n".join(inspect.getsource(m) for m in (json.encoder, textwrap))
    ids = tokenizer(text)["input_ids"][:n]  # type: ignore[operator]
    return torch.tensor(ids, dtype=torch.int64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {list(VARIANTS)}")
    args = parser.parse_args()
    names = args.variants.split(",")
    if set(names) - set(VARIANTS):
        parser.error(f"--variants must name some of {list(VARIANTS)}, got {args.variants!r}")
    model = load_model(None, "draft", "float32")
    ids = source_ids(load_tokenizer(ensure_default_model("draft")), args.tokens).view(1, -1)  # (1, T)
    with torch.inference_mode():
        reference = model(ids).logits[0]  # (T, V)
        top = reference.argmax(-1)
        print(f"{ids.shape[1]} tokens of json/encoder.py + textwrap.py")
        for name in names:
            copy = quantize_int8(model, **VARIANTS[name])
            logits = copy(ids).logits[0]
            agree = float((logits.argmax(-1) == top).float().mean())
            error = float((logits - reference).abs().mean())
            print(f"{name:12s} argmax agreement with float32 {agree:.3f}, mean |logit error| {error:.3f}")
            del copy


if __name__ == "__main__":
    main()
