"""Image encoding throughput and one-image TTFT of a LLaVA model, beside transformers in one run.

A random LLaVA whose vision tower has LLaVA-1.5-7B's shape (CLIP ViT-L/14 at 336 px: 24
layers, width 1024, 16 heads, MLP 4096, 577 positions; features of layer -2 without the
class token: 576 image tokens; the two-layer projector) over a small text model (`--text-
hidden`, 2 layers), float32 on both sides (`--small`: a 6-layer, width-256 tower at 224 px
that runs in seconds). Measured:
- images/s through the vision program (ours: the engine's compiled vision program for N
  images, writing the features into the pool; transformers: `get_image_features`), for N in
  `--images`;
- TTFT of a one-image chat request (ours: `LLM.chat` with a PNG data URL, max_tokens 1:
  decoding and preprocessing the image, the vision program, the prompt's prefill in pieces,
  the first token; the prefix cache off, so every round encodes and prefills it all;
  transformers: its processor and `generate(max_new_tokens=1)`).
Prints a table with each side and their ratio (medians of `--rounds`).

    .venv/bin/python bench/vision.py
    .venv/bin/python bench/vision.py --small --rounds 3
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LLAVA_15_TOWER = dict(model_type="clip_vision_model", hidden_size=1024, intermediate_size=4096,
                      num_hidden_layers=24, num_attention_heads=16, image_size=336,
                      patch_size=14, projection_dim=768)
SMALL_TOWER = dict(LLAVA_15_TOWER, hidden_size=256, intermediate_size=1024,
                   num_hidden_layers=6, num_attention_heads=4, image_size=224)


def _median_time(fn, rounds: int) -> float:
    fn()  # compile / warm
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="timed runs per case (median)")
    p.add_argument("--images", type=int, nargs="+", default=[1, 4])
    p.add_argument("--text-hidden", type=int, default=512)
    p.add_argument("--small", action="store_true", help="a 6-layer, width-256 tower")
    args = p.parse_args()

    # heavy imports after parsing: --help starts at once
    import jax
    import numpy as np
    import torch
    import transformers
    from PIL import Image

    from devtools.hf_models import save_tiny_tokenizer
    from devtools.llava_models import CHAT_TEMPLATE, IMAGE_TOKEN, TOWERS
    from metrale_jax import LLM, SamplingParams

    tower = SMALL_TOWER if args.small else LLAVA_15_TOWER
    size = tower["image_size"]
    folder = Path(tempfile.mkdtemp(prefix="llava-bench-"))
    save_tiny_tokenizer(folder, added_tokens=(IMAGE_TOKEN,), chat_template=CHAT_TEMPLATE)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    E = args.text_hidden
    config = transformers.LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=1024, hidden_size=E,
                         intermediate_size=2 * E, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=8, max_position_embeddings=2048),
        vision_config=tower, image_token_index=tok.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    hf = transformers.LlavaForConditionalGeneration(config).eval()
    hf.save_pretrained(folder)
    processor_cfg = dict(TOWERS["clip"]["processor"], size={"shortest_edge": size},
                         crop_size={"height": size, "width": size})
    (folder / "preprocessor_config.json").write_text(json.dumps(processor_cfg))
    torch.set_flush_denormal(True)

    llm = LLM(folder, max_slots=4, max_len=1024, max_prefill_len=256, max_prefill_batch=2,
              max_images=max(args.images), warmup=True, prefix_cache=False)
    engine = llm.scheduler.engine
    v = llm.config.vision
    rng = np.random.default_rng(0)
    state = {"s": llm.scheduler.state}

    def ours_images(n: int):
        pixels = rng.standard_normal((n, 3, size, size)).astype(np.float32)
        dst = np.arange(n, dtype=np.int32)

        def run():
            # The loop's state is idle here (no request in flight): the program runs on it.
            vision = engine.image_encoder
            state["s"] = vision.program(n)(vision.params, state["s"], pixels, dst)
            jax.block_until_ready(state["s"].images)
        return run

    def theirs_images(n: int):
        pixels = torch.from_numpy(rng.standard_normal((n, 3, size, size)).astype(np.float32))

        def run():
            with torch.no_grad():
                hf.model.get_image_features(pixel_values=pixels, vision_feature_layer=-2,
                                            vision_feature_select_strategy="default")
        return run

    image = Image.fromarray(rng.integers(0, 255, (480, 640, 3), dtype=np.uint8))
    png = io.BytesIO()
    image.save(png, "PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "Describe the image."}]}]
    first = SamplingParams(max_tokens=1, temperature=0)
    hf_processor = transformers.LlavaProcessor(
        image_processor=transformers.CLIPImageProcessorPil(**processor_cfg), tokenizer=tok,
        chat_template=tok.chat_template, patch_size=v.patch_size,
        vision_feature_select_strategy="default", num_additional_image_tokens=1)
    hf_messages = [{"role": "user", "content": [
        {"type": "image", "image": image}, {"type": "text", "text": "Describe the image."}]}]

    def ours_ttft():
        llm.chat(messages, first)

    def theirs_ttft():
        inputs = hf_processor.apply_chat_template(hf_messages, tokenize=True, return_dict=True,
                                                  add_generation_prompt=True,
                                                  return_tensors="pt")
        with torch.no_grad():
            hf.generate(**inputs, max_new_tokens=1, do_sample=False, pad_token_id=0)

    params = sum(p.numel() for p in hf.model.vision_tower.parameters()) / 1e6
    print(f"\nvision tower {params:.0f}M params ({'small' if args.small else 'LLaVA-1.5-7B'} "
          f"shape, {size} px, {v.tokens_per_image} image tokens), text model width {E}, "
          f"float32, median of {args.rounds}\n")
    print("| measure | metrale | transformers | metrale / transformers |")
    print("|---|---|---|---|")
    for n in args.images:
        t_ours = _median_time(ours_images(n), args.rounds)
        t_hf = _median_time(theirs_images(n), args.rounds)
        print(f"| images/s, {n} per program | {n / t_ours:.2f} | {n / t_hf:.2f} | "
              f"{t_hf / t_ours:.2f}x |")
    llm.scheduler.state = state["s"]
    t_ours = _median_time(ours_ttft, args.rounds)
    t_hf = _median_time(theirs_ttft, args.rounds)
    print(f"| TTFT of a one-image chat, s | {t_ours:.3f} | {t_hf:.3f} | {t_hf / t_ours:.2f}x |")
    llm.close()


if __name__ == "__main__":
    main()
