"""Settings that must be in place before any test module imports cbpipe."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Triton kernels run in Triton's CPU interpreter; the variable is read when the kernels'
    # decorators run, so it is set here, before any test module can import them.
    os.environ.setdefault("TRITON_INTERPRET", "1")
