"""Tiny tokenizers trained in the test run (no network): SentencePiece and `tokenizers` BPEs."""

from __future__ import annotations

import json
from pathlib import Path

import sentencepiece as spm
from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

from tests.text.corpus import training_lines

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_json(path: Path, data: dict) -> None:
    """Write `data` as JSON to `path`."""
    path.write_text(json.dumps(data, ensure_ascii=False, indent=1), encoding="utf-8")


def train_sentencepiece(folder: Path, **options) -> Path:
    """Train a ~1000-piece byte-fallback SentencePiece BPE (Llama-like settings) in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    text = folder / "corpus.txt"
    text.write_text("\n".join(training_lines()), encoding="utf-8")
    settings = dict(
        input=str(text),
        model_prefix=str(folder / "spm"),
        vocab_size=1000,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        character_coverage=0.995,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        hard_vocab_limit=False,
        minloglevel=2,
        num_threads=1,
    )
    settings.update(options)
    spm.SentencePieceTrainer.train(**settings)
    return folder / "spm.model"


def _train_bpe(tokenizer: Tokenizer, vocab_size: int, special: list[str], **kw) -> None:
    trainer = BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False, **kw)
    tokenizer.train_from_iterator(training_lines(), trainer)


def build_byte_level_folder(folder: Path) -> Path:
    """A GPT-2-style byte-level BPE folder, with config, generation config and chat template."""
    folder.mkdir(parents=True, exist_ok=True)
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = Tokenizer(BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    _train_bpe(tokenizer, 700, special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.save(str(folder / "tokenizer.json"))
    think_id = tokenizer.get_vocab_size()
    write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|endoftext|>",
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "add_bos_token": True,
            "added_tokens_decoder": {
                str(think_id): {
                    "content": "<think>",
                    "special": False,
                    "normalized": False,
                    "lstrip": False,
                    "rstrip": False,
                    "single_word": False,
                },
            },
        },
    )
    write_json(folder / "generation_config.json", {"eos_token_id": [2, 0]})
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    return folder


def build_llama_style_folder(folder: Path) -> Path:
    """A Llama-2-style `tokenizer.json`: byte-fallback BPE with `▁` spaces and `<s>` prefix."""
    folder.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>"]
    trained = Tokenizer(BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    _train_bpe(trained, 600, specials)
    model = json.loads(trained.to_str())["model"]
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for token in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tokenizer = Tokenizer(
        BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )
    tokenizer.normalizer = trained.normalizer
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
        },
    )
    return folder
