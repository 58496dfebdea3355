"""Runs on every rank: GPT-2 with dropout 0.1 through cube with ``exact_rng=True`` and eagerly.

    torchrun --nproc_per_node=N tests/workers/dropout_worker.py POLICY NMICROS OUTDIR

Every process has its own default generator (unlike the in-process world), seeded alike as one
process would be. Each rank writes its largest relative loss and parameter errors over two SGD
steps, and whether its generator ended where the plain model's does, to OUTDIR/rank{r}.json.
"""
import copy
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import cube  # noqa: E402
from cube.policy import load_policy  # noqa: E402
from tests.inprocess import eager_reference, optimizer  # noqa: E402
from tests.parity import global_batches, rel  # noqa: E402
from tests.test_dropout import SEED, _gpt2  # noqa: E402


def main():
    policy, nmicros, outdir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    env = cube.init()
    model, sample = _gpt2(4 // nmicros)
    batches = global_batches(sample, 2, nmicros)
    torch.manual_seed(SEED)
    ref_losses, ref_params = eager_reference(model, batches, optimizer("sgd"))
    ref_state = torch.get_rng_state()
    it = iter(batches)
    options = {"nmicros": nmicros} if nmicros > 1 else {}

    @cube.compile(copy.deepcopy(model), it, PAS=load_policy(policy), options=options,
                  cache_dir=os.path.join(outdir, "cache"), exact_rng=True)
    def train_iter(model, dataloader):
        data = next(dataloader)
        loss = model(*data)
        loss.backward()
        return loss
    gen = cube.load_model()
    opt = torch.optim.SGD(gen.parameters(), lr=1e-2)
    torch.manual_seed(SEED)
    losses = []
    for _ in range(2):
        losses.append(train_iter(gen, it).detach())
        opt.step()
        opt.zero_grad()
    loss_err = max(rel(a, b) for a, b in zip(losses, ref_losses))
    param_err = 0.0
    for local, p in gen.named_parameters():
        names, splits = gen.PARAMS[local]
        ref = cube.runtime.piece(ref_params[names[0]], splits)
        err = (p.detach().double() - ref.detach().double()).norm().item() / \
            max(ref.detach().double().norm().item(), 1e-3 * ref.numel() ** 0.5)
        param_err = max(param_err, err)
    out = {"rank": env.rank, "loss": loss_err, "params": param_err,
           "generator": bool(torch.equal(torch.get_rng_state(), ref_state))}
    with open(os.path.join(outdir, f"rank{env.rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
