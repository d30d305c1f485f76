"""The llamacpp backend: GGUF files on llama.cpp's kernels through llama-cpp-python, behind the
runner contract (:mod:`specdecode.models.contract`): the model and runner, the batched runner, token
trees, the reference-kernel switch, the set-up's keyed build and its smoke test (docs/design.md §2b).

Imports nothing: ``build`` runs as a script before specdecode is installed."""
