"""One batch of routing decisions, validated once so every policy and metric can trust it.

Layout (DESIGN.md section 2): a *route* is one (token, MoE layer) decision, the set of top-k
experts chosen for that token at that layer. Tokens are flattened: a verl batch
``[batch, seq, layers, topk]`` becomes ``[batch * seq, layers, topk]`` with a valid-token mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_INTEGER_DTYPES = (torch.int16, torch.int32, torch.int64, torch.uint8, torch.int8)


class RoutesError(ValueError):
    """A routing batch that does not satisfy the Routes contract."""


@dataclass(frozen=True, eq=False)
class Routes:
    """Routing decisions of one batch.

    Attributes:
        rollout: ``[tokens, layers, topk]`` integer expert ids recorded by the inference engine.
        valid: ``[tokens]`` bool; False for padding (and for tokens a backend chooses not to count).
        num_experts: experts per MoE layer; every id on a valid token lies in ``[0, num_experts)``.
        native: optional ``[tokens, layers, topk]`` ids the training router picks by itself.
        router_logits: optional ``[tokens, layers, num_experts]`` training router logits.

    Ids on invalid tokens are never read (verl fills padding with zeros, which would otherwise
    look like duplicate experts), so they are not validated either.
    """

    rollout: Tensor
    valid: Tensor
    num_experts: int
    native: Tensor | None = None
    router_logits: Tensor | None = None

    def __post_init__(self) -> None:
        _check_route_tensor("rollout", self.rollout)
        tokens, layers, topk = self.rollout.shape
        if self.valid.dim() != 1 or self.valid.shape[0] != tokens:
            raise RoutesError(
                f"valid has shape {tuple(self.valid.shape)}: expected [tokens]=[{tokens}] "
                f"matching rollout {tuple(self.rollout.shape)}"
            )
        if self.valid.dtype != torch.bool:
            object.__setattr__(self, "valid", self.valid.bool())
        if isinstance(self.num_experts, bool) or int(self.num_experts) != self.num_experts:
            raise RoutesError(f"num_experts={self.num_experts!r}: expected a positive integer")
        object.__setattr__(self, "num_experts", int(self.num_experts))
        if self.num_experts < 1:
            raise RoutesError(f"num_experts={self.num_experts}: expected a positive integer")
        if topk > self.num_experts:
            raise RoutesError(f"topk={topk} > num_experts={self.num_experts}: a route cannot pick more experts than exist")
        if topk < 1 or layers < 1:
            raise RoutesError(f"rollout has shape {tuple(self.rollout.shape)}: expected at least one layer and topk >= 1")
        if not bool(self.valid.any()):
            raise RoutesError(f"the batch has no valid token (valid is all False over {tokens} tokens)")
        _check_ids("rollout", self.rollout, self.valid, self.num_experts)
        if self.native is not None:
            _check_route_tensor("native", self.native)
            if self.native.shape != self.rollout.shape:
                raise RoutesError(
                    f"native has shape {tuple(self.native.shape)}: expected the rollout shape {tuple(self.rollout.shape)}"
                )
            _check_ids("native", self.native, self.valid, self.num_experts)
        if self.router_logits is not None:
            expected = (tokens, layers, self.num_experts)
            if tuple(self.router_logits.shape) != expected:
                raise RoutesError(
                    f"router_logits has shape {tuple(self.router_logits.shape)}: expected [tokens, layers, num_experts]={expected}"
                )
        for name in ("valid", "native", "router_logits"):
            tensor = getattr(self, name)
            if tensor is not None and tensor.device != self.rollout.device:
                raise RoutesError(f"{name} is on {tensor.device} but rollout is on {self.rollout.device}: keep one device")

    @property
    def num_tokens(self) -> int:
        return self.rollout.shape[0]

    @property
    def num_layers(self) -> int:
        return self.rollout.shape[1]

    @property
    def topk(self) -> int:
        return self.rollout.shape[2]

    @property
    def device(self) -> torch.device:
        return self.rollout.device

    @property
    def num_valid_tokens(self) -> int:
        return int(self.valid.sum())

    @property
    def num_valid_routes(self) -> int:
        """``N`` of DESIGN.md: valid tokens times MoE layers."""
        return self.num_valid_tokens * self.num_layers

    def valid_routes(self) -> Tensor:
        """``[tokens, layers]`` bool: True on every route of a valid token."""
        return self.valid[:, None].expand(self.num_tokens, self.num_layers)

    @classmethod
    def from_verl(
        cls,
        routed_experts: Tensor,
        mask: Tensor,
        num_experts: int | None = None,
        native: Tensor | None = None,
    ) -> Routes:
        """Build routes from verl's layout.

        Args:
            routed_experts: ``[batch, seq, layers, topk]`` (verl's batch key ``routed_experts``,
                int16, left-padded).
            mask: ``[batch, seq]`` attention or response mask; nonzero marks a valid token.
            num_experts: experts per layer. When omitted it is inferred as ``max id + 1`` over valid
                tokens, which cannot catch out-of-range ids: pass it whenever it is known.
            native: optional native routes in the same ``[batch, seq, layers, topk]`` layout.
        """
        if routed_experts.dim() != 4:
            raise RoutesError(
                f"routed_experts has shape {tuple(routed_experts.shape)}: expected [batch, seq, layers, topk]"
            )
        batch, seq, layers, topk = routed_experts.shape
        if tuple(mask.shape) != (batch, seq):
            raise RoutesError(f"mask has shape {tuple(mask.shape)}: expected [batch, seq]=[{batch}, {seq}]")
        valid = mask.reshape(-1).bool()
        rollout = routed_experts.reshape(batch * seq, layers, topk)
        if num_experts is None:
            if not bool(valid.any()):
                raise RoutesError(f"the batch has no valid token (mask is all zero over {batch * seq} tokens)")
            num_experts = int(rollout[valid].max()) + 1
        flat_native = None if native is None else native.reshape(batch * seq, layers, topk)
        return cls(rollout=rollout, valid=valid, num_experts=num_experts, native=flat_native)

    def to_verl(self, batch: int, seq: int, dtype: torch.dtype = torch.int16) -> Tensor:
        """Back to ``[batch, seq, layers, topk]``; invalid tokens hold zeros, as verl pads them."""
        if batch * seq != self.num_tokens:
            raise RoutesError(f"batch * seq = {batch} * {seq} = {batch * seq}: expected the {self.num_tokens} tokens of these routes")
        out = torch.where(self.valid[:, None, None], self.rollout, torch.zeros_like(self.rollout))
        return out.to(dtype).reshape(batch, seq, self.num_layers, self.topk)


def mask_to_verl(mask: Tensor, batch: int, seq: int) -> Tensor:
    """A ``[tokens, layers]`` replay mask in verl's ``[batch, seq, layers]`` layout."""
    if mask.dim() != 2 or mask.shape[0] != batch * seq:
        raise RoutesError(f"mask has shape {tuple(mask.shape)}: expected [batch * seq, layers] with batch * seq = {batch * seq}")
    return mask.reshape(batch, seq, mask.shape[1])


