"""The engine's placement on one device: mesh choice, the memory plan before any allocation,
the resolved config, and the mesh fields of `EngineConfig`."""

from __future__ import annotations

import json

import jax
import pytest
from flax import nnx

from metrale_jax.config import ModelConfig
from metrale_jax.engine import Engine, EngineConfig
from metrale_jax.engine.placement import PlacementHook, choose_mesh, place
from metrale_jax.errors import InvalidParameterError, MemoryPlanError
from metrale_jax.models.transformer import Transformer
from tests.engine.conftest import CACHE_DIR, TINY

SMOLLM = ModelConfig("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                     num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                     max_position_embeddings=8192, tie_word_embeddings=True)


def test_mesh_fields_of_the_engine_config():
    assert EngineConfig(mesh="data=2,model=4", compilation_cache_dir=None).mesh == (2, 4)
    assert EngineConfig(mesh=[1, 8], compilation_cache_dir=None).mesh == (1, 8)
    for bad in ("data=2,heads=4", (2, 0), (1, 2, 3), "model=x"):
        with pytest.raises(InvalidParameterError) as err:
            EngineConfig(mesh=bad, compilation_cache_dir=None)
        assert err.value.param == "mesh"
    with pytest.raises(InvalidParameterError) as err:
        EngineConfig(max_slots=6, mesh=(4, 1), compilation_cache_dir=None)
    assert err.value.param == "max_slots" and "data axis" in err.value.message
    with pytest.raises(InvalidParameterError) as err:
        EngineConfig(memory_gb=-1, compilation_cache_dir=None)
    assert err.value.param == "memory_gb"


def test_slot_buckets_start_at_the_data_axis():
    cfg = EngineConfig(max_slots=16, mesh=(4, 2), compilation_cache_dir=None)
    assert cfg.active_slot_buckets == (4, 8, 16)
    assert cfg.rows_for(1) == 4 and cfg.rows_for(5) == 8
    assert EngineConfig(max_slots=8, mesh=(8, 1),
                        compilation_cache_dir=None).active_slot_buckets == (8,)
    assert EngineConfig(max_slots=6, mesh=(3, 1),
                        compilation_cache_dir=None).active_slot_buckets == (3, 6)


def test_unresolved_shapes_and_with_shapes():
    cfg = EngineConfig(max_slots=None, max_len=None, max_prefill_batch=4,
                       compilation_cache_dir=None)
    assert not cfg.resolved and cfg.max_prefill_len is None
    done = cfg.with_shapes(2, 300, (1, 1))
    assert done.resolved and (done.max_slots, done.max_len, done.mesh) == (2, 300, (1, 1))
    assert done.max_prefill_len == 256 and done.max_prefill_batch == 2  # lowered to the slots


def test_default_mesh_respects_the_slots():
    # 9 heads / 3 kv heads on 8 devices: all on data; one slot cannot split over data=8,
    # so the most devices whose default mesh has data 1: 3, on model
    assert choose_mesh(SMOLLM, None, 8)[0] == (8, 1)
    shape, why = choose_mesh(SMOLLM, None, 8, slots=1)
    assert shape == (1, 3) and "on 3 of 8 devices" in why and "max_slots=1" in why
    assert choose_mesh(SMOLLM, None, 8, slots=2)[0] == (2, 3)
    assert choose_mesh(TINY, None, 8, slots=1)[0] == (1, 2)  # 4 heads, 2 kv heads
    shape, why = choose_mesh(TINY, (1, 1), 8)
    assert shape == (1, 1) and "7 of 8 devices left unused" in why
    with pytest.raises(InvalidParameterError):
        choose_mesh(TINY, (2, 8), 8)


def test_place_chooses_slots_and_length_from_memory(caplog):
    cfg = EngineConfig(max_slots=None, max_len=None, memory_gb=1.0, dtype="float32",
                       compilation_cache_dir=None)
    with caplog.at_level("INFO", logger="metrale_jax.engine.placement"):
        placement = place(TINY, cfg, n_devices=1)
    got = placement.config
    assert got.resolved and got.mesh == (1, 1)
    assert (got.max_slots, got.max_len) == (placement.plan.slots, placement.plan.max_len)
    assert got.max_len == min(TINY.max_position_embeddings, 4096)
    assert placement.plan.free_bytes >= 0
    text = caplog.text
    assert "mesh data=1,model=1" in text and "memory plan" in text and "KV cache" in text


def test_impossible_configurations_fail_before_anything_is_read(tmp_path):
    """The plan runs inside `load_checkpoint` before any weight is read: a checkpoint whose
    weights file is garbage still fails with the memory error, not a checkpoint error."""
    from devtools.hf_models import build_tiny_checkpoint
    from metrale_jax import LLM
    folder = build_tiny_checkpoint(tmp_path / "tiny")
    (folder / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(MemoryPlanError) as err:
        LLM(str(folder), max_slots=64, max_len=256, memory_gb=0.001)
    assert "do not fit" in err.value.message or "need" in err.value.message
    with pytest.raises(MemoryPlanError) as err:  # CPU reports no memory: nothing to size by
        LLM(str(folder), max_slots=None)
    assert "--memory-gb" in err.value.message


def test_hook_places_an_engine_on_its_mesh(tmp_path):
    hook = PlacementHook(EngineConfig(max_slots=2, max_len=32, compilation_cache_dir=CACHE_DIR,
                                      min_prefill_bucket=16, max_prefill_len=16))
    shardings = hook(TINY, "float32")
    graphdef, params = nnx.split(Transformer(TINY, rngs=nnx.Rngs(0)))
    tree = shardings(nnx.to_pure_dict(params))
    assert {len(s.device_set) for s in jax.tree.leaves(tree)} == {1}
    engine = Engine(TINY, graphdef, params, placement=hook.placement)
    assert engine.config.mesh == (1, 1) and dict(engine.mesh.shape) == {"data": 1, "model": 1}
    assert engine.memory_plan.slots == 2
    out = json.dumps(engine.placement.why)
    assert "model" in out
