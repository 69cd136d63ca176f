"""Decoding image files and turning images into a vision tower's `pixel_values`.

`decode_image` opens the bytes a client sent (PNG, JPEG, WebP, GIF) with Pillow, checking the
size in the header before any pixel is decoded. `ImageProcessor` is the preprocessing of a
Hugging Face `preprocessor_config.json` (CLIP's and SigLIP's image processors): it gives the
same float32 `[3, H, W]` arrays, bit for bit, as transformers' PIL backend
(`CLIPImageProcessorPil`, `SiglipImageProcessorPil`; in transformers 5 `CLIPImageProcessor`
is the torchvision backend, whose bicubic resize differs from Pillow's in the last digits, and
it falls back to the PIL backend when torchvision is absent). What transformers does there,
step by step, and what is reproduced here:

1. RGB conversion (`image_transforms.convert_to_rgb`): an image with an alpha band (`"A"` in
   its bands: RGBA, LA, PA) or a `transparency` entry in its info (a palette image's
   transparent index, an RGB/L PNG's tRNS colour) is converted to RGBA and composited onto
   opaque white; every other mode is `image.convert("RGB")` (Pillow's own conversions: CMYK,
   YCbCr, I;16, 1 ...).
2. Resize with Pillow, from the uint8 RGB image (`image.resize((w, h), resample)`), to
   `{"height", "width"}` as given, or so that the shorter side is `shortest_edge` and the
   longer `int(shortest_edge * long / short)` (truncated, never rounded;
   `get_resize_output_image_size`); an image whose shorter side already has that length is
   resized to the same size, which Pillow answers with a copy.
3. Center crop to `crop_size`: the box starts at `(size - crop) // 2`; an image smaller than
   the crop is first padded with zeros (black, before rescaling), `ceil(pad / 2)` before.
4. Rescale: the uint8 values in float64 times `rescale_factor`, then cast to float32.
5. Normalize in float32: `(x - float32(mean)) / float32(std)` per channel.
"""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from metrale_jax.errors import InvalidParameterError, UnsupportedModelError

# The container formats a client may send (Pillow's format names). MPO is what Pillow calls
# a JPEG with extra frames (most phone cameras write one); its first frame is the JPEG.
_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
_OPENED_FORMATS = {*_FORMATS, "MPO"}

# transformers' constants (image_utils.py).
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_STANDARD_MEAN = (0.5, 0.5, 0.5)
IMAGENET_STANDARD_STD = (0.5, 0.5, 0.5)

# Each processor's class defaults in transformers 5 (models/clip/image_processing_clip.py,
# models/siglip/image_processing_siglip.py and BaseImageProcessor): what a config key that is
# absent takes. A key that is present and null stays None in transformers (its
# `ImageProcessingMixin.__init__` sets every key before `_set_attributes` looks for defaults):
# a null flag is off, a null size, filter or mean where one is needed an error.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "clip": {
        "do_resize": True, "size": {"shortest_edge": 224}, "resample": 3,  # bicubic
        "do_center_crop": True, "crop_size": {"height": 224, "width": 224},
        "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": OPENAI_CLIP_MEAN, "image_std": OPENAI_CLIP_STD,
        "do_convert_rgb": True, "default_to_square": False,
    },
    "siglip": {
        "do_resize": True, "size": {"height": 224, "width": 224}, "resample": 3,  # bicubic
        "do_center_crop": False, "crop_size": None,
        "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": IMAGENET_STANDARD_MEAN,
        "image_std": IMAGENET_STANDARD_STD,
        "do_convert_rgb": True, "default_to_square": False,
    },
}
_CANONICAL_NAME = {"clip": "CLIPImageProcessor", "siglip": "SiglipImageProcessor"}
_TYPES = {
    **{f"CLIPImageProcessor{s}": "clip" for s in ("", "Fast", "Pil")},
    **{f"SiglipImageProcessor{s}": "siglip" for s in ("", "Fast", "Pil")},
}
_LEGACY_TYPES = {"CLIPFeatureExtractor": "clip", "SiglipFeatureExtractor": "siglip"}


