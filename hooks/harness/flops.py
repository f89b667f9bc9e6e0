"""Model FLOPs and device peaks, for tokens/s and MFU."""

from __future__ import annotations

__all__ = ["PEAK_FLOPS", "peak_flops_for", "transformer_flops_per_token"]

# Dense bf16 peak FLOP/s per device, from the vendors' data sheets (no sparsity).
PEAK_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "B100": 1750e12,
    "A100": 312e12,
    "A10G": 70e12,
    "L40S": 362e12,
    "L4": 121e12,
    "V100": 125e12,
    "MI300X": 1307e12,
}


def peak_flops_for(device_name: str) -> float:
    """Peak FLOP/s of a device from its name (``torch.cuda.get_device_name``); 0 if unknown."""
    name = device_name.upper()
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):  # most specific first
        if all(part in name for part in key.upper().split()):
            return PEAK_FLOPS[key]
    return 0.0


def transformer_flops_per_token(n_params: int, n_layers: int, dim: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the weights plus 12·L·d·T for attention."""
    return 6.0 * n_params + 12.0 * n_layers * dim * seq_len
