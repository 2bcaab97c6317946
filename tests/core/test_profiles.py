"""A profile's trace summed by kind of kernel, the same way for any engine's Chrome trace."""

from __future__ import annotations

import gzip
import json

from snugkv.core.profiles import ProfileError, kernel_kind, newest_trace, summarize_events, summarize_trace


def kernel(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_device_kernels_are_summed_by_kind_and_cpu_ops_left_out() -> None:
    events = [
        kernel("nvjet_tst_128x256_h_bz_coopA_NNT", 0, 40),
        kernel("_fwd_kernel_stage1 (decode attention)", 40, 20),
        kernel("_extend_kernel", 60, 10),
        kernel("triton_poi_fused_rms_norm_0", 70, 5),
        kernel("Memcpy HtoD (Pinned -> Device)", 75, 3, cat="gpu_memcpy"),
        kernel("aten::mm", 0, 500, cat="cpu_op"),  # the host's view of the same GEMM: not device time
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 1},  # no duration: not counted
    ]
    summary = summarize_events(events).to_dict()
    assert summary["device"] is True
    assert summary["kinds"] == {"gemm": 40.0, "attention": 30.0, "norm": 5.0, "copy": 3.0}
    assert summary["total_us"] == 78.0 and summary["span_us"] == 78.0 and summary["busy_fraction"] == 1.0
    assert summary["top"][0] == {
        "name": "nvjet_tst_128x256_h_bz_coopA_NNT",
        "kind": "gemm",
        "us": 40.0,
        "calls": 1,
    }


def test_a_cpu_trace_is_summed_over_its_ops_and_says_so(tmp_path) -> None:
    path = tmp_path / "cpu.trace.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump(
            {
                "traceEvents": [
                    kernel("aten::addmm", 0, 30, cat="cpu_op"),
                    kernel("aten::softmax", 40, 10, cat="cpu_op"),
                ]
            },
            handle,
        )
    summary = summarize_trace(path)
    assert summary.device is False and summary.kinds == {"gemm": 30.0, "sampling": 10.0}
    assert summary.span_us == 50.0
    assert newest_trace(tmp_path) == path


def test_kinds_of_names_other_engines_use() -> None:
    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert kernel_kind("flash_fwd_splitkv_kernel") == "attention"
    assert kernel_kind("fused_moe_kernel") == "moe"
    assert kernel_kind("reshape_and_cache_flash_kernel") == "kv-store"
    assert kernel_kind("act_and_mul_kernel") == "activation"
    assert kernel_kind("something_new") == "other"
    # names seen in SGLang's trace on the H100 (bench peers at e86cb6c)
    assert kernel_kind("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>") == "norm"
    assert kernel_kind("_fwd_grouped_kernel_stage1") == kernel_kind("_fwd_kernel") == "attention"
    assert kernel_kind("_rms_norm_kernel") == "norm"


def test_a_profile_error_keeps_its_status_across_a_process_boundary() -> None:
    import pickle

    error = pickle.loads(pickle.dumps(ProfileError("bad folder", 400)))
    assert isinstance(error, ProfileError) and error.status == 400 and str(error) == "bad folder"
