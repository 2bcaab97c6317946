"""FP8 GEMMs for small batches (1 to ~128 rows): `y = x W^T (+ b)`, W float8_e4m3fn `[N, K]`.

At a decode batch the GEMM is a weight read: N x K bytes once, a few FLOP per byte. On the H200
(~4.2 TB/s copy) a 4096 x 4096 weight takes 4 us, a 28672 x 4096 one 28 us; the kernels below are
built for that read, not for arithmetic. What keeps a weight read from the bandwidth is too few
bytes in flight (HBM needs tens of KB per SM outstanding) and SMs left idle (a grid of 64 tiles on
132 SMs), so both kernels here give every SM several programs and each program several loads in
flight:
- `fp8_linear_swapab`: tensor cores with the operands swapped, `acc[n, m] = W[n, :] . x[m, :]`:
  the weight tile is the MMA's 64-row side (`BLOCK_N`), the batch its narrow side (`BLOCK_M`, 16
  and up), so one row wastes no 64-row MMA, and the weight tiles stream through the software
  pipeline (`num_stages` tiles in flight per program). The activation is the float input itself
  (`activations="float"`: weight-only, the fp8 weight converted in registers; no quantization
  launch) or an FP8 copy quantized by kernels/fp8_quant.py (`"fp8"`: fp8 x fp8 MMAs).
- `fp8_linear_gemv_wide`: one row on CUDA cores, `BLOCK_N` weight rows by 512 columns a step
  (16 bytes per thread per row), the next step's loads issued before this step's FMAs, the
  per-token scale's pass over x overlapped with the first weight loads.
Both split K over `split_k` programs per output tile where N alone leaves SMs idle. The split is
deterministic: each program writes its float32 partial tile to a workspace and takes a ticket from
a per-tile counter; the program with the last ticket adds the partials in split order (the same
sum whichever finishes last), writes the output and resets the counter, so the next launch (or
graph replay) finds it zero. One launch, no atomics on the output, bit-identical reruns. The
counters live in one small int32 buffer per device made outside any capture (`arrival_counters`);
kernels that share it run one after the other on one stream, as the engine runs them.

`activations="float"` multiplies the unquantized input: more accurate than W8A8 (it is what the
CPU path computes on the dequantized weight), and checked against that reference
(`fp8_linear_weight_only_reference`). Capturable (no host sync); imports only torch and triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from snugkv.kernels.fp8_quant import quantize_fp8_activation_triton

GROUP_K = 128  # activation groups and weight blocks along K
# What the swap-AB kernel multiplies the weight by, and the wide GEMV's activations (constexpr
# globals: the kernels compare their mode arguments with them)
A_FLOAT, A_FP8_ROWS, A_FP8_GROUPS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
GEMV_FLOAT, GEMV_TOKEN, GEMV_STATIC = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
ARRIVAL_SLOTS = 1 << 15  # output tiles one split-K launch may have (128 KiB of counters per device)
_ARRIVALS: dict[tuple[str, int | None], torch.Tensor] = {}


def arrival_counters(device: torch.device) -> torch.Tensor:
    """The device's zeroed split-K counters (made on first use, which must not be in a capture)."""
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    key = (device.type, index)
    counters = _ARRIVALS.get(key)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "FP8 split-K counters are made outside graph capture (the GEMM chooser measures first)"
            )
        counters = torch.zeros(ARRIVAL_SLOTS, dtype=torch.int32, device=device)
        _ARRIVALS[key] = counters
    return counters


def choose_split_k(tiles: int, k: int, block_k: int, sm_count: int, max_split: int = 8) -> int:
    """Fewest splits (a power of two, at most `max_split`) that give every SM two programs, each
    split keeping at least two K blocks: split-K costs a partial write and read, worth it only
    where the tiles alone leave SMs idle."""
    split = 1
    while tiles * split < 2 * sm_count and split < max_split and k >= 4 * split * block_k:
        split *= 2
    return split


def _k_per_split(k: int, split_k: int, block_k: int) -> tuple[int, int]:
    """(columns per split, a multiple of `block_k`; the splits that have any columns)."""
    per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    return per_split, triton.cdiv(k, per_split)


