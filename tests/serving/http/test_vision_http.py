"""A vision-language model (a tiny random LLaVA with a CLIP tower, devtools/llava_models.py)
behind the OpenAI API.

One real server on a loopback port, started with small image limits and 127.0.0.1 among its
allowed media domains; images come as data: URLs and from a loopback `ThreadingHTTPServer`.
With the official `openai` client and plain HTTP: the prompt ids (returned with
`return_token_ids`) are the chat template's, rendered here with jinja2 and each `<image>`
expanded to its 16 tokens; the greedy tokens and their log-probabilities equal transformers'
`LlavaForConditionalGeneration` on transformers' own pixel values; usage counts the image
tokens; a repeated image is served from the prefix cache and another one is not. Every bad
image is a 400 in OpenAI's shape naming its content part, and the server answers the next
request.
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import io
import socket
import threading

import jinja2
import numpy as np
import pytest
import torch
from PIL import Image

from tests.serving.conftest import get_json, post, run_main, sse_events, wait_healthy

pytestmark = pytest.mark.xdist_group("vision_http")

NAME = "llava-tiny"
MAX_IMAGES = 3
MAX_BYTES = 48 * 1024
MAX_PIXELS = 200 * 200
FETCH_TIMEOUT = 2.0
STEPS = 5
IMAGE_TOKENS = 16  # the tiny CLIP tower's: (28 / 7)^2 patches
PS = 16  # the engine's page size
SYSTEM = "You look at pictures closely."


def _png(seed: int | None, size: tuple[int, int] = (30, 40), fmt: str = "PNG") -> bytes:
    """Random pixels of `size` (width, height); seed None: one grey (a small file)."""
    if seed is None:
        image = Image.new("RGB", size, (128, 128, 128))
    else:
        image = Image.fromarray(np.random.default_rng(seed).integers(
            0, 256, (size[1], size[0], 3), np.uint8))
    buf = io.BytesIO()
    image.save(buf, fmt)
    return buf.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


RED, BLUE = _png(1), _png(2)


class _ImageHost:
    """A loopback HTTP server of images: /red.png, /blue.png, /missing (404), /slow.png
    (answers nothing until `release` is set) and /redirect (to localhost, not allowed)."""

    def __init__(self):
        self.hits: dict[str, int] = {}
        self.release = threading.Event()
        host = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                host.hits[self.path] = host.hits.get(self.path, 0) + 1
                if self.path == "/slow.png":
                    host.release.wait(60)
                    return
                if self.path == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", f"http://localhost:{host.port}/red.png")
                    self.end_headers()
                    return
                body = {"/red.png": RED, "/blue.png": BLUE}.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

            def handle(self):
                with contextlib.suppress(OSError):  # the client gave up (the slow image)
                    super().handle()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def images():
    host = _ImageHost()
    yield host
    host.close()


def _start(folder, **overrides):
    from serving.http.server import ServerThread
    from serving.http.settings import ServerSettings
    settings = ServerSettings(**{**dict(
        model=str(folder), served_model_name=NAME, port=0, max_slots=4, max_len=256,
        engine_options={"max_prefill_len": 64, "max_images": MAX_IMAGES,
                        "prefix_cache_min_tokens": PS},
        allowed_media_domains=("127.0.0.1",), max_image_bytes=MAX_BYTES,
        max_image_pixels=MAX_PIXELS, media_fetch_timeout=FETCH_TIMEOUT,
        request_timeout=120.0, grace_period=5.0, warmup=False), **overrides})
    srv = ServerThread(settings).start()
    assert srv.wait_ready(timeout=600), "the server did not become ready"
    wait_healthy(srv.url)
    return srv


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(the server, the transformers model, the model folder)."""
    from devtools.llava_models import build_llava_folder
    folder = tmp_path_factory.mktemp("llava-http")
    hf = build_llava_folder(folder, "clip")
    srv = _start(folder)
    yield srv, hf, folder
    srv.stop()


