"""PASSingle through cube equals eager training for every model family."""
import pytest
import torch

from cube.policies.single import PASSingle
from tests.models import MODELS, build
from tests.parity import check_parity


@pytest.mark.parametrize("name", MODELS)
def test_single_device_parity(name, tmp_path):
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
    model, sample = build(name)
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(5):  # five different batches shaped like the sample
        batch = []
        for t in sample:
            if t.dtype.is_floating_point:
                batch.append(torch.randn(t.shape, generator=gen))
            else:
                hi = int(t.max()) + 1
                batch.append(torch.randint(0, hi, t.shape, generator=gen))
        batches.append(tuple(batch))
    # GPT-2's fused c_attn bias holds the key bias, whose gradient is zero by construction (softmax
    # ignores a shift): cube computes q, k and v as three projections (cube.trace.fused), whose
    # round-off differs from the fused one's, and AdamW turns that round-off into updates of size lr
    # (tests/models.py); SGD's update is linear in the gradient
    opt = "sgd" if name == "hf_gpt2" else "adamw"
    check_parity(model, batches, 5, PASSingle, tmp_path, rtol=1e-6, opt=opt)
