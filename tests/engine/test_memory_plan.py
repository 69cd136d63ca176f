"""Memory planning: pure arithmetic over shapes, mesh and memory (no device is touched)."""

from __future__ import annotations

import dataclasses
import math

import jax
import pytest

from metrale_jax.config import ModelConfig
from metrale_jax.engine import memory_plan as mp
from metrale_jax.engine.memory_plan import GiB, plan_memory
from metrale_jax.errors import InvalidParameterError, MemoryPlanError
from metrale_jax.models.transformer import abstract_model

SMOLLM = ModelConfig("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                     num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                     max_position_embeddings=8192, tie_word_embeddings=True)
LLAMA70B = ModelConfig("llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                       num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                       max_position_embeddings=8192)
TINY = ModelConfig("llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=8, num_kv_heads=4, head_dim=16,
                   max_position_embeddings=1024)


def num_params(cfg: ModelConfig) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_model(cfg)[1]))


def f32(cfg, mesh=(1, 1), **kw):
    return plan_memory(cfg, itemsize=4, cache_itemsize=4, mesh_shape=mesh, **kw)


def test_param_bytes_per_device():
    assert mp.param_bytes_per_device(SMOLLM, 4, (1, 1)) == 4 * num_params(SMOLLM)
    assert num_params(LLAMA70B) == 70_553_706_496  # Llama 3 70B
    # data parallel: every device holds all params
    assert mp.param_bytes_per_device(TINY, 2, (8, 1)) == 2 * num_params(TINY)
    # model=4: every matrix divides (V=512, H=8, K=4, F=128), norms [E] stay whole
    norms = (2 * TINY.num_layers + 1) * TINY.hidden_size
    sharded = num_params(TINY) - norms
    assert mp.param_bytes_per_device(TINY, 2, (2, 4)) == 2 * (sharded // 4 + norms)
    # model=8: 4 kv heads replicate, so k_proj and v_proj count whole
    E, K, D, L = 64, 4, 16, 2
    kv = 2 * L * E * K * D
    assert mp.param_bytes_per_device(TINY, 1, (1, 8)) == (sharded - kv) // 8 + kv + norms


def test_int8_params_count_one_byte_plus_their_scales():
    """int8 weights count 1 byte, their per-output-channel scales `itemsize` (from the shapes:
    q/k/v/o and the MLP per layer; "int8-all" also the tied embedding [V, E], scale [V])."""
    c = SMOLLM
    E, H, K, D, F, L, V = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                           c.intermediate_size, c.num_layers, c.vocab_size)
    weights = L * (E * H * D + 2 * E * K * D + H * D * E + 3 * E * F)
    scales = L * (H * D + 2 * K * D + E + 2 * F + E)
    f32_bytes = 4 * num_params(c)
    int8 = mp.param_bytes_per_device(c, 4, (1, 1), "int8")
    assert int8 == f32_bytes - 3 * weights + 4 * scales
    assert mp.param_bytes_per_device(c, 4, (1, 1), "int8-all") == int8 - 3 * V * E + 4 * V
    # a config already quantized counts the same; bfloat16 scales take 2 bytes
    assert mp.param_bytes_per_device(dataclasses.replace(c, quantization="int8"), 4,
                                     (1, 1)) == int8
    assert mp.param_bytes_per_device(c, 2, (1, 1), "int8") == (
        2 * num_params(c) - weights + 2 * scales)
    # the freed bytes go to the KV cache: more slots in the same memory
    plain = f32(c, memory_bytes=GiB, max_len=4096)
    quant = f32(c, memory_bytes=GiB, max_len=4096, quantization="int8")
    assert quant.param_bytes == int8 and quant.slots > plain.slots


def test_token_bytes_follow_the_kv_rule():
    # SmolLM2: L=30 x (k, v) x K=3 x D=64 x 4 bytes; 3 kv heads replicate on model=2 or 4
    assert mp.token_bytes_per_device(SMOLLM, 4, (1, 1)) == 30 * 2 * 3 * 64 * 4 == 46080
    assert mp.token_bytes_per_device(SMOLLM, 4, (2, 4)) == 46080
    assert mp.kv_heads_per_device(SMOLLM, (1, 3)) == 1
    # Llama 70B in bfloat16: 8 kv heads shard over model=8, replicate on model=16
    assert mp.token_bytes_per_device(LLAMA70B, 2, (32, 8)) == 80 * 2 * 1 * 128 * 2 == 40960
    assert mp.token_bytes_per_device(LLAMA70B, 2, (16, 16)) == 8 * 40960


def test_automatic_plan_is_the_largest_that_fits():
    plan = f32(SMOLLM, memory_bytes=8 * GiB)
    assert plan.max_len == 4096  # min(max positions 8192, 4096)
    assert plan.free_bytes >= 0
    # one more slot would not fit
    more = f32(SMOLLM, memory_bytes=8 * GiB, max_len=plan.max_len)
    assert more.slots == plan.slots
    with pytest.raises(MemoryPlanError):
        f32(SMOLLM, memory_bytes=8 * GiB, slots=plan.slots + 1, max_len=plan.max_len)
    assert plan.used_bytes == (plan.param_bytes + plan.cache_bytes + plan.scratch_bytes
                               + plan.reserve_bytes)
    assert plan.cache_bytes == plan.slots * 4096 * 46080


