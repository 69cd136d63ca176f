"""Image inputs of vision-language models: decoding and preprocessing.

Imports only errors and families (and Pillow, NumPy and the standard library): nothing of the
models or the engine, which takes the prompt's `PromptImage` records from here.

image, raw = load_image_url(part_url, ImageLimits(), param="messages[1].content[2]")
processor = ImageProcessor.from_hf(json.load(open("preprocessor_config.json")))
pixel_values = processor(image)  # float32 [3, H, W], as transformers' slow processor gives
"""

from metrale_jax.vision.image_processor import ImageProcessor, decode_image
from metrale_jax.vision.media import (
    ImageLimits,
    check_image_count,
    host_allowed,
    image_digest,
    load_image_url,
)

__all__ = [
    "ImageLimits",
    "ImageProcessor",
    "check_image_count",
    "decode_image",
    "host_allowed",
    "image_digest",
    "load_image_url",
]

# The project packages this package's modules may import besides its own (tests/test_imports.py).
MAY_IMPORT = ("metrale_jax.errors", "metrale_jax.families")
