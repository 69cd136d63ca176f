"""Development helpers that tests/ and bench/ share: tiny random Hugging Face models of every
architecture Metrale runs, saved as checkpoint folders (`hf_models`: decoder-only families and
their tokenizer; `llava_models`: LLaVA; `nllb_models`: NLLB/M2M100 and its SentencePiece
tokenizer; `fidelity_references`: the stored transformers references of
tests/data/fidelity, importable without torch).

Not part of the installed library (pyproject installs metrale_jax and serving only): these need
the test extras (torch, transformers). Importable from the repository root, which pytest and
the bench scripts put on `sys.path`. May import metrale_jax; never tests, bench nor serving.
"""

# The project packages this package's modules may import besides its own (tests/test_imports.py).
MAY_IMPORT = ("metrale_jax",)
