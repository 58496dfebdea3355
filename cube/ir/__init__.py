"""cube's IR: tensors, operators, the graph and partition annotations."""
from cube.ir.annotation import OpAnno, parse as parse_annotation
from cube.ir.graph import IRGraph
from cube.ir.operator import IRDataOperation, IRFwOperation, IROperator
from cube.ir.tensor import IRTensor, TensorKind

__all__ = ["IRGraph", "IROperator", "IRFwOperation", "IRDataOperation", "IRTensor", "TensorKind",
           "OpAnno", "parse_annotation"]
