"""A LLaVA model through the engine and batching loop, against transformers (float32).

Tiny random `LlavaForConditionalGeneration` models (devtools/llava_models.py, CLIP and SigLIP
towers): prompts with one and with two images, whose placeholder runs cross prompt-piece
boundaries (max_prefill_len 16 < the prompt), give transformers' greedy tokens, and at each
step our top-20 log-probabilities equal transformers' log-softmax of its logits within 1e-4
relative; requests side by side give what each gives alone; nothing compiles after warmup.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from metrale_jax import SamplingParams
from metrale_jax.errors import InvalidParameterError
from metrale_jax.scheduler import GenerationRequest

pytestmark = pytest.mark.xdist_group("vision")

STEPS = 6


@pytest.fixture(scope="module", params=["clip", "siglip"])
def vlm(request, tmp_path_factory):
    """(an LLM on a tiny LLaVA model, warmed up; the transformers model)."""
    from devtools.llava_models import build_llava_folder
    from metrale_jax import LLM
    folder = tmp_path_factory.mktemp(f"llava-{request.param}")
    # CLIP's folder as transformers 5 saves a processor (processor_config.json, nested)
    hf = build_llava_folder(folder, request.param, "llama",
                            processor_file=request.param == "clip")
    llm = LLM(folder, max_slots=4, max_len=128, max_prefill_len=16, max_prefill_batch=2,
              max_images=3, warmup=True)
    _ = llm.scheduler
    yield llm, hf
    llm.close()


def _prompt(llm, n_images: int, text: str, seed: int):
    """(prompt ids with each image's placeholder run, the PromptImages, pixels [N, C, H, W])."""
    from metrale_jax.vision.prompt import PromptImage
    v = llm.config.vision
    tok = llm.tokenizer
    ids = tok.encode("<s>user: ", add_special_tokens=False)
    rng = np.random.default_rng(seed)
    images, pixels = [], []
    for _ in range(n_images):
        px = rng.standard_normal((v.num_channels, v.image_size, v.image_size)).astype(np.float32)
        images.append(PromptImage(len(ids), v.tokens_per_image, px,
                                  hashlib.sha256(px.tobytes()).hexdigest()))
        pixels.append(px)
        ids += [v.image_token_id] * v.tokens_per_image + tok.encode("\n", add_special_tokens=False)
    ids += tok.encode(f"{text}</s><s>assistant: ", add_special_tokens=False)
    return ids, tuple(images), np.stack(pixels) if pixels else None


def _reference(hf, ids, pixels) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens and the log-softmax of its logits at each step."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), pixel_values=torch.from_numpy(pixels),
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=STEPS, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    tokens = out.sequences[0, len(ids):].tolist()
    logprobs = torch.log_softmax(torch.stack(out.logits)[:, 0].float(), -1).numpy()
    return tokens, logprobs


def _run(llm, ids, images):
    from metrale_jax.completion import collect
    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True, logprobs=20)
    return llm.scheduler.submit(GenerationRequest.make(ids, params, images=images)), collect


@pytest.mark.parametrize("n_images", [1, 2])
def test_greedy_tokens_and_logprobs_equal_transformers(vlm, n_images):
    llm, hf = vlm
    ids, images, pixels = _prompt(llm, n_images, "What is in the picture?", seed=n_images)
    handle, collect = _run(llm, ids, images)
    out = collect(handle)
    want, ref = _reference(hf, ids, pixels)
    assert list(out.token_ids) == want
    assert out.prompt_tokens == len(ids)  # the image tokens count
    worst = 0.0
    for step, entry in enumerate(out.logprobs):
        top_ids = np.array([t[0] for t in entry.top])
        ours = np.array([t[1] for t in entry.top])
        theirs = ref[step, top_ids]
        worst = max(worst, float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs))))
    assert worst <= 1e-4, f"log-probabilities: max relative error {worst:.2e}"


def test_side_by_side_equals_alone_and_nothing_compiles(vlm):
    llm, _ = vlm
    engine = llm.scheduler.engine
    before = engine.compile_count
    prompts = [_prompt(llm, n, text, seed) for n, text, seed in
               [(2, "Compare them.", 7), (1, "Describe it.", 8), (0, "Hello there.", 9),
                (1, "Describe it.", 10)]]
    alone = []
    for ids, images, _ in prompts:
        handle, collect = _run(llm, ids, images)
        alone.append(collect(handle).token_ids)
    handles = [_run(llm, ids, images) for ids, images, _ in prompts]
    together = [collect(h).token_ids for h, collect in handles]
    assert together == alone
    assert engine.compile_count == before


