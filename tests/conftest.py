"""Fixtures every test file may use without importing them (plain helpers: helpers.py, toy models: toy.py)."""
import pytest
import torch


@pytest.fixture
def no_tf32():
    """TF32 off for matmul and cuDNN during the test (exact fp32 comparisons on the GPU)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