@pytest.fixture(scope="module")
def url(vlm) -> str:
    return vlm[0].url


@pytest.fixture(scope="module")
def client(url):
    import openai
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def image_id(vlm) -> int:
    import transformers

    from devtools.llava_models import IMAGE_TOKEN
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(vlm[2])
    return tok.convert_tokens_to_ids(IMAGE_TOKEN)


@pytest.fixture(scope="module")
def expected_ids(vlm, image_id):
    """The prompt ids of `messages`, built apart from the server: the folder's chat template
    rendered with jinja2 (each image part as `{"type": "image"}`), the transformers tokenizer,
    each `<image>` repeated 16 times (as transformers' `LlavaProcessor` does)."""
    import transformers

    from devtools.llava_models import CHAT_TEMPLATE
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(vlm[2])
    template = jinja2.Environment().from_string(CHAT_TEMPLATE)

    def ids(messages: list[dict]) -> list[int]:
        shown = [{**m, "content": [p if p["type"] == "text" else {"type": "image"}
                                   for p in m["content"]]}
                 if isinstance(m["content"], list) else m for m in messages]
        text = template.render(messages=shown, add_generation_prompt=True)
        out = []
        for t in tok.encode(text, add_special_tokens=False):
            out += [t] * IMAGE_TOKENS if t == image_id else [t]
        return out
    return ids


def _reference(hf, ids: list[int], pngs: list[bytes]) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens, and the log-softmax at each step, with pixel values from
    transformers' CLIP image processor (its PIL backend)."""
    from transformers import CLIPImageProcessorPil

    from devtools.llava_models import TOWERS
    cfg = {k: v for k, v in TOWERS["clip"]["processor"].items() if k != "image_processor_type"}
    pixels = CLIPImageProcessorPil(**cfg)(
        images=[Image.open(io.BytesIO(p)) for p in pngs], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), pixel_values=pixels,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=STEPS, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, torch.log_softmax(torch.stack(out.logits)[:, 0].float(), -1).numpy()


def _chat(client, messages: list[dict], **kw):
    return client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=STEPS, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True}, **kw)


def _check_against_transformers(out, hf, ids: list[int], pngs: list[bytes]) -> None:
    want, ref = _reference(hf, ids, pngs)
    choice = out.choices[0]
    assert out.prompt_token_ids == ids
    assert out.usage.prompt_tokens == len(ids)
    assert choice.token_ids == want
    assert len(choice.logprobs.content) == STEPS
    for step, entry in enumerate(choice.logprobs.content):
        theirs = ref[step]
        assert entry.logprob == pytest.approx(float(theirs[want[step]]), rel=1e-4, abs=1e-5)
        ours_top = sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        their_top = np.sort(theirs)[::-1][:len(ours_top)]
        np.testing.assert_allclose(ours_top, their_top, rtol=1e-4, atol=1e-5)


def test_a_data_url_image_gives_transformers_tokens(client, vlm, expected_ids, image_id,
                                                     schemas):
    _, hf, _ = vlm
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": [_text("What is in the picture?"),
                                             _image(_data_url(RED))]}]
    out = _chat(client, messages, logprobs=True, top_logprobs=3)
    schemas.chat(out.model_dump(exclude_unset=True))
    ids = expected_ids(messages)
    assert ids.count(image_id) == IMAGE_TOKENS
    _check_against_transformers(out, hf, ids, [RED])  # prompt ids and usage too
    # Another image gives other log-probabilities: the pixels reach the model.
    other = _chat(client, [messages[0], {"role": "user", "content": [
        _text("What is in the picture?"), _image(_data_url(BLUE))]}],
        logprobs=True, top_logprobs=3)
    assert other.prompt_token_ids == ids
    assert other.choices[0].logprobs.content[0].logprob != \
        out.choices[0].logprobs.content[0].logprob


