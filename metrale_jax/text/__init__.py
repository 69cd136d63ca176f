"""Text in and out of the model: tokenizers, the incremental detokenizer, chat templates.
Imports only errors (and the tokenizer libraries): nothing of the models or the engine.

tokenizer = load_tokenizer("checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf")  # or a folder
template = ChatTemplate.for_tokenizer(tokenizer)
ids = tokenizer.encode(template.render(messages), add_special_tokens=False)
detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
text = "".join(detok.push(i) for i in generated) + detok.flush()
"""

from metrale_jax.text.chat_template import ChatTemplate
from metrale_jax.text.detokenizer import IncrementalDetokenizer
from metrale_jax.text.gguf_metadata import read_gguf_metadata
from metrale_jax.text.gguf_tokenizer import load_gguf_tokenizer, tokenizer_from_gguf_metadata
from metrale_jax.text.hf_tokenizer import HFTokenizer, load_hf_tokenizer
from metrale_jax.text.loader import load_tokenizer
from metrale_jax.text.sentencepiece_tokenizer import (
    SentencePieceTokenizer,
    load_sentencepiece_tokenizer,
)
from metrale_jax.text.tokenizer import Tokenizer

__all__ = [
    "ChatTemplate",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "SentencePieceTokenizer",
    "Tokenizer",
    "load_gguf_tokenizer",
    "load_hf_tokenizer",
    "load_sentencepiece_tokenizer",
    "load_tokenizer",
    "read_gguf_metadata",
    "tokenizer_from_gguf_metadata",
]

# The project packages this package's modules may import besides its own (tests/test_imports.py).
MAY_IMPORT = ("metrale_jax.errors",)
