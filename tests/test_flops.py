import pytest

from rankwatch.hooks.harness.flops import peak_flops_for, transformer_flops_per_token


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H200", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA L40S", 362e12),
    ("cpu", 0.0),
])
def test_peak_table(name, peak):
    assert peak_flops_for(name) == peak


def test_flops_per_token():
    assert transformer_flops_per_token(1000, 2, 64, 32) == 6 * 1000 + 12 * 2 * 64 * 32
