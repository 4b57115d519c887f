"""Wrapping refuses a model spread over several devices (needs a CUDA device)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from isp_comm.discovery import validate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_parameters_on_several_devices_are_refused() -> None:
    blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4).cuda())])
    with pytest.raises(ValueError, match="several devices"):
        validate(nn.Sequential(blocks), list(blocks))
