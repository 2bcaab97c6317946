"""qk-norm + RoPE + KV store in one launch: the reference IS today's layers, the kernel matches it.

Without qk-norm the kernel rounds exactly where torch's separate ops round (and never fuses a
multiply-add), so its results are torch's bits in every dtype. With
qk-norm the float32 sum of squares may differ in its last bit, so q/k get a band. Whatever the
case, the pool must hold exactly the storage cast of the k and v the kernel left in qkv.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from snugkv.attention import triton_store
from snugkv.kernels.kv_store import store_kv_reference
from snugkv.kernels.rope_reference import rope_and_store_kv_reference, split_qkv
from snugkv.kernels.rope_store import rope_and_store_kv, rope_and_store_kv_triton
from snugkv.layers.norm import GemmaRMSNorm, RMSNorm
from snugkv.layers.rotary import RotaryEmbedding
from tests.kernels.kernel_cases import (
    DEVICE,
    TOLERANCE,
    generator,
    pool_buffer,
    randn,
    same_bits,
    scattered_slots,
)

EPS = 1e-6
MAX_POSITION = 64
NUM_SLOTS = 64  # room for the real-shape case: 24 tokens past a dummy page of 16


@dataclass(frozen=True, slots=True)
class RopeCase:
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    rotary_dim: int = 32
    qk_norm: str | None = None  # "llama" (Qwen3) or "gemma"
    neox: bool = True
    layout: str = "nhd"
    page_size: int = 1
    slot_map: bool = False
    dtype: torch.dtype = torch.bfloat16
    kv_dtype: torch.dtype = torch.bfloat16
    tokens: int = 5


CASES = {
    "gqa-nhd-fp32": RopeCase(dtype=torch.float32, kv_dtype=torch.float32),
    "gqa-hnd4-bf16": RopeCase(layout="hnd", page_size=4),
    "mqa-hnd1-fp16": RopeCase(
        num_kv_heads=1, layout="hnd", page_size=1, dtype=torch.float16, kv_dtype=torch.float16
    ),
    "partial-rotary-neox": RopeCase(rotary_dim=16),
    "partial-rotary-gptj-fp32": RopeCase(
        rotary_dim=16, neox=False, layout="hnd", page_size=4, dtype=torch.float32, kv_dtype=torch.float32
    ),
    "gptj-bf16-window": RopeCase(neox=False, slot_map=True),
    "head-dim-96-rotary-48": RopeCase(num_q_heads=2, num_kv_heads=1, head_dim=96, rotary_dim=48),
    "head-dim-80-mqa-hnd4": RopeCase(num_kv_heads=1, head_dim=80, layout="hnd", page_size=4),
    "bf16-into-fp32-pool": RopeCase(kv_dtype=torch.float32, layout="hnd", page_size=4),
    "fp8-pool": RopeCase(kv_dtype=torch.float8_e4m3fn),
    "qwen3-qk-norm-hnd4": RopeCase(qk_norm="llama", layout="hnd", page_size=4),
    "qwen3-qk-norm-fp32-window": RopeCase(
        qk_norm="llama", slot_map=True, dtype=torch.float32, kv_dtype=torch.float32
    ),
    "qwen3-qk-norm-partial-rotary-96": RopeCase(qk_norm="llama", head_dim=96, rotary_dim=64, num_kv_heads=1),
    "gemma-qk-norm-window-hnd4": RopeCase(qk_norm="gemma", slot_map=True, layout="hnd", page_size=4),
    "fp8-pool-qk-norm-mqa": RopeCase(
        qk_norm="llama", num_kv_heads=1, kv_dtype=torch.float8_e4m3fn, slot_map=True
    ),
}


@dataclass
class RopeInputs:
    qkv: torch.Tensor
    positions: torch.Tensor
    loc: torch.Tensor
    rotary: RotaryEmbedding
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    kwargs: dict


def build(case: RopeCase, seed: int = 0) -> RopeInputs:
    gen = generator(seed)
    width = (case.num_q_heads + 2 * case.num_kv_heads) * case.head_dim
    rotary = RotaryEmbedding(
        case.head_dim,
        {"rope_type": "default", "rope_theta": 10000.0},
        MAX_POSITION,
        rotary_dim=case.rotary_dim,
        neox_style=case.neox,
    ).to(DEVICE)
    shape = {"num_slots": NUM_SLOTS, "num_kv_heads": case.num_kv_heads, "head_dim": case.head_dim}
    shape |= {"layout": case.layout, "page_size": case.page_size, "dtype": case.kv_dtype, "padded": True}
    k_buffer, v_buffer = pool_buffer(gen, **shape), pool_buffer(gen, **shape)
    slot_map = None
    if case.slot_map:  # a permutation keeps the translated slots distinct
        perm = torch.randperm(NUM_SLOTS - case.page_size, generator=gen) + case.page_size
        slot_map = torch.cat([torch.arange(case.page_size), perm]).to(DEVICE)
    norm_weights = {}
    if case.qk_norm:
        offset = 0.0 if case.qk_norm == "gemma" else 1.0
        for name in ("q_norm_weight", "k_norm_weight"):
            norm_weights[name] = (randn(gen, case.head_dim) * 0.3 + offset).to(case.dtype)
    return RopeInputs(
        qkv=randn(gen, case.tokens, width, dtype=case.dtype) * 2,
        positions=torch.randint(0, MAX_POSITION, (case.tokens,), generator=gen).to(DEVICE),
        loc=scattered_slots(gen, case.tokens, NUM_SLOTS, case.page_size),
        rotary=rotary,
        k_buffer=k_buffer,
        v_buffer=v_buffer,
        kwargs={
            "num_q_heads": case.num_q_heads,
            "num_kv_heads": case.num_kv_heads,
            "head_dim": case.head_dim,
            "page_size": case.page_size,
            "layout": case.layout,
            "neox_style": case.neox,
            "norm_eps": EPS,
            "gemma_norm": case.qk_norm == "gemma",
            "kv_slot_map": slot_map,
            **norm_weights,
        },
    )


def run(fn, inputs: RopeInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run on copies; returns (qkv, k_buffer, v_buffer) afterwards."""
    qkv, k_buffer, v_buffer = inputs.qkv.clone(), inputs.k_buffer.clone(), inputs.v_buffer.clone()
    rotary = inputs.rotary
    fn(
        qkv,
        inputs.positions,
        rotary.cos_cache,
        rotary.sin_cache,
        k_buffer,
        v_buffer,
        inputs.loc,
        **inputs.kwargs,
    )
    return qkv, k_buffer, v_buffer


