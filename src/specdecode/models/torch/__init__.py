"""The torch backend: Hugging Face ``transformers`` models behind the runner contract
(:mod:`specdecode.models.contract`): runners with a truncatable KV cache, the batched runner, CPU
compute paths, int8 drafts, loading of model folders (docs/design.md §2b)."""