def test_two_images_in_one_message(client, vlm, expected_ids, schemas):
    _, hf, _ = vlm
    jpeg = _png(3, (50, 20), "JPEG")
    messages = [{"role": "user", "content": [
        _image(_data_url(RED)), _text("Compare this one with"),
        {"type": "image_url", "image_url": {"url": _data_url(jpeg, "image/jpeg"),
                                           "detail": "low"}},
        _text("Which is brighter?")]}]
    out = _chat(client, messages, logprobs=True, top_logprobs=2)
    schemas.chat(out.model_dump(exclude_unset=True))
    ids = expected_ids(messages)
    assert out.usage.prompt_tokens == len(ids) == \
        len(expected_ids([{"role": "user", "content": [
            _text("Compare this one with"), _text("Which is brighter?")]}])) \
        + 2 * (IMAGE_TOKENS + 1)  # each image: its tokens and the template's newline
    _check_against_transformers(out, hf, ids, [RED, jpeg])


def test_streaming_with_an_image_equals_the_whole_answer(client, url, schemas):
    messages = [{"role": "user", "content": [_image(_data_url(BLUE)), _text("Describe.")]}]
    whole = _chat(client, messages)
    events = sse_events(url, "/v1/chat/completions", {
        "model": NAME, "messages": messages, "max_tokens": STEPS, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for chunk in chunks:
        schemas.chat_chunk(chunk)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c["choices"])
    assert text == whole.choices[0].message.content
    assert chunks[-1]["usage"]["prompt_tokens"] == whole.usage.prompt_tokens


def test_constrained_output_and_n_work_with_images(client, schemas):
    messages = [{"role": "user", "content": [_image(_data_url(RED)), _text("Cat or dog?")]}]
    out = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=8, n=2, seed=3,
        response_format={"type": "json_schema", "json_schema": {
            "name": "animal", "schema": {"type": "string", "enum": ["cat", "dog"]}}})
    schemas.chat(out.model_dump(exclude_unset=True))
    assert [c.message.content for c in out.choices] in (
        [a, b] for a in ('"cat"', '"dog"') for b in ('"cat"', '"dog"'))


def test_a_remote_image_from_an_allowed_host(client, images, expected_ids):
    messages = [{"role": "user", "content": [_text("Look:"), _image(images.url("/red.png"))]}]
    hits = images.hits.get("/red.png", 0)
    remote = _chat(client, messages)
    inline = _chat(client, [{"role": "user", "content": [_text("Look:"),
                                                          _image(_data_url(RED))]}])
    assert images.hits["/red.png"] == hits + 1
    assert remote.prompt_token_ids == inline.prompt_token_ids == expected_ids(messages)
    assert remote.choices[0].token_ids == inline.choices[0].token_ids


def test_a_repeated_image_is_served_from_the_prefix_cache(client, expected_ids, image_id):
    system = {"role": "system", "content": "Name colours. " + SYSTEM}

    def turn(png: bytes) -> list[dict]:
        return [system, {"role": "user", "content": [_image(_data_url(png)),
                                                     _text("What colour dominates?")]}]

    first = _chat(client, turn(RED))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    ids = expected_ids(turn(RED))
    image_at = ids.index(image_id)
    assert image_at >= PS  # a full page of text before the image
    # A second turn repeating the image reads the first prompt's pages back, the image's too.
    second = [*turn(RED), {"role": "assistant", "content": first.choices[0].message.content},
              {"role": "user", "content": "And then?"}]
    again = _chat(client, second)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == _common_prefix(ids, expected_ids(second)) // PS * PS
    assert cached >= image_at + IMAGE_TOKENS
    # Another image at the same place shares only the pages of the text before it (its
    # placeholder ids are the same: the cache tells images apart by their content).
    other = _chat(client, turn(BLUE))
    assert expected_ids(turn(BLUE)) == ids
    assert other.usage.prompt_tokens_details.cached_tokens == image_at // PS * PS


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_models_card_and_tokenize(url, schemas, expected_ids):
    models = get_json(url, "/v1/models")
    schemas.validate("ListModelsResponse", models)
    card = models["data"][0]
    assert card["id"] == NAME and card["input_modalities"] == ["text", "image"]
    assert card["max_images"] == MAX_IMAGES
    messages = [{"role": "user", "content": [_text("Two:"), _image(_data_url(RED)),
                                             _image("http://elsewhere.invalid/x.png")]}]
    status, _, body = post(url, "/tokenize", {"model": NAME, "messages": messages})
    assert status == 200, body
    assert body["tokens"] == expected_ids(messages) and body["count"] == len(body["tokens"])