def test_images_that_do_not_fit_are_refused(vlm):
    llm, _ = vlm
    ids, images, _ = _prompt(llm, 1, "Describe it.", seed=3)
    sched = llm.scheduler
    params = SamplingParams(max_tokens=2)
    with pytest.raises(InvalidParameterError, match="1 image placeholders for 0 images"):
        sched.submit(GenerationRequest.make(ids, params))
    many, more, _ = _prompt(llm, 4, "Too many.", seed=4)
    with pytest.raises(InvalidParameterError, match="at most 3"):
        sched.submit(GenerationRequest.make(many, params, images=more))
    wrong = [im.__class__(im.offset + 1, im.length, im.pixels, im.digest) for im in images]
    with pytest.raises(InvalidParameterError, match="does not fit"):
        sched.submit(GenerationRequest.make(ids, params, images=wrong))


def _processor(folder, llm):
    """transformers' `LlavaProcessor` for the folder (its PIL image processor backend)."""

    import transformers
    v = llm.config.vision
    from metrale_jax.weights.llava_reader import read_processor_config
    cfg = read_processor_config(folder)
    cls = {"clip": transformers.CLIPImageProcessorPil,
           "siglip": transformers.SiglipImageProcessorPil}[v.tower]
    from devtools.llava_models import CHAT_TEMPLATE
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    return transformers.LlavaProcessor(
        image_processor=cls(**cfg), tokenizer=tok, chat_template=CHAT_TEMPLATE,
        patch_size=v.patch_size, vision_feature_select_strategy=v.select_strategy,
        num_additional_image_tokens=1 if v.tower == "clip" else 0)


def test_chat_with_image_parts_equals_transformers_processor_and_generate(vlm):
    """`LLM.chat` with a PNG data URL and a PIL image: the prompt ids and pixel values of
    transformers' LlavaProcessor, and its model's greedy tokens."""
    import base64
    import io

    from PIL import Image
    llm, hf = vlm
    rng = np.random.default_rng(5)
    first = Image.fromarray(rng.integers(0, 255, (40, 50, 3), dtype=np.uint8))
    second = Image.fromarray(rng.integers(0, 255, (30, 24, 4), dtype=np.uint8), "RGBA")
    png = io.BytesIO()
    first.save(png, "PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    ours = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What is it?"},
        {"type": "image", "image": second}]}]
    theirs = [{"role": "user", "content": [
        {"type": "image", "image": first}, {"type": "text", "text": "What is it?"},
        {"type": "image", "image": second}]}]
    ref = _processor(llm.checkpoint.path, llm).apply_chat_template(
        theirs, tokenize=True, return_dict=True, add_generation_prompt=True,
        return_tensors="np")
    ids, images = llm._chat_request(ours)
    assert ids == ref["input_ids"][0].tolist()
    np.testing.assert_array_equal(np.stack([im.pixels for im in images]), ref["pixel_values"])
    out = llm.chat(ours, SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True))
    want, _ = _reference(hf, ids, ref["pixel_values"])
    assert list(out.token_ids) == want


def test_orbax_round_trip_keeps_the_vision_encoder(vlm, tmp_path):
    from metrale_jax import LLM
    from metrale_jax.weights.orbax_store import save_orbax
    llm, _ = vlm
    saved = save_orbax(llm.checkpoint, tmp_path / "orbax")
    from metrale_jax.vision.media import ImageLimits
    again = LLM(saved, max_slots=4, max_len=128, max_prefill_len=16, max_prefill_batch=2,
                max_images=3, image_limits=ImageLimits(max_pixels=1000))
    try:
        assert again.config == llm.config
        assert again.image_limits.max_images == 3 and again.image_limits.max_pixels == 1000
        from PIL import Image
        big = Image.new("RGB", (40, 30))  # 1200 pixels: over the limit
        with pytest.raises(InvalidParameterError, match="pixels"):
            again.chat([{"role": "user", "content": [{"type": "image", "image": big}]}])
        assert again.checkpoint.image_processor == llm.checkpoint.image_processor
        ids, images, _ = _prompt(llm, 2, "Compare them.", seed=12)
        handle, collect = _run(llm, ids, images)
        want = collect(handle).token_ids
        handle, collect = _run(again, ids, images)
        assert collect(handle).token_ids == want
    finally:
        again.close()


def test_more_images_in_flight_than_the_pool_holds(vlm):
    """Five requests of two images each (10 images; the pool holds 3) all finish, each with
    what it gives alone: a row waits for slots until another's prompt is prefilled."""
    llm, _ = vlm
    prompts = [_prompt(llm, 2, f"Picture {i}.", seed=20 + i) for i in range(5)]
    alone = []
    for ids, images, _ in prompts:
        handle, collect = _run(llm, ids, images)
        alone.append(collect(handle).token_ids)
    handles = [_run(llm, ids, images) for ids, images, _ in prompts]
    assert [collect(h).token_ids for h, collect in handles] == alone
    assert llm.scheduler.engine.images.free_slots == 3
