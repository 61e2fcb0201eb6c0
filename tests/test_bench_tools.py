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