def _bad_cases(images) -> list[tuple[str, list[dict], str, str]]:
    """(name, content parts, the param, a piece of the message)."""
    big = "data:image/png;base64," + base64.b64encode(b"\0" * (MAX_BYTES + 10)).decode()
    ok = _image(_data_url(RED))
    return [
        ("corrupt image", [_text("x"), _image(_data_url(b"not an image at all"))],
         "messages[0].content[1]", "could not be read"),
        ("not an image type", [_image("data:text/plain;base64,aGVsbG8=")],
         "messages[0].content[0]", "text/plain"),
        ("unsupported format", [ok, _image(_data_url(_png(4, fmt="BMP"), "image/bmp"))],
         "messages[0].content[1]", "PNG, JPEG"),
        ("truncated image", [_image(_data_url(RED[:len(RED) // 2]))],
         "messages[0].content[0]", "truncated"),
        ("unsupported scheme", [_image("ftp://127.0.0.1/x.png")],
         "messages[0].content[0]", "unsupported image URL"),
        ("bad base64", [_image("data:image/png;base64,@@not-base64@@")],
         "messages[0].content[0]", "base64"),
        ("not base64", [_image("data:image/png,rawbytes")], "messages[0].content[0]",
         "base64"),
        ("too many bytes", [_image(big)], "messages[0].content[0]", str(MAX_BYTES)),
        ("too many pixels", [_image(_data_url(_png(None, (250, 250))))],
         "messages[0].content[0]", "pixels"),
        ("too many images", [ok, _text("a"), ok, ok, ok], "messages[0].content[4]",
         f"more than the {MAX_IMAGES}"),
        ("no url", [{"type": "image_url", "image_url": {}}], "messages[0].content[0]",
         "image_url.url"),
        ("host not allowed", [_image(images.url("/red.png", host="localhost"))],
         "messages[0].content[0]", "not among the allowed media domains"),
        ("redirect to a host not allowed", [_image(images.url("/redirect"))],
         "messages[0].content[0]", "not among the allowed media domains"),
        ("404", [ok, _image(images.url("/missing"))], "messages[0].content[1]", "404"),
        ("two bad images: the first named", [_image(images.url("/missing")),
                                              _image(_data_url(b"junk"))],
         "messages[0].content[0]", "404"),
        ("connection refused", [_image(_closed_port_url())], "messages[0].content[0]",
         "failed"),
        ("audio part", [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
         "messages[0].content[0]", "not supported"),
    ]


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/x.png"


def _assert_400(url: str, schemas, messages: list[dict], param: str, needle: str) -> dict:
    status, headers, body = post(url, "/v1/chat/completions", {
        "model": NAME, "messages": messages, "max_tokens": 2})
    assert status == 400, body
    schemas.error(body)
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == param, body
    assert needle in body["error"]["message"], body
    assert headers.get("x-request-id")
    return body


def test_every_bad_image_is_a_400_naming_its_part(url, client, images, schemas):
    red, redirect = images.hits.get("/red.png", 0), images.hits.get("/redirect", 0)
    for name, parts, param, needle in _bad_cases(images):
        param = param.replace("messages[0]", "messages[1]")  # after a system message
        body = _assert_400(url, schemas, [{"role": "system", "content": "s"},
                                          {"role": "user", "content": parts}], param, needle)
        assert param in body["error"]["message"] or name == "audio part", (name, body)
    assert images.hits.get("/red.png", 0) == red  # localhost: neither asked nor followed
    assert images.hits.get("/redirect", 0) == redirect + 1
    # The image token typed in the text is not an image.
    _assert_400(url, schemas, [{"role": "user", "content": "look: <image>"}], "messages",
                "placeholder")
    status, _, body = post(url, "/v1/completions", {"model": NAME, "prompt": "look: <image>",
                                                    "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "prompt", body
    schemas.error(body)
    out = _chat(client, [{"role": "user", "content": [_image(_data_url(RED)), _text("ok")]}])
    assert out.choices[0].finish_reason == "length"


def test_a_slow_image_times_out(url, client, images, schemas):
    _assert_400(url, schemas, [{"role": "user", "content": [_image(images.url("/slow.png"))]}],
                "messages[0].content[0]", "timed out")
    images.release.set()
    assert _chat(client, [{"role": "user", "content": "still there?"}]).usage.prompt_tokens


def test_remote_images_are_off_without_allowed_domains(vlm, images, schemas):
    """A second server on the same model, started without allowed media domains (a refused
    image never reaches the engine: nothing compiles)."""
    srv = _start(vlm[2], allowed_media_domains=())
    try:
        hits = images.hits.get("/blue.png", 0)
        _assert_400(srv.url, schemas,
                    [{"role": "user", "content": [_image(images.url("/blue.png"))]}],
                    "messages[0].content[0]", "remote image URLs are off")
        assert images.hits.get("/blue.png", 0) == hits
        status, _, body = post(srv.url, "/v1/chat/completions", {
            "model": NAME, "max_tokens": 2, "messages": [
                {"role": "user", "content": [_image(_data_url(BLUE)), _text("hi")]}]})
        assert status == 200, body  # data: URLs still are
    finally:
        srv.stop()


@pytest.mark.parametrize("args, needle", [
    (["--max-images", "0"], "--max-images must be >= 1"),
    (["--max-image-bytes", "0"], "--max-image-bytes must be >= 1"),
    (["--max-image-pixels", "-5"], "--max-image-pixels must be >= 1"),
    (["--media-fetch-timeout", "0"], "--media-fetch-timeout"),
    (["--media-fetch-timeout", "nan"], "--media-fetch-timeout"),
    (["--allowed-media-domains", "https://example.com"], "not a URL"),
    (["--allowed-media-domains", "example.com:8080"], "without a port"),
    (["--allowed-media-domains", "*.example.com"], "subdomains"),
    (["--allowed-media-domains", ","], "expected host names"),
    (["--allowed-media-domains", "a b"], "not a host name"),
    (["--max-images", "two"], "invalid int value"),
])
def test_bad_media_flags_exit_2(capsys, tmp_path, args, needle):
    code, _, err = run_main(capsys, "serve", "--model", str(tmp_path / "absent"), "--port",
                            "0", *args)
    assert code == 2, err
    assert needle in err and "Traceback" not in err


def test_media_flags_reach_the_settings():
    from serving.cli import build_parser
    from serving.cli.serve import check_flags, server_settings
    args = build_parser().parse_args([
        "serve", "--allowed-media-domains", "example.com,cdn.org", "127.0.0.1",
        "--allowed-media-domains", "[::1]", "example.com", "--max-images", "2",
        "--max-image-bytes", "1000", "--max-image-pixels", "4096", "--media-fetch-timeout",
        "2.5"])
    check_flags(args)
    s = server_settings(args)
    assert s.allowed_media_domains == ("example.com", "cdn.org", "127.0.0.1", "[::1]")
    assert s.engine_options["max_images"] == 2
    assert (s.max_image_bytes, s.max_image_pixels, s.media_fetch_timeout) == (1000, 4096, 2.5)
    plain = build_parser().parse_args(["serve"])
    check_flags(plain)
    defaults = server_settings(plain)
    assert defaults.allowed_media_domains == ()  # remote images off
    assert "max_images" not in defaults.engine_options  # the engine's default
