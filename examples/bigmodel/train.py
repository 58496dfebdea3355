"""Train a model no rank holds whole: a Hugging Face Llama built on the meta device.

    torchrun --nproc_per_node=4 examples/bigmodel/train.py              # tp2 x pp2, 1F1B
    SINGLE_DEV_MODE=1 python examples/bigmodel/train.py                  # the same steps in one process
    torchrun --nproc_per_node=4 examples/bigmodel/train.py --weights DIR --per-rank-data
    python -m cube.sim examples/bigmodel/train.py --ngpus 4 --policy PASData --estimate   # predicted step

The recipe:

1. build the model under ``torch.device("meta")``: parameters are shapes only;
2. ``cube.compile(model, dataloader, PAS=...)`` traces it with fake tensors;
3. ``cube.load_model(init=model._init_weights)`` gives each rank only its pieces,
   materializing one module at a time (equal to ``model.to_empty("cpu");
   model.apply(init)`` on one device from the same seed), or
   ``cube.load_model(weights=DIR)`` reads only this rank's slices of a Hugging
   Face sharded safetensors directory (``save_pretrained`` or
   ``cube.merge_checkpoint(path, out=DIR, strip_prefix="model.")``);
4. ``cube.build_optimizer`` (the ZeRO stage comes from ``compile(zero=)``).

The policy is ``PASMegatron(tp, pp, nmicros)``: each step takes one global
batch of ``--batch`` sequences from the loader and cuts it into ``--nmicros``
micro-batches for the pipeline; the printed loss is the loss of that whole
batch, the same in one process (tp = pp = 1) as on 4 ranks.

Data: the compiled step takes global-shaped batches. ``cube.runtime.data.part()``
says which batch tensors this rank's ops read and which rows of them
(``dp_rank`` of ``dp_size`` along dim 0): with ``--per-rank-data`` the loader
builds only those (every row is drawn from its own seed, so a row is the same
whoever makes it) and leaves zeros elsewhere, as a loader reading from disk
would read only its rows. A rank that reads no batch tensor at all (a middle
stage, e.g. ``--tp 1 --pp 4``) is never asked for a batch after compile.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import cube  # noqa: E402
from cube.models import CausalLM  # noqa: E402
from cube.policies.megatron3d import PASMegatron  # noqa: E402


class Batches:
    """Global batch ``i`` of ``(input_ids, labels)``, row ``r`` drawn from seed ``(i, r)``.

    Attributes:
        part: None (make whole batches), or a ``cube.runtime.data.BatchPart``: make
            only the tensors and rows this rank reads, zeros elsewhere.
        taken: batches handed out.
    """

    def __init__(self, rows: int, seq: int, vocab: int):
        self.rows, self.seq, self.vocab = rows, seq, vocab
        self.index, self.taken, self.part = 0, 0, None

    def __iter__(self):
        return self

    def _row(self, r: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1000003 * self.index + r)
        return torch.randint(0, self.vocab, (self.seq,), generator=gen)

    def __next__(self):
        part = self.part
        lo, hi = 0, self.rows
        if part is not None:   # this rank's rows along the batch dim
            lo, hi = part.dp_rank * self.rows // part.dp_size, (part.dp_rank + 1) * self.rows // part.dp_size
        ids = torch.zeros(self.rows, self.seq, dtype=torch.long)
        for r in range(lo, hi):
            ids[r] = self._row(r)
        self.index += 1
        self.taken += 1
        if part is None:
            return ids, ids.clone()   # HF shifts the labels itself
        return tuple(ids.clone() if item is not None else torch.zeros_like(ids) for item in part.items)


def meta_model(hidden: int = 128, layers: int = 4, intermediate: int = 352, heads: int = 4, kv_heads: int = 2,
               vocab: int = 1024, seq: int = 64):
    """The Llama, built on the meta device (shapes only: nothing is allocated)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=seq, use_cache=False,
                         attention_dropout=0.0, attn_implementation="eager")
    with torch.device("meta"):
        return CausalLM(LlamaForCausalLM(config))


def build(rows: int = 8, seq: int = 64, vocab: int = 1024):
    """The meta model and one batch of ``rows`` sequences (what ``python -m cube.sim
    examples/bigmodel/train.py`` plans; the simulator splits it as the policy says)."""
    return meta_model(seq=seq, vocab=vocab), next(Batches(rows, seq, vocab))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=352)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="global batch (sequences per step)")
    ap.add_argument("--nmicros", type=int, default=2, help="micro-batches per step")
    ap.add_argument("--tp", type=int, default=2, help="tensor parallel degree (1 in one process)")
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages (1 in one process)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0, help="the seed init draws from")
    ap.add_argument("--weights", default=None, help="a Hugging Face safetensors directory of the LlamaForCausalLM")
    ap.add_argument("--per-rank-data", action="store_true", help="make only what cube.runtime.data.part() reads")
    ap.add_argument("--log-every", type=int, default=1, help="steps between metrics lines")
    ap.add_argument("--metrics-csv", default=None, metavar="PATH", help="append every step's metrics to PATH")
    args = ap.parse_args(argv)
    if args.batch % args.nmicros:
        raise ValueError(f"--batch {args.batch} must be a multiple of --nmicros {args.nmicros}")

    env = cube.init()
    tp, pp = (args.tp, args.pp) if env.world_size > 1 else (1, 1)
    model = meta_model(args.hidden, args.layers, args.intermediate, args.heads, args.kv_heads, args.vocab, args.seq)
    dataloader = Batches(args.batch, args.seq, args.vocab)   # the global batch; the pipeline cuts it

    @cube.compile(model, dataloader, PAS=functools.partial(PASMegatron, tp=tp, pp=pp, nmicros=args.nmicros))
    def train_iter(model, dataloader):
        input_ids, labels = next(dataloader)
        loss = model(input_ids, labels)
        loss.backward()
        return loss

    part = cube.runtime.data.part()
    if args.per_rank_data:
        dataloader.part = part   # compile's first (whole) batch is still handed to the first step
    taken_at_compile = dataloader.taken
    torch.manual_seed(args.seed)   # every rank draws the single-device init's random numbers
    if args.weights:
        model = cube.load_model(weights=args.weights, init=model.model._init_weights, rename=lambda k: "model." + k)
    else:
        model = cube.load_model(init=model.model._init_weights)
    optimizer = cube.build_optimizer(model, torch.optim.AdamW, lr=args.lr)
    # each line: "step N: loss X | s/step | tok/s | MFU | peak memory" (rank 0)
    metrics = cube.Metrics(model, tokens_per_step=args.batch * args.seq, log_every=args.log_every,
                           csv=args.metrics_csv, total_steps=args.steps, loss_format=".7f")
    for step in range(args.steps):
        loss = train_iter(model, dataloader)
        optimizer.step()
        optimizer.zero_grad()
        metrics.step(loss)
    reads = [i for i, item in enumerate(part.items) if item is not None]
    print(f"rank {env.rank}: reads batch tensors {reads} (rows part {part.dp_rank} of {part.dp_size}), "
          f"took {dataloader.taken - taken_at_compile} batches after compile", flush=True)


if __name__ == "__main__":
    main()