def _check_route_tensor(name: str, tensor: Tensor) -> None:
    if not isinstance(tensor, Tensor):
        raise RoutesError(f"{name} is a {type(tensor).__name__}: expected a torch.Tensor [tokens, layers, topk]")
    if tensor.dim() != 3:
        raise RoutesError(f"{name} has shape {tuple(tensor.shape)}: expected rank 3 [tokens, layers, topk]")
    if tensor.dtype not in _INTEGER_DTYPES:
        raise RoutesError(f"{name} has dtype {tensor.dtype}: expected an integer dtype (int16 or wider)")


def _check_ids(name: str, ids: Tensor, valid: Tensor, num_experts: int) -> None:
    """Range and uniqueness of expert ids on valid tokens, without materialising [T, L, K, K]."""
    on_valid = ids[valid]
    low, high = int(on_valid.min()), int(on_valid.max())
    if low < 0 or high >= num_experts:
        bad = low if low < 0 else high
        where = (on_valid == bad).nonzero()[0].tolist()
        token = int(valid.nonzero()[where[0]])
        raise RoutesError(
            f"{name} holds expert id {bad} at token {token}, layer {where[1]}: expected ids in [0, {num_experts})"
        )
    topk = ids.shape[-1]
    for k in range(1, topk):
        clash = (on_valid[..., k : k + 1] == on_valid[..., :k]).any(-1)
        if bool(clash.any()):
            row, layer = clash.nonzero()[0].tolist()
            token = int(valid.nonzero()[row])
            raise RoutesError(
                f"{name} picks expert {int(on_valid[row, layer, k])} twice at token {token}, layer {layer}: "
                "expected distinct experts within one route"
            )


def overlap_count(a: Tensor, b: Tensor) -> Tensor:
    """``[tokens, layers]`` number of experts two route tensors ``[tokens, layers, topk]`` share.

    Loops over the top-k slots (8 for Qwen3-style models) rather than broadcasting to
    ``[T, L, K, K]``, which would need K times the memory of the routes themselves.
    """
    shared = torch.zeros(a.shape[:2], dtype=torch.int32, device=a.device)
    for k in range(a.shape[-1]):
        shared += (a[..., k : k + 1] == b).any(-1)
    return shared
