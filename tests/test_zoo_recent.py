"""The model families of 2025 in ``tests.zoo`` (``tests.zoo.RECENT``): hybrids of Mamba-2 mixers and
attention (Bamba, Falcon-H1, Granite 4's MoE hybrid, Nemotron-H), LFM2's short convolutions, linear
attention (Qwen3-Next's gated delta rule, MiniMax's lightning attention, Kimi Linear), Falcon-Mamba,
the MoE routers of GLM-4.5, ERNIE 4.5, dots.llm1, Hunyuan-A13B and Llama 4, and OLMo 3, Apertus,
Seed-OSS, EXAONE 4 and BitNet, under every shipped plan, checked as ``tests/test_zoo.py`` checks the
others (a file of their own, so two test workers share the table).

The default tier runs one family of each kind under a pipeline of two micro-batches and a few under
tensor and sequence parallel; ``CUBE_SLOW=1`` runs the rest."""
import pytest

from tests import zoo
from tests.test_zoo import cases, check, holds_a_tp_th

# one case of each kind in the default tier (each of these models takes 10-60 s a plan on a CPU)
MINE = {(m, "pipeline") for m in ("bamba", "lfm2", "falcon_mamba", "minimax", "kimi_linear", "glm4_moe", "llama4",
                                  "bitnet")} | {
    ("qwen3_next", "tensor"), ("bamba", "tensor"), ("nemotron_h", "sp"), ("lfm2", "tensor")}
CASES = [(m, p) for m in zoo.RECENT for p in zoo.PLANS]


@pytest.mark.parametrize("model,plan", cases(CASES, MINE))
def test_recent_model_under_plan_is_exact_or_refused_for_a_listed_reason(model, plan):
    check(model, plan)



@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", [m for m in zoo.TRANSFORMERS if m in zoo.RECENT])
def test_tensor_parallel_holds_a_tp_th_of_every_block_linear(name, tp):
    holds_a_tp_th(name, tp)
