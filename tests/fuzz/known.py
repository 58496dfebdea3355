"""Plans the fuzzer found failing, and why (the fast tier's seeds, and the long tier's run
``--seed 1000 --plans 240``).

``FOUND``: every plan found failing, with the bug it showed; each is a regression test in
``tests/fuzz/test_regressions.py``. ``KNOWN``: those still failing (bugs not fixed yet): their
regression tests are strict xfails and the fast tier reports them without failing; any other
wrong, crash or hang fails it. A fix moves an entry out of ``KNOWN``.
"""
from __future__ import annotations

PER_STAGE_REPLICATION = ("a stage replicated on several devices after a stage on fewer devices: the earlier "
                         "stage's parameter gradients come out wrong (the replicas' gradients of the value "
                         "sent back are summed instead of counted once)")

REPLICA_GROUP_MISMATCH = ("a value made by an op replicated on some devices and read by ops replicated on more "
                          "devices (no schedule): the producer's parameter gradients come out wrong on the device "
                          "that sends the value to the extra reader (its gradient sent back is added on top)")

T5_DATA_PARALLEL = ("T5 split along the batch over two devices (the batch flow of PASData, data op split or "
                    "replicated, with or without a schedule) trains wrong: the loss is already off by about 4% "
                    "at the first step (forward), while the same model replicated on two devices, or on one, is "
                    "exact")

THREADWORLD_P2POP = ("cube.debug's in-process world: collectives.all_to_all_data builds dist.P2POp(dist.isend, ...), "
                     "and torch's P2POp rejects the in-process isend (threadworld installs different wrappers "
                     "in torch.distributed and distributed_c10d, so `op in (isend, irecv)` fails): "
                     "ValueError 'Invalid op' at run time on every plan that needs an all-to-all")

REPLICA_READER_DEADLOCK = ("a value read by replicas of one op on ranks that also run a collective after it (tensor "
                           "parallel base, one linear on one device, recompute): the replica that does not return "
                           "the gradient read it detached, so its collectives had no backward and the other rank "
                           "hung; and a receive moved to the edge of a recompute run split an op from its "
                           "collective on one rank only")

SCALAR_EXCHANGE_CHECK = ("the loss's partial sum (a scalar) read by ranks that do not make it: the exchange's "
                         "proof took a scalar's box () for an empty overlap and refused a correct plan")

SHAPE_ONLY_READ = ("a value read by an op whose output reaches no loss (BART's encoder reads the embeddings "
                   "for their shape only), placed so that the value moves point to point: the sender waited in "
                   "backward for a gradient the reader never computes (hang)")

TIED_MIXED_READINGS = ("a tied weight read whole on one device group and both whole (replicated LM head) and "
                       "batch-split on another: refused at compile ('mix whole and split readings') though one "
                       "sum over all the readers' devices, with one copy of each replicated reader's gradient "
                       "kept, is exact")

TIED_BUCKET_ORDER = ("a tied weight read by other ops on other ranks of its sum's group: its gradient is ready at "
                     "another point of backward on each rank, and the bucket all-reduce launched from there met "
                     "another rank's all-gather of an activation in the same group (mismatched collectives)")

CUT_RECOMPUTE_RUN = ("a recompute group holding collectives whose stretch a point-to-point transfer cuts on some "
                     "ranks only: those ranks re-ran its collectives in two runs at two points of backward, the "
                     "others in one (collectives in another order on each member)")

TIED_HALVES_AND_WHOLE = ("a tied weight held in halves on one pipeline stage (embedding split along its hidden dim) "
                         "and whole on the other (replicated LM head): its gradient sum paired a device holding "
                         "half the weight with one holding all of it (mismatched buckets)")

DROPPED_TIED_COPY = ("a tied weight's copy read detached on one rank: the values made from it no longer needed a "
                     "gradient there (while the plan and the other ranks said they did), so a send to another "
                     "stage waited for no gradient (hang) and a stash to a later stage kept one")

FOUND = {
    ("hf_bart", 101874): DROPPED_TIED_COPY,
    ("hf_t5", 101553): DROPPED_TIED_COPY,
    ("gpt_nobias", 100736): TIED_HALVES_AND_WHOLE,
    ("mlp", 100630): CUT_RECOMPUTE_RUN,
    ("gpt_nobias", 100231): TIED_BUCKET_ORDER,
    ("hf_bart", 5104): SHAPE_ONLY_READ,
    ("hf_t5", 1103): TIED_MIXED_READINGS,
    ("mlp", 5025): SCALAR_EXCHANGE_CHECK,
    ("mlp", 67): REPLICA_READER_DEADLOCK,
    ("mlp", 33): PER_STAGE_REPLICATION,
    ("mlp", 65): PER_STAGE_REPLICATION,
    ("mlp", 69): REPLICA_GROUP_MISMATCH,
    ("mlp", 1036): THREADWORLD_P2POP,
    ("mlp", 1064): PER_STAGE_REPLICATION,
    ("mlp", 1108): PER_STAGE_REPLICATION,
    ("gpt_nobias", 10): THREADWORLD_P2POP,
    ("gpt_nobias", 1081): PER_STAGE_REPLICATION,
    ("gpt_nobias", 1085): THREADWORLD_P2POP,
    ("gpt_nobias", 1165): THREADWORLD_P2POP,
    ("hf_llama", 1078): PER_STAGE_REPLICATION,
    ("hf_llama", 1186): PER_STAGE_REPLICATION,
    ("hf_t5", 1039): THREADWORLD_P2POP,
    ("hf_t5", 1115): T5_DATA_PARALLEL,
    ("hf_t5", 1127): THREADWORLD_P2POP,
}


# plans failing today because of a bug not fixed yet: the fast tier reports them without failing,
# and their regression tests are strict xfails (a fix turns them into unexpected passes)
KNOWN: dict = {}
