"""More families in ``tests.zoo`` (``tests.zoo.WIDER``): decoders (Phi, Persimmon, Nemotron, GPT-BigCode,
GPT-Neo, RecurrentGemma, Doge, Cohere2, Zamba2), encoders (ModernBERT, MobileBERT, DeBERTa, Funnel, XLNet,
BigBird, ConvBERT), encoder-decoders (mBART, Pegasus, M2M100, mT5, PLBart) and vision models (DeiT, BEiT,
DINOv2, SegFormer, ConvNeXt V2, RegNet, LeViT, MobileNetV2, MobileViT, PVTv2) under every shipped plan,
checked as ``tests/test_zoo.py`` checks the others.

The default tier runs the two cases that found bugs in plans of every model (mBART's ``squeeze()`` on
micro-batches of one sample, MobileBERT's shifted trigram input under context parallel); ``CUBE_SLOW=1``
runs the rest, and each fix has a test of its own (``tests/test_global_batch.py``,
``tests/test_time_shift.py``, ``tests/test_norm_rules.py``, ``tests/test_op_aliases.py``)."""
import pytest

from tests import zoo
from tests.test_zoo import cases, check

MINE = {("mbart", "pipeline_1"), ("mobilebert", "cp")}
CASES = [(m, p) for m in zoo.WIDER for p in zoo.PLANS]


@pytest.mark.parametrize("model,plan", cases(CASES, MINE))
def test_wider_model_under_plan_is_exact_or_refused_for_a_listed_reason(model, plan):
    check(model, plan)