@triton.jit
def _split_k_sum(
    acc,
    Partials,
    Arrivals,
    tile,
    num_tiles,
    pid_k,
    split_k,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    """`(sum, last)`: this program's float32 partial tile `acc [ROWS, COLS]` written to the
    workspace, a ticket taken; the program holding the last ticket gets the tile's partials added in
    split order (the same sum whoever arrives last) and `last` true, and zeroes the tile's counter."""
    # flat, so the workspace moves in 16-byte vectors and the pointers take few registers (the
    # tile's own layout scatters each thread's elements)
    offsets = tl.arange(0, ROWS * COLS)
    base = Partials + tile.to(tl.int64) * (ROWS * COLS)
    stride_split = num_tiles.to(tl.int64) * (ROWS * COLS)
    tl.store(base + pid_k * stride_split + offsets, tl.reshape(acc, (ROWS * COLS,)))
    # every thread's partial is written before the ticket publishes them (bar.sync, then one
    # gpu-scope acq_rel atomic: the release is cumulative over what the barrier ordered before it)
    tl.debug_barrier()
    ticket = tl.atomic_add(Arrivals + tile, 1, sem="acq_rel", scope="gpu")
    last = ticket == split_k - 1
    if last:
        total = tl.load(base + offsets, cache_modifier=".cg")  # .cg: from L2, where the others wrote
        for split in tl.range(1, split_k, loop_unroll_factor=1):  # one partial tile at a time
            total += tl.load(base + split * stride_split + offsets, cache_modifier=".cg")
        tl.atomic_xchg(Arrivals + tile, 0)  # zero again for the next launch or graph replay
        acc = tl.reshape(total, (ROWS, COLS))
    return acc, last


@triton.jit(do_not_specialize=["split_k"])  # one binary per tile shape, whatever the split
def _fp8_swapab_gemm_kernel(
    A,
    B,
    C,
    AScale,
    BScale,
    Bias,
    Partials,
    Arrivals,
    M,
    N,
    K,
    k_per_split,
    split_k,
    stride_am,
    stride_bn,
    stride_cm,
    stride_as_m,
    stride_as_k,
    stride_bs_n,
    stride_bs_k,
    A_MODE: tl.constexpr,
    B_BLOCKS: tl.constexpr,
    SCALE_BN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_m = offs_m < M
    k_begin = pid_k * k_per_split
    w_ptrs = B + offs_n[:, None].to(tl.int64) * stride_bn + (k_begin + offs_k)[None, :]
    x_ptrs = A + offs_m[None, :].to(tl.int64) * stride_am + (k_begin + offs_k)[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        k_ok = (k_begin + k0 + offs_k) < K
        w = tl.load(w_ptrs, mask=mask_n[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=k_ok[:, None] & mask_m[None, :], other=0.0)
        if A_MODE == A_FLOAT:
            w = w.to(x.dtype)  # exact: every e4m3 value is a bf16 / fp16 / fp32 value
        if B_BLOCKS or A_MODE == A_FP8_GROUPS:  # BLOCK_K is the 128-column group: scale this block
            partial = tl.dot(w, x, input_precision=DOT_PRECISION)
            group = (k_begin + k0) // BLOCK_K
            if B_BLOCKS:
                block_scale = tl.load(
                    BScale + (offs_n // SCALE_BN) * stride_bs_n + group * stride_bs_k, mask=mask_n, other=0.0
                )
                partial = partial * block_scale[:, None]
            if A_MODE == A_FP8_GROUPS:
                x_scale = tl.load(AScale + offs_m * stride_as_m + group * stride_as_k, mask=mask_m, other=0.0)
                partial = partial * x_scale[None, :]
            acc += partial
        else:
            acc = tl.dot(w, x, acc, input_precision=DOT_PRECISION)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    # per-row weight and activation scales and the bias apply to the sum: partials are raw dots
    last = pid_k == 0  # without a split, the one program of the tile
    if split_k > 1:
        tile = pid_m * tl.num_programs(0) + pid_n
        num_tiles = tl.num_programs(0) * tl.num_programs(1)
        acc, last = _split_k_sum(acc, Partials, Arrivals, tile, num_tiles, pid_k, split_k, BLOCK_N, BLOCK_M)
    if last:
        if not (B_BLOCKS or A_MODE == A_FP8_GROUPS):
            acc = acc * tl.load(BScale + offs_n * stride_bs_n, mask=mask_n, other=0.0)[:, None]
            if A_MODE == A_FP8_ROWS:
                acc = acc * tl.load(AScale + offs_m * stride_as_m, mask=mask_m, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        out = C + offs_m[None, :].to(tl.int64) * stride_cm + offs_n[:, None]
        tl.store(out, acc.to(C.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])


@triton.jit(do_not_specialize=["split_k"])
def _fp8_gemv_wide_kernel(
    A,
    B,
    C,
    AScale,
    BScale,
    Bias,
    Partials,
    Arrivals,
    N,
    K,
    k_per_split,
    split_k,
    stride_bn,
    stride_bs_n,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    w_rows = B + offs_n[:, None].to(tl.int64) * stride_bn
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    # The first step's weight loads go out before anything waits: the token scale's pass over x
    # (L2-resident) then runs while they are in flight.
    cols = k_begin + offs_k
    w_next = tl.load(w_rows + cols[None, :], mask=mask_n[:, None] & (cols < k_end)[None, :], other=0.0)
    a_scale = 1.0
    if ACT == GEMV_TOKEN:
        amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            x_cols = start + offs_k
            amax = tl.maximum(amax, tl.abs(tl.load(A + x_cols, mask=x_cols < K, other=0.0).to(tl.float32)))
        a_scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / 448.0
    elif ACT == GEMV_STATIC:
        a_scale = tl.load(AScale)
    # summed per step (in-warp: a warp holds whole 512-column rows), so few registers per program
    # and many programs (each with its next step's loads in flight) per SM
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        w = w_next
        next_cols = k0 + BLOCK_K + offs_k  # the next step's loads before this step's FMAs
        w_next = tl.load(
            w_rows + next_cols[None, :], mask=mask_n[:, None] & (next_cols < k_end)[None, :], other=0.0
        )
        cols = k0 + offs_k
        x = tl.load(A + cols, mask=cols < k_end, other=0.0).to(tl.float32)
        if ACT != GEMV_FLOAT:  # W8A8: the activation rounded to fp8 as kernels/fp8_quant.py rounds it
            x = tl.clamp(x / a_scale, -448.0, 448.0).to(B.dtype.element_ty).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    partial = acc[:, None]  # [BLOCK_N, 1]: the split-K helper takes 2-D tiles
    last = pid_k == 0
    if split_k > 1:
        partial, last = _split_k_sum(
            partial, Partials, Arrivals, pid_n, tl.num_programs(0), pid_k, split_k, BLOCK_N, 1
        )
    if last:
        out = tl.sum(partial, axis=1) * tl.load(BScale + offs_n * stride_bs_n, mask=mask_n, other=0.0)
        if ACT != GEMV_FLOAT:
            out = out * a_scale
        if HAS_BIAS:
            out += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(C + offs_n, out.to(C.dtype.element_ty), mask=mask_n)


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block_n: int | None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"fp8 linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply")
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8 linear: the weight is {weight.dtype}, not {torch.float8_e4m3fn}")
    rows, cols = weight.shape
    expected = (rows, 1) if block_n is None else (-(-rows // block_n), -(-cols // GROUP_K))
    if tuple(weight_scale.shape) != expected:
        raise ValueError(f"fp8 linear: weight scales {tuple(weight_scale.shape)}, expected {expected}")


def _workspace(
    x: torch.Tensor, split_k: int, tiles: int, tile_elements: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 partials, counters) of a split-K launch; a dummy pair without a split."""
    if split_k == 1:  # never read without a split, but typed as if (the kernel compiles its split path)
        return torch.empty(1, dtype=torch.float32, device=x.device), arrival_counters(x.device)
    if tiles > ARRIVAL_SLOTS:
        raise ValueError(f"split-K over {tiles} output tiles; the counters hold {ARRIVAL_SLOTS}")
    partials = torch.empty(split_k * tiles * tile_elements, dtype=torch.float32, device=x.device)
    return partials, arrival_counters(x.device)


def fp8_linear_swapab(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    activations: str,
    act: str = "token",
    block_n: int | None = None,
    static_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    tile_n: int = 64,
    tile_m: int = 16,
    block_k: int = 128,
    split_k: int = 1,
    num_warps: int = 4,
    num_stages: int = 4,
) -> torch.Tensor:
    """`x [M, K] @ weight.T` in x's dtype, `tile_n` weight rows by `tile_m` batch rows per program.

    `activations="float"`: x as it is times the weight (weight-only; `act` and `static_scale` unused);
    `"fp8"`: x quantized first as `act` says (token / static rows, or 128-column groups with block
    weight scales), fp8 x fp8 MMAs. Block weight scales need `block_k == 128`."""
    _check(x, weight, weight_scale, block_n)
    if activations not in ("float", "fp8"):
        raise ValueError(f"activations are 'float' or 'fp8', not {activations!r}")
    if (block_n is not None or (activations == "fp8" and act == "group")) and block_k != GROUP_K:
        raise ValueError(f"block scales are applied per {GROUP_K} columns: block_k must be {GROUP_K}")
    x = x.contiguous()
    rows, cols = x.shape
    out_rows = weight.shape[0]
    out = torch.empty(rows, out_rows, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    if activations == "float":
        a, a_scale, a_mode = x, weight_scale, A_FLOAT.value
    elif act == "group":
        a, a_scale = quantize_fp8_activation_triton(x, "group", group_size=GROUP_K)
        a_mode = A_FP8_GROUPS.value
    else:
        a, a_scale = quantize_fp8_activation_triton(x, act, static_scale=static_scale)
        a_mode = A_FP8_ROWS.value
    per_split, splits = _k_per_split(cols, split_k, block_k)
    grid = (triton.cdiv(out_rows, tile_n), triton.cdiv(rows, tile_m), splits)
    partials, arrivals = _workspace(x, splits, grid[0] * grid[1], tile_n * tile_m)
    _fp8_swapab_gemm_kernel[grid](
        a,
        weight,
        out,
        a_scale,
        weight_scale,
        bias if bias is not None else weight_scale,
        partials,
        arrivals,
        rows,
        out_rows,
        cols,
        per_split,
        splits,
        a.stride(0),
        weight.stride(0),
        out.stride(0),
        a_scale.stride(0),
        a_scale.stride(1) if a_scale.dim() == 2 else 0,
        weight_scale.stride(0),
        weight_scale.stride(1),
        A_MODE=a_mode,
        B_BLOCKS=block_n is not None,
        SCALE_BN=block_n or 1,
        HAS_BIAS=bias is not None,
        BLOCK_N=tile_n,
        BLOCK_M=tile_m,
        BLOCK_K=block_k,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def fp8_linear_gemv_wide(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    activations: str,
    act: str = "token",
    static_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    rows_per_program: int = 8,
    block_k: int = 512,
    split_k: int = 1,
    num_warps: int = 4,
) -> torch.Tensor:
    """`x [1, K] @ weight.T` for row weight scales `[N, 1]`, `rows_per_program` weight rows a program.

    `activations="float"`: weight-only; `"fp8"`: x rounded to fp8 per token or with the static scale,
    in the kernel (no quantization launch)."""
    _check(x, weight, weight_scale, None)
    if x.shape[0] != 1:
        raise ValueError(f"the wide FP8 GEMV takes one row, got {x.shape[0]}")
    if activations == "fp8" and act not in ("token", "static"):
        raise ValueError(f"the wide FP8 GEMV quantizes per token or with a static scale, not {act!r}")
    x = x.contiguous()
    out_rows, cols = weight.shape
    out = torch.empty(1, out_rows, dtype=x.dtype, device=x.device)
    act_id = (GEMV_FLOAT if activations == "float" else GEMV_TOKEN if act == "token" else GEMV_STATIC).value
    per_split, splits = _k_per_split(cols, split_k, block_k)
    grid = (triton.cdiv(out_rows, rows_per_program), splits)
    partials, arrivals = _workspace(x, splits, grid[0], rows_per_program)
    _fp8_gemv_wide_kernel[grid](
        x,
        weight,
        out,
        static_scale if static_scale is not None else weight_scale,
        weight_scale,
        bias if bias is not None else weight_scale,
        partials,
        arrivals,
        out_rows,
        cols,
        per_split,
        splits,
        weight.stride(0),
        weight_scale.stride(0),
        ACT=act_id,
        HAS_BIAS=bias is not None,
        BLOCK_N=rows_per_program,
        BLOCK_K=block_k,
        num_warps=num_warps,
    )
    return out


def fp8_linear_weight_only_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    block_n: int | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """What `activations="float"` computes, in float32 torch: x times the dequantized weight."""
    _check(x, weight, weight_scale, block_n)
    rows, cols = weight.shape
    if block_n is None:
        w_scale = weight_scale
    else:
        w_scale = weight_scale.repeat_interleave(block_n, 0).repeat_interleave(GROUP_K, 1)[:rows, :cols]
    out = x.float() @ (weight.float() * w_scale).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