def test_slots_are_a_multiple_of_the_data_axis():
    plan = plan_memory(SMOLLM, itemsize=4, cache_itemsize=4, mesh_shape=(4, 2),
                       memory_bytes=8 * GiB)
    assert plan.slots % 4 == 0 and plan.slots_per_device == plan.slots // 4
    with pytest.raises(InvalidParameterError, match="multiple of the mesh's data axis") as e:
        plan_memory(SMOLLM, itemsize=4, cache_itemsize=4, mesh_shape=(4, 2),
                    memory_bytes=8 * GiB, slots=6, max_len=128)
    assert e.value.param == "max_slots"


def test_slot_cap_then_longer_cache():
    plan = f32(TINY, memory_bytes=64 * GiB)  # far more than the tiny model can use
    assert plan.slots == mp.MAX_AUTO_SLOTS
    assert plan.max_len == TINY.max_position_embeddings  # grown from 1024 = max positions
    pod = plan_memory(TINY, itemsize=2, cache_itemsize=2, mesh_shape=(4, 2),
                      memory_bytes=64 * GiB)
    assert pod.slots == 4 * mp.MAX_AUTO_SLOTS  # the cap is per data shard


def test_tight_memory_shortens_the_cache():
    plan = f32(SMOLLM, memory_bytes=int(0.75 * GiB))
    assert plan.slots == 1
    assert 0 < plan.max_len < 4096 and plan.max_len % mp.LENGTH_ALIGN == 0
    assert plan.free_bytes >= 0
    with pytest.raises(MemoryPlanError, match=f"what fits: 1 slot x {plan.max_len} tokens"):
        f32(SMOLLM, memory_bytes=int(0.75 * GiB), slots=1, max_len=plan.max_len + 128)


def test_requested_slots_get_the_longest_cache():
    plan = f32(SMOLLM, memory_bytes=4 * GiB, slots=4)
    assert plan.slots == 4 and plan.free_bytes >= 0 and plan.max_len % mp.LENGTH_ALIGN == 0
    assert plan.max_len <= SMOLLM.max_position_embeddings


def test_requested_cache_that_does_not_fit():
    with pytest.raises(MemoryPlanError) as e:
        f32(SMOLLM, memory_bytes=4 * GiB, slots=64, max_len=8192)
    msg = e.value.message
    assert "64 slots x 8192 tokens do not fit on mesh data=1,model=1" in msg
    assert "has 4.00 GiB" in msg and "what fits:" in msg
    assert e.value.code == "insufficient_memory"
    # the alternatives it names really fit
    alt = msg.split("what fits: ")[1].split(" or ")
    for option in alt:
        b, s = int(option.split(" slot")[0]), int(option.split(" x ")[1].split()[0])
        assert f32(SMOLLM, memory_bytes=4 * GiB, slots=b, max_len=s).free_bytes >= 0


def test_params_that_do_not_fit():
    with pytest.raises(MemoryPlanError, match=r"params need 16\.43 GiB per device on mesh "
                                              r"data=32,model=8"):
        plan_memory(LLAMA70B, itemsize=2, cache_itemsize=2, mesh_shape=(32, 8),
                    memory_bytes=16 * GiB)


def test_unknown_memory():
    with pytest.raises(MemoryPlanError, match="--memory-gb"):
        f32(SMOLLM, memory_bytes=None)
    with pytest.raises(MemoryPlanError, match="--memory-gb"):
        f32(SMOLLM, memory_bytes=None, slots=8)
    plan = f32(SMOLLM, memory_bytes=None, slots=8, max_len=2048)
    assert (plan.slots, plan.max_len, plan.free_bytes, plan.reserve_bytes) == (8, 2048, None, 0)
    assert "unknown" in plan.describe()


def test_the_v5e_256_plan_of_the_deploy_guide():
    """deploy/README.md's 70B numbers come from this function."""
    plan = plan_memory(LLAMA70B, itemsize=2, cache_itemsize=2, mesh_shape=(16, 16),
                       memory_bytes=16 * GiB, max_len=4096)
    assert plan.param_bytes == 11_338_268_672
    assert plan.token_bytes == 327_680
    assert (plan.slots, plan.slots_per_device) == (32, 2)
    dup = dataclasses.replace(LLAMA70B, num_kv_heads=16)  # kv heads duplicated to model=16
    plan = plan_memory(dup, itemsize=2, cache_itemsize=2, mesh_shape=(16, 16),
                       memory_bytes=16 * GiB, max_len=4096)
    assert plan.param_bytes == 8_989_458_432
    assert plan.token_bytes == 40_960
    assert plan.slots_per_device == 37


def test_describe():
    text = plan_memory(SMOLLM, itemsize=4, cache_itemsize=4, mesh_shape=(2, 4),
                       memory_bytes=8 * GiB, slots=8, max_len=2048).describe()
    assert "mesh data=2,model=4 (8 devices); KV cache 8 slots x 2048 tokens" in text
    assert "4 slots x 2048 tokens x 45.0 KiB per slot-token" in text
    assert "memory 8.00 GiB" in text and "free" in text


class FakeDevice:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_device_memory_bytes():
    assert mp.device_memory_bytes(memory_gb=1.5) == int(1.5 * GiB)
    assert mp.device_memory_bytes([FakeDevice({"bytes_limit": 10}),
                                   FakeDevice({"bytes_limit": 7})]) == 7
    assert mp.device_memory_bytes([FakeDevice(None)]) is None
    assert mp.device_memory_bytes([FakeDevice({"bytes_in_use": 3})]) is None
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidParameterError, match="memory_gb"):
            mp.device_memory_bytes(memory_gb=bad)
    # this machine's CPU devices report none (or a limit, on an accelerator)
    got = mp.device_memory_bytes()
    assert got is None or got > 0
