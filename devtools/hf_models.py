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

PHI3_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)  # its defaults: 32000

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
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               dict(sliding_window=8, query_pre_attn_scalar=24, num_hidden_layers=4,
                    layer_types=["sliding_attention", "sliding_attention",
                                 "sliding_attention", "full_attention"],
                    rope_parameters={
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "linear", "factor": 2.0,
                                           "rope_theta": 1000000.0}})),
    # Phi-4-mini-like: fused projections, 3/4 of each head rotated, LongRoPE (short factors:
    # the context stays within original_max_position_embeddings; see ROPE_VARIANTS).
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(
        **PHI3_IDS, partial_rotary_factor=0.75, original_max_position_embeddings=256,
        rope_scaling={"rope_type": "longrope", "factor": 4.0,
                      "short_factor": [1.0, 1.1, 1.3, 1.7, 2.2, 3.0],
                      "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]})),
    "llama_yarn": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                      "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False})),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)),
}

ROPE_VARIANTS: dict[str, tuple[type, type, dict]] = {
    # linear (also Gemma 3's global layers in ARCH_CONFIGS) and yarn's legacy `type` key:
    # tests/models/test_rope_scaling.py checks their tables
    "llama_linear": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen2_yarn": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})),
    # transformers re-derives these RoPE tables from the sequence's length, which a paged
    # cache cannot (docs/architecture.md, "RoPE"): tests/models/test_rope_scaling.py compares
    # them where the two agree.
    "llama_dynamic": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        max_position_embeddings=24, rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "phi3_long": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(
        **PHI3_IDS, original_max_position_embeddings=24, sliding_window=40,
        rope_scaling={"rope_type": "longrope",
                      "short_factor": [1.0, 1.1, 1.2, 1.4, 1.7, 2.1, 2.6, 3.2],
                      "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0]})),
}
"""Tiny models of RoPE variants that tests/models/test_rope_scaling.py checks (kept out of
the fidelity loop over `ARCH_CONFIGS`), among them those whose scaling transformers applies
per sequence length."""


def build_hf_model(arch: str, folder: Path, seed: int = 0,
                   overrides: dict | None = None) -> transformers.PreTrainedModel:
    """Builds, randomises and saves a tiny `arch` model into `folder`; returns it (eval mode).
    overrides: config fields that replace the tiny defaults (e.g. more heads)."""
    config_cls, model_cls, extra = {**ARCH_CONFIGS, **ROPE_VARIANTS}[arch]
    config = config_cls(**{**COMMON, **extra, **(overrides or {})})
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


def save_tiny_tokenizer(folder: Path, vocab_size: int = 600, added_tokens: tuple[str, ...] = (),
                        chat_template: str | None = None, corpus: list[str] = CORPUS) -> None:
    """Trains a byte-level BPE tokenizer on a small corpus and saves it HF-style in `folder`.

    added_tokens: non-special added tokens (e.g. `<think>`), kept in decoded text.
    chat_template: replaces the minimal default template.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                                eos_token="</s>", pad_token="<pad>")
    if added_tokens:
        fast.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    fast.chat_template = chat_template or (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>"
        "{% endfor %}{% if add_generation_prompt %}<s>assistant: {% endif %}")
    fast.save_pretrained(folder)


def build_tiny_checkpoint(folder: Path, arch: str = "llama",
                          overrides: dict | None = None) -> Path:
    """A complete tiny HF folder: a random `arch` model (config `overrides` applied) plus the
    tiny tokenizer; returns it."""
    build_hf_model(arch, folder, overrides=overrides)
    save_tiny_tokenizer(folder)
    return folder


TOOL_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
TOOL_CORPUS = [*CORPUS, *[
    '{"type": "function", "function": {"name": "get_weather", "parameters": {"type": '
    '"object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}',
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "<s>system: <tools></tools></s><s>user: weather?</s><s>assistant: </s>"
    "<s>tool: <tool_response>sunny</tool_response></s>"] * 20]
"""The tiny corpus plus tool-call JSON, so that tools and calls take few tokens."""
HERMES_TEMPLATE = """\
{%- if tools %}<s>system: {% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}\
<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools></s>
{%- elif messages[0].role == 'system' %}<s>system: {{ messages[0].content }}</s>
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'system' and loop.first %}
{%- elif m.role == 'assistant' %}<s>assistant: {% if m.reasoning_content %}<think>\
{{ m.reasoning_content }}</think>{% endif %}{{ m.content or '' }}
{%- for tc in m.tool_calls or [] %}<tool_call>{"name": "{{ tc.function.name }}", "arguments": \
{{ tc.function.arguments | tojson }}}</tool_call>{% endfor %}</s>
{%- elif m.role == 'tool' %}<s>tool: <tool_response>{{ m.content }}</tool_response></s>
{%- else %}<s>{{ m.role }}: {{ m.content }}</s>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<s>assistant: {% if enable_thinking is defined %}\
{% if enable_thinking %}<think>{% else %}<think></think>{% endif %}{% endif %}{% endif %}"""
"""A Hermes/Qwen-style template: tools in the system turn, `<tool_call>` history, tool
results, `<think>` opened by `enable_thinking=True` (closed empty by False)."""


def build_tool_checkpoint(folder: Path, arch: str = "llama") -> Path:
    """A tiny HF folder whose vocabulary has the think and tool-call tags as added tokens
    and whose template is `HERMES_TEMPLATE`; returns it. The default arch is the shared
    server's (`build_tiny_checkpoint`), so a server of the same shapes reuses its compiled
    programs from JAX's persistent cache."""
    build_hf_model(arch, folder)
    save_tiny_tokenizer(folder, added_tokens=TOOL_TOKENS, chat_template=HERMES_TEMPLATE,
                        corpus=TOOL_CORPUS)
    return folder


TINY_POOLER = dict(num_hidden_layers=2, vocab_size=640, max_position_embeddings=1024)
"""The tiny decoder embedder's and reranker's config (2 layers, the tiny tokenizer's vocab
plus room for added tokens, room for Qwen3-Reranker's long prompt in the tiny vocab)."""


def _append_end_token(folder: Path, token: str = "</s>") -> None:
    """Makes the folder's tokenizer append `token` to every encoding with special tokens, as
    Qwen3-Embedding's `tokenizer.json` appends `<|endoftext|>`."""
    import json

    from tokenizers import Tokenizer, processors
    path = folder / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A {token}", pair=f"$A {token} $B:1 {token}:1",
        special_tokens=[(token, tok.token_to_id(token))])
    tok.save(str(path))
    json.loads(path.read_text())  # still valid


def build_decoder_embedder(folder: Path, arch: str = "qwen3", pooling: str = "lasttoken",
                           seed: int = 0) -> Path:
    """A tiny Qwen3-Embedding-style folder: the bare `*Model` saved (tensor names without
    "model.", no `lm_head`; architectures `[Qwen3Model]`), the tiny tokenizer appending its
    end token `</s>`, and sentence-transformers' `modules.json` (Transformer, Pooling by
    `pooling`: "lasttoken" or "mean_tokens", Normalize). Returns it."""
    import json
    causal = build_hf_model(arch, folder, seed=seed, overrides=TINY_POOLER)
    (folder / "model.safetensors").unlink()
    causal.model.save_pretrained(folder)
    save_tiny_tokenizer(folder)
    _append_end_token(folder)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": causal.config.hidden_size,
        "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": pooling == "mean_tokens",
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": pooling == "lasttoken",
        "include_prompt": True}, indent=2))
    (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "sentence_bert_config.json").write_text(json.dumps(
        {"max_seq_length": 256, "do_lower_case": False}))
    return folder


def build_decoder_reranker(folder: Path, arch: str = "qwen3") -> Path:
    """A tiny Qwen3-Reranker-style folder (name it "...reranker..."): a `*ForCausalLM` and
    the tiny tokenizer with "yes" and "no" as tokens of their own. Returns it."""
    build_hf_model(arch, folder, overrides=TINY_POOLER)
    save_tiny_tokenizer(folder, added_tokens=("yes", "no"))
    return folder
