"""What each block of a family computes, as plain data: the planner's view of a model.

A family describes its blocks with `block_shapes(args) -> list[BlockShape]` (optional; the
contract in model/__init__.py), one entry per FSDP unit in forward order. The planner
(parallel/plan.py, `python -m launch.plan`, `train.py --dry-run`) reads its parameters from the
model built on meta, and everything that depends on what the matrices *do* from here: the
activations kept for backward, the FLOPs per token, and the traffic of context parallel (keys
and values per block) and expert parallel (routed rows per MoE block). Blocks need not be
alike: a dense first block and MoE blocks after it, FFNs of different widths, a two-matrix MLP
beside SwiGLU experts, shared experts beside routed ones.

The description is checked against the model: the weights of a block's matrices (its
parameters of two or more dimensions) must be those `BlockShape.matrix_numel` counts. Norm
gains, biases and buffers are not described (they are 1-D or not parameters).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionShape:
    """Self-attention: q, k, v and output projections, no biases."""

    q_dim: int
    """n_heads x head_dim: what q projects to and the output projection reads."""
    kv_dim: int
    """n_kv_heads x head_dim: what k and v each project to."""

    def matrix_numel(self, dim: int) -> int:
        return 2 * dim * self.q_dim + 2 * dim * self.kv_dim


@dataclass(frozen=True)
class FFNShape:
    """A feed-forward network dim -> hidden -> dim of `matrices` weight matrices: 3 for a gated
    one (SwiGLU, GeGLU: gate, up, down), 2 for a plain MLP (up, activation, down)."""

    hidden: int
    matrices: int = 3

    def matrix_numel(self, dim: int) -> int:
        return self.matrices * dim * self.hidden

    def kept(self) -> int:
        """Elements per token autograd keeps: each up projection's output, and the activation
        and gating products between them and the down projection: 2 x (matrices - 1) x hidden
        (SwiGLU: w1 and w3 outputs, silu, product; a GeLU MLP: w1 output, gelu)."""
        return 2 * (self.matrices - 1) * self.hidden

    def matmul_outputs(self) -> int:
        """Elements per token of its up projections' outputs (what op-level AC keeps)."""
        return (self.matrices - 1) * self.hidden


@dataclass(frozen=True)
class ExpertsShape:
    """A mixture of experts: a router (a dim x n_experts matrix), `n_experts` routed FFNs of which
    each token uses `top_k`, and optionally a shared FFN that every token goes through. The
    layer runs whole on every tensor-parallel rank (TPStyle "replicate"), shared expert
    included."""

    n_experts: int
    top_k: int
    expert: FFNShape
    shared: FFNShape | None = None

    def matrix_numel(self, dim: int) -> int:
        shared = self.shared.matrix_numel(dim) if self.shared else 0
        return dim * self.n_experts + self.n_experts * self.expert.matrix_numel(dim) + shared


@dataclass(frozen=True)
class BlockShape:
    """One block: attention, then a dense FFN, routed experts, or both."""

    attention: AttentionShape
    ffn: FFNShape | None = None
    """A dense FFN every token goes through (split by tensor parallel)."""
    experts: ExpertsShape | None = None

    def matrix_numel(self, dim: int) -> int:
        """The weights of the block's matrices, as the model must hold them."""
        ffn = self.ffn.matrix_numel(dim) if self.ffn else 0
        experts = self.experts.matrix_numel(dim) if self.experts else 0
        return self.attention.matrix_numel(dim) + ffn + experts
