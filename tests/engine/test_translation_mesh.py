"""A translation model (tiny NLLB) on 8 fake CPU devices gives the single-device translations.

The test builds the model folder; one subprocess (XLA_FLAGS=--xla_force_host_platform_device_
count=8) runs this file as a script: an `LLM` on one device and one on the mesh (data=2,
model=4: rows on data, the 4 heads on model) each translate the same three texts greedily and
with num_beams 4 (all in flight together), and the child prints a JSON report of the ids,
where the cross-attention cache lives and how many programs the mesh's `LLM` compiled after
its warmup.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.fake_devices import print_report, run_child

pytestmark = pytest.mark.xdist_group("translation")

MESH = (2, 4)
TEXTS = [("Hello world, how are you today?", "eng_Latn", "fra_Latn"),
         ("Le renard brun rapide saute par-dessus le chien paresseux.", "fra_Latn", "deu_Latn"),
         ("Machine translation is useful.", "eng_Latn", "spa_Latn")]
SHAPES = dict(max_slots=8, max_len=32, max_source_len=64, max_prefill_len=16,
              max_prefill_batch=2)


# ---- the child -----------------------------------------------------------------------------
def _run(folder: str, mesh: tuple[int, int], cache_dir: str) -> dict:
    from metrale_jax import LLM, SamplingParams

    # Only the mesh run warms up (its check: nothing compiles after warmup); the one-device
    # run is the reference tokens, compiled as it goes.
    warmup = mesh != (1, 1)
    llm = LLM(folder, mesh=mesh, warmup=warmup, compilation_cache_dir=cache_dir, **SHAPES)
    try:
        engine = llm.scheduler.engine
        compiles = engine.compile_count
        handles = []
        for beams in (1, 4):
            params = SamplingParams(temperature=0.0, max_tokens=8, num_beams=beams,
                                    num_return_sequences=beams)
            for text, src, tgt in TEXTS:
                x = _inputs(llm, text, src, tgt)
                handles.append(llm._submit(list(x.prompt), params, x.source))
        from metrale_jax.completion import collect
        outs = [collect(h) for h in handles]
        return dict(
            mesh=list(engine.mesh.shape.values()),
            ids=[[list(b.token_ids) for b in o.beams] if o.beams else [list(o.token_ids)]
                 for o in outs],
            compiles_after_warmup=engine.compile_count - compiles if warmup else None,
            cross_spec=[str(x) for x in engine.shardings.state.cross.k[0].spec],
            cross_devices=len(engine.shardings.state.cross.k[0].device_set))
    finally:
        llm.close()


def _inputs(llm, text, src, tgt):
    from metrale_jax.text.translation import translation_inputs
    return translation_inputs(llm.tokenizer, text, src, tgt)


def child_main(spec: dict) -> None:
    """Translates on one device and on the mesh; prints one JSON report."""
    import jax
    assert len(jax.devices()) == 8, jax.devices()
    print_report([_run(spec["folder"], mesh, spec["cache_dir"]) for mesh in [(1, 1), MESH]])


# ---- the tests -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    from devtools.nllb_models import build_nllb_folder
    from tests.conftest import CACHE
    folder = tmp_path_factory.mktemp("nllb-mesh")
    build_nllb_folder(folder)
    spec = {"folder": str(folder), "cache_dir": str(CACHE)}
    return run_child(__file__, json.dumps(spec), timeout=900)


def test_translations_on_the_mesh_equal_one_device(reports):
    one, mesh = reports
    assert one["mesh"] == [1, 1] and mesh["mesh"] == list(MESH)
    assert len(one["ids"]) == 2 * len(TEXTS)
    assert all(len(hyps) == 4 for hyps in one["ids"][len(TEXTS):])  # the beams' hypotheses
    assert mesh["ids"] == one["ids"]


def test_cross_cache_rows_on_data_heads_on_model_and_nothing_compiles(reports):
    one, mesh = reports
    # [B, S, H, D]: rows on data, the 4 heads on model
    assert mesh["cross_spec"] == ["data", "None", "model", "None"]
    assert mesh["cross_devices"] == 8 and one["cross_devices"] == 1
    assert mesh["compiles_after_warmup"] == 0


if __name__ == "__main__":
    child_main(json.loads(sys.argv[1]))
