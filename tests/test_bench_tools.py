"""Small pieces of the bench scripts that decide what a report says."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import decode_profile  # noqa: E402


def test_profile_groups_kernels_by_name_without_templates_or_namespaces():
    short = decode_profile.short
    conv = "void baro_gpu::(anonymous namespace)::conv_kernel<8, float>(float const*, unsigned short const*, long)"
    delta = "void baro_gpu::(anonymous namespace)::delta_kernel<128>(baro_gpu::DeltaDims, float const*)"
    assert short(conv) == "void baro_gpu::conv_kernel"
    assert short(delta) == "void baro_gpu::delta_kernel"  # two groups, not one 'void baro_gpu::'
    assert short("void baro_gpu::gemm_row1_kernel<true, 2, 1>(baro_gpu::GemmParams, long)") == \
        "void baro_gpu::gemm_row1_kernel"
    assert short("loop_add_fusion") == "loop_add_fusion"


def test_profile_splits_devices_and_counts_their_collectives():
    """--devices N: each GPU plane on its own (overlapping kernels of two devices are not one
    device's busy time), NCCL kernels counted as the sharding's collective time."""
    g0, g1 = "/device:GPU:0", "/device:GPU:1"
    ks = [("void baro_gpu::gemm_row1_kernel<1>(x)", 0, 4000, g0),
          ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 4000, 9000, g0),
          ("void baro_gpu::gemm_row1_kernel<1>(x)", 1000, 3000, g1),
          ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 3000, 9000, g1),
          ("all-gather-start.3", 9000, 9500, g1)]
    d = decode_profile.per_device(ks, 2)
    assert set(d) == {g0, g1}
    assert d[g0]["busy_ms_per_step"] == 9000 / 1e6 / 2 and d[g0]["kernels_per_step"] == 1.0
    assert d[g0]["collective_ms_per_step"] == 5000 / 1e6 / 2 and d[g0]["collectives_per_step"] == 0.5
    assert d[g1]["busy_ms_per_step"] == 8500 / 1e6 / 2
    assert d[g1]["collective_ms_per_step"] == 6500 / 1e6 / 2 and d[g1]["collectives_per_step"] == 1.0
    assert not decode_profile.is_collective("void baro_gpu::moe_pairs_out_kernel(float const*)")