def decode_image(data: bytes, *, max_pixels: int | None = None) -> Image.Image:
    """Opens an image file sent by a client and decodes its pixels.

    Args:
        data: the file's bytes: PNG, JPEG, WebP or GIF (an animated GIF or WebP gives its
            first frame).
        max_pixels: the most pixels (width * height) allowed. The size is read from the
            file's header and checked before any pixel is decoded; None leaves only Pillow's
            own decompression-bomb limit (`Image.MAX_IMAGE_PIXELS` * 2).

    Returns:
        The loaded image in its own mode (RGB, RGBA, L, LA, P, CMYK, I;16 ...), turned upright
        by its EXIF orientation tag as transformers' `load_image` does; `ImageProcessor` makes
        it RGB.

    Raises:
        InvalidParameterError: the bytes are no image of those formats, are corrupt or
            truncated, or the image has more than `max_pixels` pixels.
    """
    try:
        image = Image.open(io.BytesIO(data), formats=_FORMATS)
    except Image.DecompressionBombError as e:  # over twice Image.MAX_IMAGE_PIXELS
        limit = "" if max_pixels is None else f" (at most {max_pixels} pixels are allowed)"
        raise InvalidParameterError(f"the image has too many pixels{limit}: {e}") from e
    except Exception as e:  # Pillow's parsers raise many types on hostile input
        raise InvalidParameterError(
            "the image could not be read: it is no PNG, JPEG, WebP or GIF file, or it is "
            f"corrupt ({type(e).__name__}: {e})") from e
    if image.format not in _OPENED_FORMATS:  # pragma: no cover - `formats` already limits it
        raise InvalidParameterError(f"unsupported image format {image.format}: only PNG, "
                                    "JPEG, WebP and GIF are accepted")
    width, height = image.size
    if max_pixels is not None and width * height > max_pixels:
        raise InvalidParameterError(
            f"the image is {width}x{height} = {width * height} pixels, more than the "
            f"{max_pixels} pixels allowed")
    try:
        image.load()  # the first frame only
    except Exception as e:  # truncated or corrupt pixel data
        raise InvalidParameterError(
            f"the {image.format} image could not be decoded: it is truncated or corrupt "
            f"({type(e).__name__}: {e})") from e
    with contextlib.suppress(Exception):  # a malformed EXIF block: keep the pixels as stored
        ImageOps.exif_transpose(image, in_place=True)
    return image


def convert_to_rgb(image: Image.Image) -> Image.Image:
    """The image as RGB, as transformers' `convert_to_rgb` makes it: transparency (an alpha
    band or a `transparency` info entry) is composited onto opaque white; any other mode goes
    through Pillow's `convert("RGB")`."""
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if not has_alpha:
        return image if image.mode == "RGB" else image.convert("RGB")
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def _size_dict(size: Any, *, default_to_square: bool, param: str) -> dict[str, int]:
    """A `size`/`crop_size` entry of a config in transformers' dict form (`get_size_dict`): an
    int is a square when `default_to_square` else a shortest edge, a pair is (height, width)."""
    if isinstance(size, Mapping):
        return dict(size)
    if isinstance(size, int) and not isinstance(size, bool):
        return ({"height": size, "width": size} if default_to_square
                else {"shortest_edge": size})
    if isinstance(size, list | tuple) and len(size) == 2:
        return {"height": size[0], "width": size[1]}
    raise UnsupportedModelError(f"preprocessor_config.json: {param} {size!r} is not a size")


