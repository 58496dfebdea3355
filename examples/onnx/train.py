"""Train an ONNX model with cube: export a GPT from PyTorch to ONNX, import it, train it
distributed, write the trained weights back into the ONNX file, and check onnxruntime runs it.

    SINGLE_DEV_MODE=1 python examples/onnx/train.py --policy PASSingle
    torchrun --nproc_per_node=2 examples/onnx/train.py --policy PASMegatronTP

The model comes in as ``--onnx FILE`` (any file ``cube.onnx.load`` imports whose forward returns
the loss) or, by default, is exported here from ``examples/gpt``'s GPT (forward = mean
cross-entropy) with ``torch.onnx.export`` on rank 0. Every rank imports the same file with
``cube.onnx.load``; the plan and the training are those of any module. At the end the
distributed weights are merged (``cube.merge_checkpoint``) and ``cube.onnx.save`` writes them
into a copy of the imported graph (``--out``), which onnxruntime then runs on the last batch:
its loss equals the trained module's.
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import cube  # noqa: E402
import cube.onnx  # noqa: E402
from cube.policy import resolve  # noqa: E402
from examples.gpt.model import GPT, GPTConfig  # noqa: E402
from examples.gpt.train import StepBatches  # noqa: E402


def export_gpt(path: Path, layers: int, dim: int, heads: int, seq: int, batch: int) -> Path:
    """``examples/gpt``'s GPT exported to ONNX, loss included, for batches of ``batch x seq`` tokens."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=512, block_size=seq, n_layer=layers, n_head=heads, n_embd=dim)
    model = GPT(config).eval()
    sample = next(StepBatches(config, batch))
    with warnings.catch_warnings():   # the exporter's notes on its own passes
        warnings.simplefilter("ignore")
        # optimize=False keeps every parameter an initializer of its own name (the optimizer folds
        # transposes into unnamed constants and merges equal ones, e.g. fresh LayerNorm weights)
        torch.onnx.export(model, sample, str(path), input_names=["idx", "targets"], dynamo=True,
                          optimize=False, verbose=False)
    return path


def _barrier():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def build(layers: int = 2, dim: int = 128, heads: int = 4, seq: int = 64, batch: int = 8):
    """The imported model and its first global batch (what ``python -m cube.sim examples/onnx/train.py`` plans)."""
    path = Path(tempfile.gettempdir()) / f"cube-onnx-gpt-{layers}-{dim}-{heads}-{seq}-{batch}.onnx"
    if not path.exists():
        export_gpt(path, layers, dim, heads, seq, batch)
    config = GPTConfig(vocab_size=512, block_size=seq, n_layer=layers, n_head=heads, n_embd=dim)
    return cube.onnx.load(path).train(), next(StepBatches(config, batch))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="PASSingle", help="a shipped policy name, or 'file.py:Name'")
    parser.add_argument("--onnx", type=Path, default=None, help="the ONNX file to train (default: export a GPT)")
    parser.add_argument("--out", type=Path, default=Path("trained.onnx"), help="where the trained model goes")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="global batch size (the exported graph's)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--log-every", type=int, default=2)
    parser.add_argument("--verbose", action="store_true", help="log compile phases")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")

    env = cube.init()
    work = args.out.parent.resolve() / f".{args.out.name}.work"
    source = args.onnx
    if source is None:   # rank 0 exports, the others wait for the file
        source = work / "gpt.onnx"
        if env.rank == 0:
            work.mkdir(parents=True, exist_ok=True)
            export_gpt(source, args.layers, args.dim, args.heads, args.seq, args.batch)
        _barrier()
    model = cube.onnx.load(source).train()
    config = GPTConfig(vocab_size=512, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.dim)
    dataloader = StepBatches(config, args.batch)
    imported = model

    @cube.compile(model, dataloader, PAS=resolve(args.policy))
    def train_iter(model, dataloader):
        data = next(dataloader)
        loss = model(*data)
        loss.backward()
        return loss

    model = cube.load_model()
    optimizer = cube.build_optimizer(model, torch.optim.AdamW, lr=1e-3)
    metrics = cube.Metrics(model, tokens_per_step=args.batch * args.seq, log_every=args.log_every,
                           total_steps=args.steps, loss_format=".6f")
    for _ in range(args.steps):
        loss = train_iter(model, dataloader)
        optimizer.step()
        optimizer.zero_grad()
        metrics.step(loss)

    ckpt = work / "ckpt"
    cube.save_checkpoint(ckpt, model, optimizer)
    _barrier()
    if env.rank == 0:   # merged weights -> the imported graph -> onnxruntime on the next batch
        weights, _ = cube.merge_checkpoint(ckpt)
        out = cube.onnx.save(imported, args.out, state_dict=weights)
        idx, targets = next(dataloader)
        imported.load_state_dict(weights)
        with torch.no_grad():
            mine = float(imported.eval()(idx, targets))
        try:
            import onnxruntime
        except ImportError:
            print(f"trained model written to {out} (install onnxruntime to run it)")
            return
        session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
        theirs = float(session.run(None, {"idx": idx.numpy(), "targets": targets.numpy()})[0])
        print(f"trained model written to {out}; next batch's loss: onnxruntime {theirs:.6f}, "
              f"trained module {mine:.6f} (rel {abs(theirs - mine) / abs(mine):.1e})")


if __name__ == "__main__":
    main()
