"""Host-to-device copies that do not wait for the device.

A plain `tensor.to("cuda")` from pageable memory synchronises the stream after the copy, so a
training step that uploads its batch or its random anchor keys would wait for the whole previous
step first. Copied from pinned memory with `non_blocking`, the upload is queued like a kernel;
torch's pinned-memory cache keeps the buffer until the copy has run.
"""

from __future__ import annotations

import torch


def upload(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
