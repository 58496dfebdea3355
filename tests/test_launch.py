"""The linears example runs in one process and under torchrun with the same losses."""
import pytest

from tests.launch import ROOT, parity_across_ranks, single, torchrun

SCRIPT = ROOT / "examples" / "mlp" / "linears.py"
ARGS = ["--dim", "32", "--layers", "3", "--batch", "8", "--steps", "4"]


def _losses(stdout: str):
    # "step N: loss X | s/step | tok/s | ...": the step and loss, without the timings
    return [line.split(" | ")[0] for line in stdout.splitlines() if line.startswith("step ")]


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """The losses of the example in one process (its default policy, PASSingle), run once."""
    env = {"CUBE_CACHE_DIR": str(tmp_path_factory.mktemp("linears_single"))}
    return _losses(single(SCRIPT, ARGS, env).stdout)


@pytest.mark.multirank
def test_linears_single_dev_mode_and_torchrun_agree(one, tmp_path):
    env = {"CUBE_CACHE_DIR": str(tmp_path)}
    two = _losses(torchrun(SCRIPT, 2, ARGS, env).stdout)
    assert len(one) == 4
    assert one == two
    # a second launch reuses the cached per-rank code and gives the same losses
    again = torchrun(SCRIPT, 2, ARGS + ["--verbose"], env)
    assert _losses(again.stdout) == one
    assert "reused plan" in again.stderr


@pytest.mark.multirank
# the default tier: the example's replicated plan under torchrun (above), replicas in the plan fuzzer
@pytest.mark.slow
def test_replicated_plan_on_two_ranks_equals_plain_model(tmp_path):
    for r in parity_across_ranks("gpt", "cube.policies.single:PASSingle", 2, tmp_path):
        assert r["loss_err"] <= 1e-6, r
        assert r["param_err"] <= 1e-6, r


def test_gpt_example_runs_in_single_dev_mode(tmp_path):
    out = single(ROOT / "examples" / "gpt" / "train.py",
                 ["--layers", "1", "--dim", "32", "--seq", "16", "--batch", "4", "--steps", "2"],
                 {"CUBE_CACHE_DIR": str(tmp_path)})
    losses = [float(line.split()[-1]) for line in _losses(out.stdout)]
    # the plain model on the example's batches (each step's batch depends on the step number)
    import torch
    from examples.gpt.model import GPT, GPTConfig
    from examples.gpt.train import StepBatches
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=512, block_size=16, n_layer=1, n_head=4, n_embd=32)
    model = GPT(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref = []
    for _, batch in zip(range(2), StepBatches(config, 4)):
        loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    assert len(losses) == 2 and all(abs(a - b) <= 2e-6 for a, b in zip(losses, ref)), (losses, ref)


@pytest.mark.multirank
# the slow tier (CUBE_SLOW=1): PASData and PASRow, whose plans of this MLP tests/test_parallel.py checks
# on gloo ranks; PASMegatronTP stays the default tier's partitioned launch of the example
@pytest.mark.parametrize("policy", [pytest.param("PASData", marks=pytest.mark.slow), "PASMegatronTP",
                                    pytest.param("PASRow", marks=pytest.mark.slow)])
def test_linears_example_partitioned_prints_the_single_device_losses(one, policy, tmp_path):
    env = {"CUBE_CACHE_DIR": str(tmp_path)}
    two = _losses(torchrun(SCRIPT, 2, ARGS + ["--policy", policy], env).stdout)
    assert len(two) == 4 and two == one


@pytest.mark.multirank
def test_shutdown_leaves_no_communication_thread(tmp_path):
    """Exit takes the process groups down with their threads: a gloo thread left running while the
    interpreter finalizes aborts the process when it drops a tensor ("terminate called without an
    active exception", in about one run of fifty)."""
    import json
    from pathlib import Path
    if not Path("/proc/self/task").is_dir():
        pytest.skip("lists threads through /proc/self/task (Linux)")
    torchrun(ROOT / "tests" / "workers" / "shutdown_worker.py", 2, [tmp_path])
    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert any("gloo" in t for t in got["before"]), got   # the groups had threads to take down
        assert not [t for t in got["after"] if "gloo" in t], got


def test_releasing_torch_default_groups_prints_no_deprecation_warning():
    """The end of every multi-rank run walks torch.distributed's modules; touching the deprecated
    ``torch.distributed.reduce_op`` there printed a FutureWarning each time."""
    import warnings

    import torch.distributed.nn.functional  # noqa: F401 - a module whose functions hold a group default
    from cube.runtime import device
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        device._release_default_groups()
    assert not [w for w in caught if "reduce_op" in str(w.message)], [str(w.message) for w in caught]
