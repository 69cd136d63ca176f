"""Image decoding and preprocessing: `pixel_values` equal to transformers' PIL-backend image
processors (bit for bit), and decoding that refuses what it should before decoding pixels."""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Callable

import numpy as np
import pytest
from PIL import Image
from transformers import CLIPImageProcessorPil, SiglipImageProcessorPil

from metrale_jax.errors import InvalidParameterError, UnsupportedModelError
from metrale_jax.vision import ImageProcessor, decode_image

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

# preprocessor_config.json contents. llava-1.5's (openai/clip-vit-large-patch14-336) and
# SigLIP so400m-384's as published, then small ones that exercise the crop's padding, the
# truncating shortest-edge rule, a legacy int size, other filters and skipped steps.
CONFIGS: dict[str, dict] = {
    "clip-llava-1.5": {
        "image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
        "do_resize": True, "size": {"shortest_edge": 336}, "resample": 3,
        "do_center_crop": True, "crop_size": {"height": 336, "width": 336},
        "do_rescale": True, "rescale_factor": 0.00392156862745098,
        "do_normalize": True, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
        "do_convert_rgb": True,
    },
    "clip-small": {"image_processor_type": "CLIPImageProcessor",
                   "size": {"shortest_edge": 32}, "crop_size": {"height": 30, "width": 30}},
    "clip-legacy-int-sizes": {"feature_extractor_type": "CLIPFeatureExtractor",
                              "size": 24, "crop_size": 20, "do_normalize": None},
    "clip-bilinear-no-normalize": {
        "image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 26},
        "crop_size": {"height": 24, "width": 30}, "resample": 2, "do_normalize": False},
    "clip-lanczos-no-rescale": {
        "image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 17},
        "crop_size": {"height": 16, "width": 16}, "resample": 1, "do_rescale": False},
    "siglip-384": {
        "image_processor_type": "SiglipImageProcessor", "processor_class": "SiglipProcessor",
        "do_resize": True, "size": {"height": 384, "width": 384}, "resample": 3,
        "do_rescale": True, "rescale_factor": 0.00392156862745098,
        "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    },
    "siglip-small": {"image_processor_type": "SiglipImageProcessor",
                     "size": {"height": 28, "width": 28}, "resample": 2},
    "siglip-oblong-defaults": {"image_processor_type": "SiglipImageProcessor",
                               "size": {"height": 20, "width": 36},
                               "image_mean": 0.25, "image_std": 0.75},
    "siglip-no-convert": {"image_processor_type": "SiglipImageProcessor",
                          "size": {"height": 24, "width": 24}, "do_convert_rgb": None},
}
RGB_ONLY = {"siglip-no-convert"}  # transformers fails or misreads other modes without convert


def hf_processor(config: dict):
    """transformers' PIL-backend processor of `config`. (In transformers 5 `CLIPImageProcessor`
    is the torchvision backend, and falls back to this one where torchvision is missing.)"""
    name = config.get("image_processor_type") or config["feature_extractor_type"]
    cls = CLIPImageProcessorPil if name.startswith("CLIP") else SiglipImageProcessorPil
    return cls(**config)


def _pixels(shape: tuple[int, ...], seed: int, high: int = 256,
            dtype: type = np.uint8) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, high, shape).astype(dtype)