def _three(value: Any, name: str) -> tuple[float, float, float]:
    """A per-channel mean or std: a number stands for all three channels."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return (float(value),) * 3
    if isinstance(value, list | tuple) and len(value) == 3:
        return float(value[0]), float(value[1]), float(value[2])
    raise UnsupportedModelError(
        f"preprocessor_config.json: {name} must be a number or 3 numbers (RGB), got {value!r}")


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UnsupportedModelError(
            f"preprocessor_config.json: {name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class ImageProcessor:
    """The preprocessing of one vision tower: a decoded image in, `pixel_values` out.

    Build it with `from_hf` from the checkpoint's `preprocessor_config.json`. The output size
    is fixed (the crop, or a `{"height", "width"}` resize): the engine's programs have one
    image shape per model, so a config whose output would follow each image's aspect ratio
    is refused.

    Attributes:
        processor_type: transformers' class name, "CLIPImageProcessor" or
            "SiglipImageProcessor".
        do_resize: whether to resize before cropping.
        shortest_edge: resize keeping the aspect ratio so that the shorter side has this
            length (None: resize to `resize_to`).
        resize_to: (height, width) to resize to, ignoring the aspect ratio (None: resize by
            `shortest_edge`).
        resample: Pillow's resampling filter code (0 nearest, 2 bilinear, 3 bicubic, 1
            Lanczos, 4 box, 5 Hamming).
        crop_size: (height, width) of the center crop, or None for no crop.
        rescale_factor: what the uint8 values are multiplied by, or None for no rescale.
        image_mean, image_std: per-channel (R, G, B) normalization, or None for none.
        do_convert_rgb: transformers' flag. Off, an RGB image is used as it is (a PNG's
            tRNS colour is not composited), as in transformers; an image of another mode is
            still converted, where transformers would process the raw array of its mode
            (failing on anything but 3 channels, misreading YCbCr or palette indices).
    """

    processor_type: str
    do_resize: bool
    shortest_edge: int | None
    resize_to: tuple[int, int] | None
    resample: int
    crop_size: tuple[int, int] | None
    rescale_factor: float | None
    image_mean: tuple[float, float, float] | None
    image_std: tuple[float, float, float] | None
    do_convert_rgb: bool = True

    # The longest side over the shortest beyond which an image is refused when resizing by the
    # shortest edge: the full resized image exists before its crop, and a 1 x 16M-pixel image
    # would make one of 336 x 5.6G pixels (Qwen2-VL refuses beyond the same ratio).
    MAX_ASPECT_RATIO = 200

    def __post_init__(self):
        if self.do_resize and (self.shortest_edge is None) == (self.resize_to is None):
            raise ValueError("resizing needs exactly one of shortest_edge and resize_to")
        if self.resample not in range(6):
            raise UnsupportedModelError(
                f"preprocessor_config.json: resample {self.resample!r} is no Pillow filter "
                "(0 to 5)")
        if (self.image_mean is None) != (self.image_std is None):
            raise ValueError("normalizing needs both image_mean and image_std")
        if self.crop_size is None and not (self.do_resize and self.resize_to is not None):
            raise UnsupportedModelError(
                f"{self.processor_type}: the output size would depend on each image (no "
                "center crop and no fixed-size resize), which this server does not support")

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> ImageProcessor:
        """The processor a Hugging Face `preprocessor_config.json` (as a dict) describes.

        Reads `image_processor_type` ("CLIPImageProcessor" or "SiglipImageProcessor", also
        with a "Fast" or "Pil" suffix, or a legacy `feature_extractor_type`
        "CLIPFeatureExtractor") and the keys do_resize, size ({"shortest_edge"},
        {"height", "width"}, or an int / pair in the legacy form), resample, do_center_crop,
        crop_size, do_rescale, rescale_factor, do_normalize, image_mean, image_std,
        do_convert_rgb, default_to_square (and CLIP's `use_square_size`); a key that is absent
        takes transformers' default for that class, and one that is null is None, as in
        transformers (a flag off; a size, filter, factor or mean that a step needs is
        refused). Other keys are ignored.

        Raises:
            UnsupportedModelError: another processor type, a size of another form (e.g.
                {"shortest_edge", "longest_edge"}), padding, or an output size that would
                vary per image.
        """
        name = config.get("image_processor_type")
        if name is None:
            kind = _LEGACY_TYPES.get(config.get("feature_extractor_type") or "")
        else:
            kind = _TYPES.get(name)
        if kind is None:
            shown = name if name is not None else config.get("feature_extractor_type")
            raise UnsupportedModelError(
                f"preprocessor_config.json: image processor {shown!r} is not supported (only "
                "CLIPImageProcessor and SiglipImageProcessor)")
        defaults = _DEFAULTS[kind]

        def get(key: str) -> Any:
            return config[key] if key in config else defaults[key]

        def need(key: str, why: str) -> Any:
            if (value := get(key)) is None:
                raise UnsupportedModelError(f"preprocessor_config.json: {key} is null while "
                                            f"{why} is set")
            return value

        if config.get("do_pad"):
            raise UnsupportedModelError(
                "preprocessor_config.json: do_pad is not supported by this server")
        default_to_square = bool(get("default_to_square"))
        size = get("size")
        if kind == "clip" and config.get("use_square_size"):  # Kosmos-2: the class default
            edge = defaults["size"]["shortest_edge"]
            size = {"height": edge, "width": edge}
        do_resize = bool(get("do_resize"))
        shortest_edge = resize_to = None
        resample = 2  # unused without resizing (transformers' fallback: bilinear)
        if do_resize:
            resample = need("resample", "do_resize")
            if isinstance(resample, bool) or not isinstance(resample, int):
                raise UnsupportedModelError(
                    f"preprocessor_config.json: resample {resample!r} is no Pillow filter code")
            if size is None:
                need("size", "do_resize")
            size = _size_dict(size, default_to_square=default_to_square, param="size")
            if set(size) == {"shortest_edge"}:
                shortest_edge = _positive_int(size["shortest_edge"], "size.shortest_edge")
            elif set(size) == {"height", "width"}:
                resize_to = (_positive_int(size["height"], "size.height"),
                             _positive_int(size["width"], "size.width"))
            else:
                raise UnsupportedModelError(
                    f"preprocessor_config.json: size {size!r} is not supported (only "
                    "{'shortest_edge'} or {'height', 'width'})")
        crop_size = None
        if get("do_center_crop"):
            crop = _size_dict(need("crop_size", "do_center_crop"), default_to_square=True,
                              param="crop_size")
            if set(crop) != {"height", "width"}:
                raise UnsupportedModelError(
                    f"preprocessor_config.json: crop_size {crop!r} needs height and width")
            crop_size = (_positive_int(crop["height"], "crop_size.height"),
                         _positive_int(crop["width"], "crop_size.width"))
        rescale_factor = None
        if get("do_rescale"):
            factor = need("rescale_factor", "do_rescale")
            if isinstance(factor, bool) or not isinstance(factor, int | float):
                raise UnsupportedModelError(
                    f"preprocessor_config.json: rescale_factor {factor!r} is no number")
            rescale_factor = float(factor)
        mean = std = None
        if get("do_normalize"):
            mean = _three(need("image_mean", "do_normalize"), "image_mean")
            std = _three(need("image_std", "do_normalize"), "image_std")
        return cls(processor_type=_CANONICAL_NAME[kind], do_resize=do_resize,
                   shortest_edge=shortest_edge, resize_to=resize_to, resample=resample,
                   crop_size=crop_size, rescale_factor=rescale_factor, image_mean=mean,
                   image_std=std, do_convert_rgb=bool(get("do_convert_rgb")))

    @property
    def output_size(self) -> tuple[int, int]:
        """(H, W) of every array this processor returns."""
        if self.crop_size is not None:
            return self.crop_size
        assert self.resize_to is not None  # __post_init__ guarantees one of them
        return self.resize_to

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(H, W) of an image of `width` x `height` after the resize step (before the crop),
        with transformers' truncation: the longer side is `int(edge * long / short)`."""
        if not self.do_resize:
            return height, width
        if self.resize_to is not None:
            return self.resize_to
        assert self.shortest_edge is not None
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)

    def __call__(self, image: Image.Image) -> np.ndarray:
        """`pixel_values` of one image: float32 `[3, H, W]`, `(H, W) == output_size`.

        Raises:
            InvalidParameterError: resizing by the shortest edge, the image's sides differ by
                more than `MAX_ASPECT_RATIO` times.
        """
        width, height = image.size
        if self.do_resize and self.shortest_edge is not None and (
                max(width, height) > self.MAX_ASPECT_RATIO * min(width, height)):
            raise InvalidParameterError(
                f"the image is {width}x{height}: its aspect ratio is beyond "
                f"{self.MAX_ASPECT_RATIO}:1")
        # transformers leaves an RGB image as it is when do_convert_rgb is off (a tRNS colour
        # stays opaque); any other mode is converted regardless (see the class docstring)
        rgb = image if image.mode == "RGB" and not self.do_convert_rgb else convert_to_rgb(image)
        if self.do_resize:
            out_h, out_w = self.resized_size(width, height)
            rgb = rgb.resize((out_w, out_h), resample=self.resample)
        pixels = np.asarray(rgb)  # [H, W, 3] uint8
        if self.crop_size is not None:
            pixels = _center_crop(pixels, self.crop_size)
        values = pixels
        if self.rescale_factor is not None:
            values = (values.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.image_mean is not None:
            values = values.astype(np.float32, copy=False)
            mean = np.asarray(self.image_mean, dtype=np.float32)
            std = np.asarray(self.image_std, dtype=np.float32)
            values = (values - mean) / std
        return np.ascontiguousarray(values.transpose(2, 0, 1), dtype=np.float32)

    def batch(self, images: Iterable[Image.Image]) -> np.ndarray:
        """`pixel_values` of several images: float32 `[N, 3, H, W]` (N may be 0)."""
        arrays = [self(image) for image in images]
        if not arrays:
            return np.zeros((0, 3, *self.output_size), np.float32)
        return np.stack(arrays)


def _center_crop(pixels: np.ndarray, size: Sequence[int]) -> np.ndarray:
    """transformers' `center_crop` of an `[H, W, C]` array to `size` (height, width): the box
    starts at `(side - crop) // 2`; where the image is smaller it is padded with zeros first,
    `ceil(pad / 2)` of them before."""
    orig_h, orig_w = pixels.shape[:2]
    crop_h, crop_w = int(size[0]), int(size[1])
    top, left = (orig_h - crop_h) // 2, (orig_w - crop_w) // 2
    bottom, right = top + crop_h, left + crop_w
    if top >= 0 and bottom <= orig_h and left >= 0 and right <= orig_w:
        return pixels[top:bottom, left:right]
    new_h, new_w = max(crop_h, orig_h), max(crop_w, orig_w)
    padded = np.zeros((new_h, new_w, *pixels.shape[2:]), dtype=pixels.dtype)
    top_pad, left_pad = math.ceil((new_h - orig_h) / 2), math.ceil((new_w - orig_w) / 2)
    padded[top_pad:top_pad + orig_h, left_pad:left_pad + orig_w] = pixels
    top, bottom, left, right = top + top_pad, bottom + top_pad, left + left_pad, right + left_pad
    return padded[max(0, top):min(new_h, bottom), max(0, left):min(new_w, right)]
