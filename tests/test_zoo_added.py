"""The model families added to ``tests.zoo`` after its first table (``tests.zoo.ADDED``: BLOOM, GPT-J,
OLMo, Gemma 3, MPT, XGLM, the MoE routers of GraniteMoE, GPT-OSS, DeepSeek-V3 and PhiMoE, Mamba,
Mamba-2, RWKV, ALBERT, DeBERTa-v2, ...) under every shipped plan, checked as ``tests/test_zoo.py``
checks the others (a file of their own, so two test workers share the table).

The default tier runs each under a pipeline of two micro-batches and a few under the plans their
changes were about; ``CUBE_SLOW=1`` runs the rest."""
import pytest

from tests import zoo
from tests.test_zoo import FAST, cases, check, holds_a_tp_th

MINE = FAST | {("granitemoe", "tensor"), ("gpt_oss", "tensor"), ("deepseek_v3", "tensor"), ("gpt_oss", "data"),
               ("mamba2", "pipeline_1"), ("xglm", "pipeline_1"), ("phimoe", "tensor"), ("bloom", "tensor"),
               ("xglm", "tensor"), ("deberta_v2", "tensor")}
CASES = [(m, p) for m in zoo.ADDED for p in zoo.PLANS]


@pytest.mark.parametrize("model,plan", cases(CASES, MINE))
def test_added_model_under_plan_is_exact_or_refused_for_a_listed_reason(model, plan):
    check(model, plan)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", [m for m in zoo.TRANSFORMERS if m in zoo.ADDED])
def test_tensor_parallel_holds_a_tp_th_of_every_block_linear(name, tp):
    holds_a_tp_th(name, tp)