@pytest.mark.parametrize("qk_norm", [None, "llama", "gemma"])
@pytest.mark.parametrize(("neox", "rotary_dim"), [(True, 32), (True, 16), (False, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_todays_layers_bit_for_bit(qk_norm, neox, rotary_dim, dtype):
    case = RopeCase(
        qk_norm=qk_norm,
        neox=neox,
        rotary_dim=rotary_dim,
        dtype=dtype,
        kv_dtype=dtype,
        layout="hnd",
        page_size=4,
    )
    inputs = build(case)
    qkv, k_buffer, v_buffer = run(rope_and_store_kv_reference, inputs)

    # What LlamaAttention / Gemma3Attention + the attention backend's set_kv do today.
    q, k, v = split_qkv(inputs.qkv.clone(), case.num_q_heads, case.num_kv_heads, case.head_dim)
    if qk_norm:
        norm_class = GemmaRMSNorm if qk_norm == "gemma" else RMSNorm
        norms = [norm_class(case.head_dim, EPS).to(DEVICE, dtype) for _ in range(2)]
        for norm, name in zip(norms, ("q_norm_weight", "k_norm_weight")):
            norm.weight.data.copy_(inputs.kwargs[name])
        q, k = norms[0](q), norms[1](k)
    q, k = inputs.rotary(inputs.positions, q, k)
    expected_k, expected_v = inputs.k_buffer.clone(), inputs.v_buffer.clone()
    triton_store.store_kv(expected_k, expected_v, inputs.loc, k, v, page_size=4, layout="hnd")

    ours_q, ours_k, ours_v = split_qkv(qkv, case.num_q_heads, case.num_kv_heads, case.head_dim)
    assert same_bits(ours_q, q.detach()) and same_bits(ours_k, k.detach()) and same_bits(ours_v, v)
    assert same_bits(k_buffer, expected_k) and same_bits(v_buffer, expected_v)


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(name):
    case = CASES[name]
    inputs = build(case, seed=len(name))
    qkv, k_buffer, v_buffer = run(rope_and_store_kv_triton, inputs)
    expected_qkv, expected_k, expected_v = run(rope_and_store_kv_reference, inputs)

    exact = case.qk_norm is None
    if exact:
        assert same_bits(qkv, expected_qkv)
    else:
        torch.testing.assert_close(qkv, expected_qkv, **TOLERANCE[case.dtype])
    # v heads pass through untouched.
    v_start = (case.num_q_heads + case.num_kv_heads) * case.head_dim
    assert same_bits(qkv[:, v_start:], inputs.qkv[:, v_start:])
    # The pool holds exactly the storage cast of the k and v the kernel left in qkv.
    _, k, v = split_qkv(qkv, case.num_q_heads, case.num_kv_heads, case.head_dim)
    own_k, own_v = inputs.k_buffer.clone(), inputs.v_buffer.clone()
    store_kv_reference(
        own_k, own_v, inputs.loc, k, v, page_size=case.page_size, layout=case.layout,
        kv_slot_map=inputs.kwargs["kv_slot_map"],
    )  # fmt: skip
    assert same_bits(k_buffer, own_k) and same_bits(v_buffer, own_v)
    if exact:
        assert same_bits(k_buffer, expected_k) and same_bits(v_buffer, expected_v)


def test_empty_batch_changes_nothing():
    inputs = build(RopeCase(tokens=0))
    qkv, k_buffer, _ = run(rope_and_store_kv_triton, inputs)
    assert qkv.shape[0] == 0 and same_bits(k_buffer, inputs.k_buffer)


def test_returns_head_views_of_the_updated_qkv():
    inputs = build(RopeCase())
    qkv = inputs.qkv.clone()
    rotary = inputs.rotary
    q, k, v = rope_and_store_kv_triton(
        qkv, inputs.positions, rotary.cos_cache, rotary.sin_cache, inputs.k_buffer.clone(),
        inputs.v_buffer.clone(), inputs.loc, **inputs.kwargs,
    )  # fmt: skip
    assert q.shape == (5, 4, 32) and k.shape == v.shape == (5, 2, 32)
    assert q.data_ptr() == qkv.data_ptr() and same_bits(q.reshape(5, -1), qkv[:, :128])


def test_bad_arguments_are_refused_with_a_sentence():
    inputs = build(RopeCase())
    rotary = inputs.rotary
    args = (
        inputs.qkv,
        inputs.positions,
        rotary.cos_cache,
        rotary.sin_cache,
        inputs.k_buffer,
        inputs.v_buffer,
    )
    kwargs = dict(inputs.kwargs)
    with pytest.raises(ValueError, match="both q_norm_weight and k_norm_weight"):
        rope_and_store_kv_triton(
            *args, inputs.loc, **kwargs | {"q_norm_weight": torch.ones(32, device=DEVICE)}
        )
    with pytest.raises(ValueError, match="must not promote qkv"):
        ones = torch.ones(32, device=DEVICE)
        rope_and_store_kv_triton(*args, inputs.loc, **kwargs | {"q_norm_weight": ones, "k_norm_weight": ones})
    with pytest.raises(ValueError, match=r"\(Hq \+ 2 \* Hkv\) \* D"):
        rope_and_store_kv_triton(*args, inputs.loc, **kwargs | {"num_q_heads": 3})
    with pytest.raises(ValueError, match="must both be"):
        rope_and_store_kv_triton(*args, inputs.loc[:2], **kwargs)


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU dispatch")
def test_cpu_dispatch_takes_the_reference():
    inputs = build(RopeCase(qk_norm="llama", dtype=torch.float32, kv_dtype=torch.float32))
    for ours, reference in zip(run(rope_and_store_kv, inputs), run(rope_and_store_kv_reference, inputs)):
        assert same_bits(ours, reference)


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "qk_norm", "kv_dtype"),
    [(32, 8, None, torch.bfloat16), (16, 8, "llama", torch.bfloat16), (32, 8, None, torch.float8_e4m3fn)],
)
def test_real_shapes_on_the_gpu(num_q_heads, num_kv_heads, qk_norm, kv_dtype):
    case = RopeCase(
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=128, rotary_dim=128, qk_norm=qk_norm,
        layout="hnd", page_size=16, kv_dtype=kv_dtype, tokens=24,
    )  # fmt: skip
    inputs = build(case)
    got, expected = run(rope_and_store_kv, inputs), run(rope_and_store_kv_reference, inputs)
    for ours, reference in zip(got, expected):
        if qk_norm is None:
            assert same_bits(ours, reference)
        else:
            torch.testing.assert_close(ours.float(), reference.float(), **TOLERANCE[torch.bfloat16])


@pytest.mark.cuda
def test_kernel_replays_in_a_cuda_graph_with_new_positions_and_slots():
    case = RopeCase(qk_norm="llama", layout="hnd", page_size=4, slot_map=True)
    first, second = build(case, seed=1), build(case, seed=2)
    qkv, positions, loc = first.qkv.clone(), first.positions.clone(), first.loc.clone()
    k_buffer, v_buffer = first.k_buffer.clone(), first.v_buffer.clone()
    rotary = first.rotary

    def step() -> None:
        rope_and_store_kv(
            qkv, positions, rotary.cos_cache, rotary.sin_cache, k_buffer, v_buffer, loc, **first.kwargs
        )

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles the kernel outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    qkv.copy_(second.qkv)
    positions.copy_(second.positions)
    loc.copy_(second.loc)
    k_buffer.copy_(second.k_buffer)
    v_buffer.copy_(second.v_buffer)
    graph.replay()
    torch.cuda.synchronize()
    # Same weights and slot map as captured; the second batch's activations, positions and slots.
    replayed = replace(
        first, qkv=second.qkv, positions=second.positions, loc=second.loc,
        k_buffer=second.k_buffer, v_buffer=second.v_buffer,
    )  # fmt: skip
    expected = run(rope_and_store_kv_triton, replayed)
    for ours, reference in zip((qkv, k_buffer, v_buffer), expected):
        assert same_bits(ours, reference)
