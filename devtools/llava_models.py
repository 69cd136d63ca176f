"""Tiny random LLaVA models (transformers' `LlavaForConditionalGeneration`), for tests.

`build_llava_folder(folder, tower=...)` saves a complete Hugging Face folder: the model (a
CLIP or SigLIP vision tower, the projector, a tiny decoder-only text model), the tiny BPE
tokenizer with `<image>` as an added token, `preprocessor_config.json` and a chat template
that puts `<image>` where a message has an image part (the SigLIP model keeps it in
`chat_template.json`, the processor's file, as llava-hf's hub folders do).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from devtools.hf_models import COMMON, save_tiny_tokenizer

IMAGE_TOKEN = "<image>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'image' %}<image>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "</s>{% endfor %}{% if add_generation_prompt %}<s>assistant: {% endif %}")
"""Text parts as text, each image part as `<image>` and a newline (LLaVA-1.5's layout)."""

TOWERS = {
    # CLIP: 28 px / 7 px patches = 16 patches + the class token; features of layer -2 without
    # the class token (LLaVA-1.5's choice): 16 image tokens.
    "clip": dict(
        vision=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                    num_hidden_layers=3, num_attention_heads=4, image_size=28, patch_size=7,
                    projection_dim=16),
        llava=dict(vision_feature_layer=-2, vision_feature_select_strategy="default"),
        processor=dict(image_processor_type="CLIPImageProcessor", do_resize=True,
                       size={"shortest_edge": 28}, resample=3, do_center_crop=True,
                       crop_size={"height": 28, "width": 28}, do_rescale=True,
                       rescale_factor=1 / 255, do_normalize=True,
                       image_mean=[0.48145466, 0.4578275, 0.40821073],
                       image_std=[0.26862954, 0.26130258, 0.27577711], do_convert_rgb=True)),
    # SigLIP (LLaVA-Interleave's tower): 32 px / 8 px = 16 patches, the last layer, "full".
    "siglip": dict(
        vision=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8),
        llava=dict(vision_feature_layer=-1, vision_feature_select_strategy="full"),
        processor=dict(image_processor_type="SiglipImageProcessor", do_resize=True,
                       size={"height": 32, "width": 32}, resample=3, do_rescale=True,
                       rescale_factor=1 / 255, do_normalize=True, image_mean=[0.5, 0.5, 0.5],
                       image_std=[0.5, 0.5, 0.5], do_convert_rgb=True)),
}


def build_llava_folder(folder: Path, tower: str = "clip", text: str = "llama", seed: int = 0,
                       llava_overrides: dict | None = None, processor_file: bool = False
                       ) -> transformers.LlavaForConditionalGeneration:
    """Saves a tiny random LLaVA model and its tokenizer, processor config and template into
    `folder`; returns the transformers model (eval mode, float32). processor_file: the
    processor saved as transformers 5 saves it (`LlavaProcessor.save_pretrained`:
    `processor_config.json` with the image processor nested, `chat_template.jinja`, no
    `preprocessor_config.json`)."""
    spec = TOWERS[tower]
    save_tiny_tokenizer(folder, added_tokens=(IMAGE_TOKEN,), chat_template=CHAT_TEMPLATE)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    text_cfg = dict(COMMON, model_type=text)
    vision_cfg = dict(spec["vision"])
    config = transformers.LlavaConfig(
        text_config=text_cfg, vision_config=vision_cfg, image_token_index=image_id,
        image_seq_length=16, projector_hidden_act="gelu",
        **{**spec["llava"], **(llava_overrides or {})})
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(spec["processor"]))
    if processor_file:
        image_processor = transformers.AutoImageProcessor.from_pretrained(folder)
        transformers.LlavaProcessor(
            image_processor=image_processor, tokenizer=tok, chat_template=CHAT_TEMPLATE,
            patch_size=config.vision_config.patch_size,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
            num_additional_image_tokens=1 if tower == "clip" else 0).save_pretrained(folder)
        (folder / "preprocessor_config.json").unlink()
        return model
    if tower == "siglip":  # the template where llava-hf's hub folders keep it: the processor's
        (folder / "chat_template.jinja").unlink()
        (folder / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return model