def _rgb(height: int, width: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(_pixels((height, width, 3), seed))


def _palette(transparent: bool) -> Image.Image:
    image = _rgb(41, 57, seed=5).quantize(48)
    if transparent:
        image.info["transparency"] = 7
    return image


def _cmyk_jpeg() -> Image.Image:
    buf = io.BytesIO()
    _rgb(45, 61, seed=6).convert("CMYK").save(buf, "JPEG", quality=90)
    return Image.open(io.BytesIO(buf.getvalue()))


def _rgb_with_trns() -> Image.Image:
    image = Image.fromarray(np.tile(_pixels((36, 52, 1), 8, high=3), (1, 1, 3)))
    image.info["transparency"] = (1, 1, 1)  # an RGB PNG's tRNS colour
    return image


IMAGES: dict[str, Callable[[], Image.Image]] = {
    "rgb-wide": lambda: _rgb(50, 70),
    "rgb-tall": lambda: _rgb(91, 40, seed=1),
    "rgb-odd": lambda: _rgb(31, 33, seed=2),
    "rgb-square-large": lambda: _rgb(400, 400, seed=3),
    "rgb-tiny": lambda: _rgb(7, 5, seed=4),
    "rgb-one-pixel": lambda: _rgb(1, 1, seed=9),
    "rgb-thin": lambda: _rgb(3, 100, seed=10),
    "rgba": lambda: Image.fromarray(_pixels((40, 60, 4), 11), "RGBA"),
    "L": lambda: Image.fromarray(_pixels((40, 60), 12), "L"),
    "LA": lambda: Image.fromarray(_pixels((40, 60, 2), 13), "LA"),
    "P": lambda: _palette(transparent=False),
    "P-transparent": lambda: _palette(transparent=True),
    "I;16": lambda: Image.fromarray(_pixels((40, 60), 14, high=1 << 16, dtype=np.uint16)),
    "1": lambda: Image.fromarray(_pixels((40, 60), 15, high=2, dtype=bool)),
    "CMYK-jpeg": _cmyk_jpeg,
    "RGB-tRNS": _rgb_with_trns,
}


@pytest.mark.parametrize("config_name, image_name", [
    (config, image) for config in CONFIGS for image in IMAGES
    if config not in RGB_ONLY or IMAGES[image]().mode == "RGB"])
def test_pixel_values_equal_transformers(config_name: str, image_name: str):
    """Every config x every size and mode: the same float32 [3, H, W] as transformers'."""
    config = CONFIGS[config_name]
    expected = hf_processor(config)(IMAGES[image_name](), return_tensors="np")["pixel_values"]
    processor = ImageProcessor.from_hf(config)
    got = processor(IMAGES[image_name]())
    assert got.dtype == np.float32 and got.shape == (3, *processor.output_size)
    assert expected.shape == (1, *got.shape)
    np.testing.assert_array_equal(got, expected[0].astype(np.float32))


@pytest.mark.parametrize("config_name", ["clip-small", "siglip-small"])
def test_batch_stacks_images(config_name: str):
    """`batch` is [N, 3, H, W], each row the single image's values (and [0, 3, H, W] empty)."""
    config = CONFIGS[config_name]
    images = [_rgb(50, 70), _palette(True), Image.fromarray(_pixels((9, 40), 3), "L")]
    processor = ImageProcessor.from_hf(config)
    got = processor.batch(images)
    expected = hf_processor(config)(images, return_tensors="np")["pixel_values"]
    assert got.shape == (3, 3, *processor.output_size) and got.dtype == np.float32
    np.testing.assert_array_equal(got, expected)
    assert processor.batch([]).shape == (0, 3, *processor.output_size)


def test_kosmos2_square_size():
    """CLIP's `use_square_size` (Kosmos-2) resizes to the class default's square, as in
    transformers."""
    config = {"image_processor_type": "CLIPImageProcessor", "use_square_size": True,
              "size": 32, "crop_size": 224, "do_center_crop": True}
    processor = ImageProcessor.from_hf(config)
    assert processor.resize_to == (224, 224)
    expected = hf_processor(config)(_rgb(50, 70), return_tensors="np")["pixel_values"][0]
    np.testing.assert_array_equal(processor(_rgb(50, 70)), expected)


def test_null_keys_are_none_as_in_transformers():
    """A null key is None in transformers, not the class default: a null flag is off (here:
    no normalizing; no RGB conversion, so an RGB PNG's tRNS colour is not made white), a
    null value that a step needs is refused, as transformers refuses it."""
    processor = ImageProcessor.from_hf(CONFIGS["clip-legacy-int-sizes"])
    assert processor.image_mean is None and processor.rescale_factor == 1 / 255
    assert not ImageProcessor.from_hf(CONFIGS["siglip-no-convert"]).do_convert_rgb
    base = {"image_processor_type": "SiglipImageProcessor"}
    for key in ("resample", "size", "rescale_factor", "image_std"):
        with pytest.raises(UnsupportedModelError, match=f"{key} is null"):
            ImageProcessor.from_hf({**base, key: None})
        with pytest.raises(ValueError):
            hf_processor({**base, key: None})(_rgb(8, 8))


def test_defaults_are_transformers_class_defaults():
    """Keys left out take transformers' defaults for the class."""
    siglip = ImageProcessor.from_hf({"image_processor_type": "SiglipImageProcessor"})
    assert siglip.output_size == (224, 224) and siglip.resample == 3
    assert siglip.crop_size is None and siglip.image_mean == (0.5, 0.5, 0.5)
    assert siglip.rescale_factor == 1 / 255 and siglip.do_convert_rgb
    clip = ImageProcessor.from_hf({"image_processor_type": "CLIPImageProcessorFast"})
    assert clip.processor_type == "CLIPImageProcessor"
    assert clip.shortest_edge == 224 and clip.crop_size == (224, 224)
    assert clip.image_std == tuple(CLIP_STD)
    assert clip.resized_size(width=300, height=200) == (224, 336)
    assert clip.resized_size(width=101, height=300) == (665, 224)  # int(224*300/101) = 665


@pytest.mark.parametrize("config, match", [
    ({"image_processor_type": "Qwen2VLImageProcessor"}, "Qwen2VLImageProcessor"),
    ({}, "not supported"),
    ({"image_processor_type": "CLIPImageProcessor", "do_center_crop": False},
     "depend on each image"),
    ({"image_processor_type": "CLIPImageProcessor",
      "size": {"shortest_edge": 224, "longest_edge": 448}}, "longest_edge"),
    ({"image_processor_type": "SiglipImageProcessor", "do_pad": True}, "do_pad"),
    ({"image_processor_type": "SiglipImageProcessor", "resample": 9}, "resample"),
    ({"image_processor_type": "SiglipImageProcessor", "image_mean": [0.5, 0.5]},
     "image_mean"),
    ({"image_processor_type": "CLIPImageProcessor", "crop_size": {"height": 0, "width": 3}},
     "crop_size.height"),
])
def test_unsupported_configs(config: dict, match: str):
    """What the server does not implement is refused when the model loads."""
    with pytest.raises(UnsupportedModelError, match=match):
        ImageProcessor.from_hf(config)


def test_extreme_aspect_ratio_refused():
    """Resizing by the shortest edge, an image over 200:1 is refused before it is resized (a
    1 x N image would be resized to edge x edge*N); 200:1 itself is processed."""
    processor = ImageProcessor.from_hf(CONFIGS["clip-small"])
    with pytest.raises(InvalidParameterError, match="aspect ratio"):
        processor(_rgb(1, 201))
    assert processor(_rgb(1, 200)).shape == (3, 30, 30)
    siglip = ImageProcessor.from_hf(CONFIGS["siglip-small"])  # a fixed-size resize: no limit
    assert siglip(_rgb(1, 201)).shape == (3, 28, 28)


# ---------------------------------------------------------------------------- decoding


def _encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


@pytest.mark.parametrize("fmt, kwargs", [
    ("PNG", {}), ("WEBP", {"lossless": True}), ("GIF", {}), ("JPEG", {"quality": 95})])
def test_decode_round_trip(fmt: str, kwargs: dict):
    """PNG, lossless WebP and GIF decode to the pixels saved; JPEG to nearly them."""
    y, x = np.mgrid[0:24, 0:36]
    smooth = np.stack([x * 7, y * 10, (x + y) * 4], axis=-1).astype(np.uint8)
    source = Image.fromarray(smooth)
    if fmt == "GIF":
        source = source.quantize(64).convert("RGB")
    image = decode_image(_encode(source, fmt, **kwargs))
    assert image.size == (36, 24) and image.format == fmt
    got = np.asarray(image.convert("RGB"), dtype=np.int16)
    want = np.asarray(source, dtype=np.int16)
    if fmt == "JPEG":  # lossy
        assert np.abs(got - want).mean() < 3
    else:
        np.testing.assert_array_equal(got, want)


def test_decode_keeps_mode():
    """The decoded image keeps its mode (RGBA, LA, P): the processor composites alpha."""
    assert decode_image(_encode(Image.fromarray(_pixels((5, 6, 4), 1), "RGBA"), "PNG")).mode \
        == "RGBA"
    assert decode_image(_encode(Image.fromarray(_pixels((5, 6, 2), 1), "LA"), "PNG")).mode \
        == "LA"
    assert decode_image(_encode(_palette(True), "PNG")).mode == "P"


def test_animated_gif_gives_first_frame():
    red = Image.new("RGB", (8, 6), (255, 0, 0))
    blue = Image.new("RGB", (8, 6), (0, 0, 255))
    data = _encode(red, "GIF", save_all=True, append_images=[blue], duration=50, loop=0)
    assert Image.open(io.BytesIO(data)).n_frames == 2
    image = decode_image(data)
    assert image.convert("RGB").getpixel((3, 3)) == (255, 0, 0)


def test_exif_orientation_applied():
    """A JPEG whose EXIF says "rotate 90" comes out upright, as transformers' load_image
    makes it."""
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 CW to display
    data = _encode(_rgb(10, 30), "JPEG", exif=exif.tobytes())
    assert decode_image(data).size == (10, 30)


@pytest.mark.parametrize("data", [
    b"", b"not an image at all", b"\x89PNG\r\n\x1a\n" + b"\x00" * 40,
    b"GIF89a" + b"\xff" * 20])
def test_corrupt_bytes_refused(data: bytes):
    with pytest.raises(InvalidParameterError, match="could not be"):
        decode_image(data)


@pytest.mark.parametrize("fmt", ["BMP", "TIFF", "PPM", "ICO"])
def test_other_formats_refused(fmt: str):
    data = _encode(_rgb(16, 16), fmt)
    with pytest.raises(InvalidParameterError, match="no PNG, JPEG, WebP or GIF"):
        decode_image(data)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP"])
def test_truncated_file_refused(fmt: str):
    """The header reads fine; the pixels stop short: an error when decoding, not a partial
    image."""
    data = _encode(_rgb(64, 64), fmt)
    with pytest.raises(InvalidParameterError):
        decode_image(data[: len(data) // 2])


def _png_claiming(width: int, height: int) -> bytes:
    """A 1x1 PNG whose IHDR (CRC fixed up) claims `width` x `height`."""
    data = bytearray(_encode(Image.new("RGB", (1, 1)), "PNG"))
    assert data[12:16] == b"IHDR"
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def test_too_many_pixels_refused_from_the_header():
    """The header's size is checked before decoding: a file claiming 9000 x 9000 pixels is
    refused at once (decoding would fail on the missing data, with another message), and
    one claiming 100000 x 100000 (30 GB decoded) by Pillow's decompression-bomb limit even
    without a limit of ours."""
    with pytest.raises(InvalidParameterError,
                       match=r"9000x9000 = 81000000 pixels, more than the 1000 pixels allowed"):
        decode_image(_png_claiming(9000, 9000), max_pixels=1000)
    with pytest.raises(InvalidParameterError, match="too many pixels"):
        decode_image(_png_claiming(100_000, 100_000))
    with pytest.raises(InvalidParameterError, match="truncated or corrupt"):
        decode_image(_png_claiming(30, 30), max_pixels=1000)


def test_max_pixels_on_a_real_image():
    """A real 5000 x 5000 image (which compresses small) is refused with max_pixels=1000 and
    accepted at exactly its size."""
    data = _encode(Image.new("L", (50, 40)), "PNG")
    with pytest.raises(InvalidParameterError, match="50x40 = 2000 pixels"):
        decode_image(data, max_pixels=1999)
    assert decode_image(data, max_pixels=2000).size == (50, 40)
    big = _encode(Image.new("L", (5000, 5000)), "PNG")
    assert len(big) < 100_000
    with pytest.raises(InvalidParameterError, match="25000000 pixels"):
        decode_image(big, max_pixels=1000)
