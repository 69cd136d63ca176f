"""A LLaVA model (tiny, CLIP tower) on 8 fake CPU devices gives the single-device tokens.

The test builds the model folder; one subprocess (XLA_FLAGS=--xla_force_host_platform_device_
count=8) runs this file as a script: an `LLM` on one device and one on the mesh (data=2,
model=4) each answer the same prompts with one and two images (greedy, all in flight
together; the images span prompt pieces), and the child prints a JSON report of the tokens
and where the image pool and the vision params live.
"""

from __future__ import annotations

import hashlib
import json
import sys

import pytest

from tests.fake_devices import print_report, run_child

pytestmark = pytest.mark.xdist_group("vision")

MESH = (2, 4)
SHAPES = dict(max_slots=4, max_len=96, max_prefill_len=16, max_prefill_batch=2, max_images=4)


# ---- the child -----------------------------------------------------------------------------
def _run(folder: str, mesh: tuple[int, int], cache_dir: str) -> dict:
    import numpy as np

    from metrale_jax import LLM, SamplingParams
    from metrale_jax.completion import collect
    from metrale_jax.scheduler import GenerationRequest
    from metrale_jax.vision.prompt import PromptImage

    llm = LLM(folder, mesh=mesh, compilation_cache_dir=cache_dir, **SHAPES)
    try:
        v, tok = llm.config.vision, llm.tokenizer
        rng = np.random.default_rng(0)
        handles = []
        for n in (1, 2, 1):
            ids = tok.encode("<s>user: ", add_special_tokens=False)
            images = []
            for _ in range(n):
                px = rng.standard_normal((3, v.image_size, v.image_size)).astype(np.float32)
                images.append(PromptImage(len(ids), v.tokens_per_image, px,
                                          hashlib.sha256(px.tobytes()).hexdigest()))
                ids += [v.image_token_id] * v.tokens_per_image
            ids += tok.encode("What is it?</s><s>assistant: ", add_special_tokens=False)
            params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
            handles.append(llm.scheduler.submit(GenerationRequest.make(ids, params,
                                                                       images=images)))
        engine = llm.scheduler.engine
        leaf = engine.image_encoder.params["layers"]["attn"]["q_proj"][...]
        return dict(mesh=list(engine.mesh.shape.values()),
                    tokens=[list(collect(h).token_ids) for h in handles],
                    pool_replicated=bool(engine.shardings.state.images.is_fully_replicated),
                    vision_devices=len(leaf.sharding.device_set))
    finally:
        llm.close()


def child_main(spec: dict) -> None:
    """Answers on one device and on the mesh; prints one JSON report."""
    import jax
    assert len(jax.devices()) == 8, jax.devices()
    print_report([_run(spec["folder"], mesh, spec["cache_dir"]) for mesh in [(1, 1), MESH]])


# ---- the tests -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    from devtools.llava_models import build_llava_folder
    from tests.conftest import CACHE
    folder = tmp_path_factory.mktemp("llava-mesh")
    build_llava_folder(folder, "clip")
    spec = {"folder": str(folder), "cache_dir": str(CACHE)}
    return run_child(__file__, json.dumps(spec), timeout=900)


def test_tokens_on_the_mesh_equal_one_device(reports):
    one, mesh = reports
    assert one["mesh"] == [1, 1] and mesh["mesh"] == list(MESH)
    assert len(one["tokens"]) == 3 and all(len(t) == 6 for t in one["tokens"])
    assert mesh["tokens"] == one["tokens"]


def test_vision_params_and_pool_replicated_on_every_device(reports):
    _, mesh = reports
    assert mesh["pool_replicated"] and mesh["vision_devices"] == 8


if __name__ == "__main__":
    child_main(json.loads(sys.argv[1]))
