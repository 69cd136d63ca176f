"""Tiny random Hugging Face models of every architecture we implement, for fidelity tests.

`build_hf_model(arch, folder)` creates the transformers model from a small config, fills its
weights with values large enough that logits differ clearly between tokens, and saves it with
`save_pretrained` (safetensors). Norm weights are randomised too, so that an offset or a
swapped norm shows up.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

COMMON = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256)

ARCH_CONFIGS: dict[str, tuple[type, type, dict]] = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama3": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        rope_theta=500000.0, tie_word_embeddings=True)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(sliding_window=8)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM,
              dict(hidden_activation="gelu_pytorch_tanh")),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               dict(sliding_window=8, query_pre_attn_scalar=16, attn_logit_softcapping=20.0,
                    final_logit_softcapping=15.0, num_hidden_layers=4)),
}


def build_hf_model(arch: str, folder: Path, seed: int = 0) -> transformers.PreTrainedModel:
    """Builds, randomises and saves a tiny `arch` model into `folder`; returns it (eval mode)."""
    config_cls, model_cls, extra = ARCH_CONFIGS[arch]
    config = config_cls(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    gemma = arch.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.2 * torch.randn_like(p))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Metrale serves language models on JAX and XLA.",
    "def main():\n    return 42\n",
    "Ça va très bien, merci. Über naïve café.",
    "数字 1234567890 and symbols !@#$%^&*()",
] * 20


def save_tiny_tokenizer(folder: Path, vocab_size: int = 600) -> None:
    """Trains a byte-level BPE tokenizer on a small corpus and saves it HF-style in `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                                eos_token="</s>", pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>"
                          "{% endfor %}{% if add_generation_prompt %}<s>assistant: {% endif %}")
    fast.save_pretrained(folder)


def build_tiny_checkpoint(folder: Path, arch: str = "llama") -> Path:
    """A complete tiny HF folder: a random `arch` model plus the tiny tokenizer; returns it."""
    build_hf_model(arch, folder)
    save_tiny_tokenizer(folder)
    return folder
