"""The one interface every replay policy implements, and the registry that names them."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor

from ablate.budget import (
    Quotas,
    check_budget,
    count_for,
    global_quotas,
    layer_quotas,
    per_sequence_quotas,
    sequence_counts,
)
from ablate.config import PolicyConfig
from ablate.policies.selection import Draws, segmented_top_n, top_n
from ablate.routes import Routes

#: What ``select`` accepts as ``generator``: one generator, one per sequence, or None (torch's global RNG).
Generators = torch.Generator | Sequence[torch.Generator] | None


class PolicyError(ValueError):
    """An unknown policy, an unknown policy setting, or inputs a policy cannot work with."""


class ReplayPolicy(ABC):
    """Maps (routes, budget, policy state, generator) to a replay mask ``[tokens, layers]``.

    Budget accounting is not the policy's business: :meth:`select` computes the counts with the
    shared rule (:mod:`ablate.budget`) and asks the subclass only for a ranking of the valid
    routes (:meth:`route_keys`), then keeps the top ``n`` of each group (or the top quota of each
    layer with ``per_layer=True``). That makes "same count for every policy" true by
    construction rather than by each policy's care.

    After each call, :attr:`info` holds policy-specific diagnostics of that call (for example
    ``fisher_fallback``).

    What the runner, the backends and the analysis need to know of a policy is declared here, as
    class traits, so that no code outside this package tests a policy's name:

    - :attr:`Settings`: the policy's config schema, a dataclass extending
      :class:`ablate.config.PolicyConfig` whose fields (beyond ``name`` and ``fisher``) are the
      keyword settings of ``__init__``, with the same defaults (checked when it is registered).
    - :attr:`fixed_budget`: the budget the policy has by definition (``none``: 0, ``full``: 1), or
      None when the cell's budget decides.
    - :attr:`needs_native_routes`: the policy selects from ``Routes.native`` (and
      ``Routes.native_margin``), which a backend records in a pass that replays nothing.
    - :attr:`gates_slots`: the policy's mask offers routes, and a gate where the mask is applied
      keeps or hands back each replayed expert by the trainer's router scores: the policy defines
      ``gate(scores, replayed, native) -> (used, replaced)`` (:class:`ablate.policies.ThresholdReplay`),
      and a backend applies it there or refuses the policy. What such a policy spends is what its
      gate lets through (``replay/replace_rate``, ``replay/effective_budget``), not a budget to match.
    - :attr:`reads_fisher`: the policy ranks by the Fisher estimate: it is built with the cell's
      tracker as ``fisher=``, and the estimate's settings are part of its arm.
    - :attr:`color` and :attr:`marker`: how plots draw the policy, the same in every figure of
      every sweep (a matplotlib colour and marker). Declared on the class itself (a subclass does
      not take its parent's, so two policies never look alike by inheritance); left None, they
      are derived from the policy's name (:func:`policy_look`).
    """

    name: ClassVar[str]
    Settings: ClassVar[type[PolicyConfig]] = PolicyConfig
    fixed_budget: ClassVar[float | None] = None
    needs_native_routes: ClassVar[bool] = False
    gates_slots: ClassVar[bool] = False
    reads_fisher: ClassVar[bool] = False
    color: ClassVar[str | None] = None
    marker: ClassVar[str | None] = None

    def __init__(self, *, per_layer: bool = False) -> None:
        self.per_layer = bool(per_layer)
        self.info: dict[str, float] = {}

    @classmethod
    def resolve_budget(cls, budget: object) -> float:
        """The budget this policy replays at ``budget``, or a :class:`~ablate.budget.BudgetError`.

        The one place a budget is settled (:func:`ablate.budget.check_budget`'s rule): a fraction in
        [0, 1]; for a policy with a budget by definition (:attr:`fixed_budget`), that budget, which
        ``None`` resolves to and any other value contradicts.
        """
        return check_budget(budget, getattr(cls, "name", None), fixed=cls.fixed_budget)

    def select(
        self, routes: Routes, budget: float | None = None, *, generator: Generators = None, per_sequence: bool = False
    ) -> Tensor:
        """``[tokens, layers]`` bool replay mask, never True on an invalid token.

        Global mode (``per_sequence=False``): exactly ``n = floor(b * N + 0.5)`` of the batch's
        ``N`` valid routes (with ``per_layer``, exact per-layer quotas), random draws from the one
        ``generator``.

        Per-sequence mode (``per_sequence=True``, needs ``routes.offsets``): exactly
        ``n_s = floor(b * N_s + 0.5)`` routes within each sequence ``s`` (with ``per_layer``,
        exact per-layer quotas within each sequence, the remainder's layers rotated by a draw
        from the sequence's generator). ``generator`` may be a list of one ``torch.Generator`` per
        sequence: every random draw about sequence ``s`` (noise keys, tie breaks, ``uniform``'s
        offsets, the quota rotation) then comes from ``generator[s]``, so **the mask of a sequence
        is bit-identical whether it is selected alone or inside any batch of other sequences**,
        for every policy (given the same policy state, e.g. the same Fisher estimate). With a
        single generator the draws of all sequences come from it in order, and a sequence's mask
        depends on the sequences before it. The whole batch is selected in one batched pass:
        one segmented top-n over all sequences.

        Same inputs and generator states give the same mask, bit for bit.
        """
        budget = self.resolve_budget(budget)
        self.info = {}
        generators = self._generators(generator, routes, per_sequence)
        empty = torch.zeros(routes.num_tokens, routes.num_layers, dtype=torch.bool, device=routes.device)
        if per_sequence:
            # Only the budget decides these shortcuts, never the batch: a sequence draws the same
            # random numbers alone and in any batch.
            if budget == 0:
                return empty
            if budget == 1:
                return routes.valid_routes().clone()
            draws = Draws(generators, routes.valid_bounds, routes.num_layers, routes.device)
            shifts = draws.layer_shifts(on_host=routes.host is not None) if self.per_layer else None
            quotas = per_sequence_quotas(budget, routes, layer_shifts=shifts)
        else:
            quotas = global_quotas(budget, routes, per_layer=self.per_layer)
            if quotas.total == 0:
                return empty
            if quotas.total == routes.num_valid_routes:
                return routes.valid_routes().clone()
            draws = Draws(generators, quotas.bounds, routes.num_layers, routes.device)
        rows = routes.valid_rows
        chosen = self.choose(routes, rows, quotas, draws)
        if rows.numel() == routes.num_tokens:
            return chosen  # every token is valid: the valid rows are the mask itself
        return empty.index_copy_(0, rows, chosen)

    def _generators(self, generator: Generators, routes: Routes, per_sequence: bool) -> list[torch.Generator | None]:
        """One generator per group of :class:`~ablate.budget.Quotas`, or a clear error."""
        where = f"in policy={self.name}"
        if per_sequence and routes.offsets is None:
            raise PolicyError(
                f"per_sequence=True {where} needs sequence boundaries: build Routes(..., offsets=<[sequences + 1]>) "
                "or Routes.from_verl"
            )
        if isinstance(generator, Sequence):
            if not per_sequence:
                raise PolicyError(
                    f"generator is a {type(generator).__name__} of {len(generator)} {where}: one generator per sequence "
                    "needs per_sequence=True"
                )
            if len(generator) != routes.num_sequences:
                raise PolicyError(
                    f"generator lists {len(generator)} generators {where}: expected one per sequence, "
                    f"{routes.num_sequences} (from routes.offsets)"
                )
            for index, item in enumerate(generator):
                if not isinstance(item, torch.Generator):
                    raise PolicyError(f"generator[{index}] is a {type(item).__name__} {where}: expected a torch.Generator")
            devices = {item.device for item in generator}
            if len(devices) > 1:
                raise PolicyError(f"generators {where} are on {sorted(map(str, devices))}: expected one device")
            return list(generator)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise PolicyError(f"generator is a {type(generator).__name__} {where}: expected a torch.Generator, a list of them, or None")
        return [generator] * (routes.num_sequences if per_sequence else 1)

    def choose(self, routes: Routes, rows: Tensor, quotas: Quotas, draws: Draws) -> Tensor:
        """``[valid tokens, layers]`` bool with exactly ``quotas.counts`` True per group, from :meth:`route_keys`."""
        keys = self.route_keys(routes, rows, draws)
        expected = (rows.numel(), routes.num_layers)
        if keys is not None and (not isinstance(keys, Tensor) or tuple(keys.shape) != expected):
            got = f"shape {tuple(keys.shape)}" if isinstance(keys, Tensor) else f"a {type(keys).__name__}"
            raise PolicyError(f"policy={self.name} ({type(self).__qualname__}.route_keys) returned {got}: expected a "
                              f"float tensor [valid tokens, layers]={list(expected)} or None")
        if keys is not None and keys.device != rows.device:  # a meta tensor has no values to rank by
            raise PolicyError(f"policy={self.name} ({type(self).__qualname__}.route_keys) returned a ranking on device "
                              f"{keys.device}: expected it on the routes' device, {rows.device}")
        if quotas.per_sequence:
            return segmented_top_n(keys, quotas, draws)
        if keys is None:
            keys = draws.uniform()
        if not quotas.per_layer:
            return top_n(keys.reshape(-1), quotas.total, draws.generator).reshape(keys.shape)
        layer_counts = quotas.counts[0].tolist()
        return torch.stack([top_n(keys[:, layer], count, draws.generator) for layer, count in enumerate(layer_counts)], dim=1)

    @abstractmethod
    def route_keys(self, routes: Routes, rows: Tensor, draws: Draws) -> Tensor | None:
        """``[len(rows), layers]`` float ranking of the valid routes: larger is replayed first.

        ``rows`` are the indices of the valid tokens, in order. Any randomness comes from
        ``draws`` (:meth:`Draws.uniform`, :meth:`Draws.gumbel`), which gives each sequence's
        routes their own generator's numbers. Ties are broken uniformly at random by the caller.
        Return None when every valid route is equally good: the selection is then uniformly
        random, drawn the cheapest way.
        """

    def __repr__(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if k != "info")
        return f"{type(self).__name__}({settings})"


class BudgetViolation(PolicyError):
    """A replay mask that does not hold exactly the budget's count of valid routes."""


def replay_mask(policy: ReplayPolicy, routes: Routes, budget: float | None = None, *, generator: Generators = None,
                per_sequence: bool = False, checks: list[MaskCheck] | None = None) -> Tensor:
    """``policy.select(...)``, checked: the mask every backend replays (and every probe scores).

    Budget matching is what lets an ablation credit a difference to the selection, and a policy
    of any origin can override :meth:`ReplayPolicy.select` or :meth:`~ReplayPolicy.choose`: the
    mask is checked here, outside the policy, against the shared count (:mod:`ablate.budget`):
    a ``[tokens, layers]`` bool tensor, never True on an invalid token, with exactly the budget's
    routes (in each sequence with ``per_sequence``; in each layer with ``per_layer`` over the
    batch). Anything else raises :class:`BudgetViolation` naming the policy, the budget and the count.

    Where the caller passes a list as ``checks``, the count is not read back here: its
    :class:`MaskCheck` is appended, for the caller to read with others, once (the replay hook does,
    once per training step, so that a GPU waits for no mask); its shape and type are checked at once.
    """
    budget = policy.resolve_budget(budget)
    mask = policy.select(routes, budget, generator=generator, per_sequence=per_sequence)
    check = MaskCheck(f"policy={policy.name} ({type(policy).__qualname__}) at budget={budget:g}", routes.num_layers)
    shape = (routes.num_tokens, routes.num_layers)
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != shape:
        got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, Tensor) else type(mask).__name__
        raise BudgetViolation(f"{check.where} returned a mask of {got}: expected torch.bool [tokens, layers]={list(shape)}")
    check.found = _violation(routes, mask, budget, per_sequence, bool(getattr(policy, "per_layer", False)))
    if checks is None:
        check.raise_if_broken(check.found.tolist())
    else:
        checks.append(check)
    return mask


#: What :func:`_violation` found: nothing, routes of invalid tokens, a sequence's, the batch's or a layer's count.
_FINE, _INVALID, _SEQUENCE, _TOTAL, _LAYER = range(5)


@dataclass
class MaskCheck:
    """A mask's budget check: ``found`` holds, on the mask's device, the first broken promise
    (``[kind, index, realized, expected, valid routes]``, int64), until :meth:`raise_if_broken` reads it."""

    where: str
    layers: int
    found: Tensor | None = None

    def raise_if_broken(self, found: list[int]) -> None:
        kind, index, realized, expected, valid = found
        tail = "(ablate counts the budget; a policy only ranks routes)"
        if kind == _INVALID:
            raise BudgetViolation(f"{self.where} replayed routes of invalid (padding) tokens: expected valid routes only")
        if kind == _SEQUENCE:
            raise BudgetViolation(f"{self.where} replayed {realized} routes in sequence {index}: expected exactly "
                                  f"{expected}, floor(b * N_s + 0.5) of its {valid} valid routes {tail}")
        if kind == _TOTAL:
            raise BudgetViolation(f"{self.where} replayed {realized} of {valid} valid routes: expected exactly "
                                  f"{expected}, floor(b * N + 0.5) {tail}")
        if kind == _LAYER:
            raise BudgetViolation(f"{self.where} with per_layer=true replayed {realized} routes in layer {index}: "
                                  f"expected exactly its quota {expected}")


def _violation(routes: Routes, mask: Tensor, budget: float, per_sequence: bool, per_layer: bool) -> Tensor:
    """The first broken promise of ``mask``, as :class:`MaskCheck` holds it, computed on the mask's device."""
    device, layers = mask.device, routes.num_layers

    def first(kind: int, bad: Tensor, realized: Tensor, expected: Tensor, valid: Tensor) -> Tensor:
        """``[kind, index, realized, expected, valid]`` of the first ``bad`` group, kind 0 where none is."""
        index = bad.to(torch.uint8).argmax().reshape(1)  # indexed with a tensor: an int would be read back
        row = [index, *(values.reshape(-1).index_select(0, index) for values in (realized, expected, valid))]
        return torch.cat([torch.where(bad.any(), kind, _FINE).reshape(1), *(part.long() for part in row)])

    invalid = (mask & ~routes.valid[:, None]).any()
    none = torch.zeros(1, dtype=torch.long, device=device)
    found = [first(_INVALID, invalid.reshape(1), none, none, none)]
    if per_sequence:
        assert routes.offsets is not None  # select() refused per_sequence without offsets
        before = torch.cat([mask.new_zeros(1, dtype=torch.long), mask.sum(1).cumsum(0)])  # routes before each token
        offsets = routes.offsets.to(device)
        realized = before[offsets[1:]] - before[offsets[:-1]]
        valid_tokens = routes.valid_offsets.diff().to(device)
        expected = sequence_counts(budget, valid_tokens, layers).to(device)
        found.append(first(_SEQUENCE, realized != expected, realized, expected, valid_tokens * layers))
    else:
        valid, count = routes.num_valid_routes, count_for(budget, routes.num_valid_routes)
        realized, expected = mask.sum().reshape(1), torch.tensor([count], device=device)
        found.append(first(_TOTAL, realized != expected, realized, expected, torch.tensor([valid], device=device)))
        if per_layer:
            quotas = layer_quotas(count, layers, routes.num_valid_tokens, device=device)
            per_layer_count = mask.sum(0)
            found.append(first(_LAYER, per_layer_count != quotas, per_layer_count, quotas, quotas))
    # The first of them that found something (kinds in the order the promises are checked).
    stacked = torch.stack(found)
    return stacked.index_select(0, (stacked[:, 0] != _FINE).to(torch.uint8).argmax().reshape(1)).reshape(-1)


_REGISTRY: dict[str, type[ReplayPolicy]] = {}
P = TypeVar("P", bound=type[ReplayPolicy])

#: The entry-point group through which an installed package adds policies: ``name = "module:Class"``.
ENTRY_POINT_GROUP = "ablate.policies"
_entry_points_loaded = False


def register_policy(name: str):
    """Class decorator that makes a policy available to :func:`get_policy` under ``name``."""

    def decorate(cls: P) -> P:
        _register(name, cls, f"register_policy({name!r})")
        return cls

    return decorate


def _register(name: str, cls: Any, where: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, ReplayPolicy)):
        raise PolicyError(f"{where} names {cls!r}: expected a ReplayPolicy subclass")
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise PolicyError(f"policy name {name!r} ({where}) is already registered by {_REGISTRY[name].__qualname__}")
    _check_settings(cls, where)
    cls.name = name
    _REGISTRY[name] = cls


def _check_settings(cls: type[ReplayPolicy], where: str) -> None:
    """The policy's ``Settings`` schema and its ``__init__`` keywords agree, field by field."""
    settings = cls.Settings
    if not (dataclasses.is_dataclass(settings) and isinstance(settings, type) and issubclass(settings, PolicyConfig)):
        raise PolicyError(f"{where}: {cls.__qualname__}.Settings is {settings!r}: expected a dataclass extending "
                          "ablate.config.PolicyConfig")
    keywords = _keyword_defaults(cls)
    for item in dataclasses.fields(settings):
        if item.name in ("name", "fisher"):
            continue
        default = item.default_factory() if item.default_factory is not dataclasses.MISSING else item.default
        if item.name not in keywords or keywords[item.name] != default:
            raise PolicyError(
                f"{where}: {cls.__qualname__}.Settings.{item.name}={default!r} has no keyword setting "
                f"{cls.__qualname__}.__init__(*, {item.name}={default!r}): expected the same names and defaults"
            )


def _keyword_defaults(cls: type[ReplayPolicy]) -> dict[str, Any]:
    return {p.name: p.default for p in inspect.signature(cls.__init__).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY}


def load_plugins(modules: Iterable[str] = ()) -> None:
    """Make the installed policies (entry points, once per process) and the named ``modules`` known.

    A module named here is imported; its ``@register_policy`` classes register themselves. This is
    how a policy whose package is not installed reaches every process of a sweep: the cell's
    config lists it under ``plugins``, and every process that builds a policy imports it first.
    """
    global _entry_points_loaded
    if not _entry_points_loaded:
        for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                loaded = point.load()
            except Exception as error:  # every later call says it again: a broken install stays visible
                raise PolicyError(f"entry point {point.name} = {point.value!r} (group {ENTRY_POINT_GROUP}) "
                                  f"cannot be loaded: {type(error).__name__}: {error}") from None
            _register(point.name, loaded, f"entry point {point.name} = {point.value!r}")
        _entry_points_loaded = True
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise PolicyError(f"plugins=[{module}]: the module cannot be imported ({error}): expected an importable "
                              "module that registers policies with @register_policy") from None
        except (Exception, SystemExit) as error:  # its own code failed: a SyntaxError, an error or an exit at import
            where = f" ({error.filename}, line {error.lineno})" if isinstance(error, SyntaxError) else ""
            raise PolicyError(f"plugins=[{module}]: importing the module raised {type(error).__name__}: "
                              f"{' '.join(str(getattr(error, 'msg', error)).split())}{where}") from None


def available_policies() -> list[str]:
    load_plugins()
    return sorted(_REGISTRY)


def policy_class(name: str) -> type[ReplayPolicy]:
    """The registered policy class ``name`` (built-in, installed, or imported through ``plugins``)."""
    if name not in _REGISTRY:
        load_plugins()
    if name not in _REGISTRY:
        raise PolicyError(
            f"unknown policy {name!r}: expected one of {', '.join(available_policies())} (a policy of your own is "
            f"found through an entry point in group {ENTRY_POINT_GROUP} or by naming its module in plugins=[...])"
        )
    return _REGISTRY[name]


def fixed_budget_of(name: str) -> float | None:
    """The budget policy ``name`` has by definition, None when the cell's budget decides (or it is unknown)."""
    try:
        return policy_class(name).fixed_budget
    except PolicyError:
        return None


def fixed_budget_policies() -> dict[str, float]:
    """Every known policy that replays a budget by definition, with that budget (``{"none": 0.0, "full": 1.0}``).

    A policy that gates its routes (:attr:`ReplayPolicy.gates_slots`) has a fixed mask but spends
    what its gate lets through: it is not one of them (the analysis reads these as the ends of
    ``random``'s budget-response curve).
    """
    load_plugins()
    return {name: cls.fixed_budget for name, cls in sorted(_REGISTRY.items())
            if cls.fixed_budget is not None and not cls.gates_slots}


#: The colours and markers a policy that declares none is given, by a hash of its name; the
#: colours are those the built-ins' Okabe-Ito palette leaves free.
DERIVED_COLORS: tuple[str, ...] = ("#E69F00", "#8C564B", "#7F7F7F", "#BCBD22", "#17BECF", "#9467BD", "#8B0000")
DERIVED_MARKERS: tuple[str, ...] = ("v", "P", "X", "*", "h", "<", ">")


@dataclasses.dataclass(frozen=True)
class PolicyLook:
    """How plots draw a policy; ``declared`` says whether the colour is the class's own."""

    color: str
    marker: str
    declared: bool


def policy_look(name: str) -> PolicyLook:
    """The colour and marker of policy ``name``: those its class declares, else derived from the name.

    The derived ones depend on the name only (a CRC32 of it), so a policy looks the same in every
    sweep; a policy that is not installed where the analysis runs gets the derived look too.
    """
    declared: dict[str, Any] = {}
    try:
        declared = vars(policy_class(name))
    except PolicyError:
        pass
    slot = zlib.crc32(name.encode())
    color, marker = declared.get("color"), declared.get("marker")
    return PolicyLook(color or DERIVED_COLORS[slot % len(DERIVED_COLORS)],
                      marker or DERIVED_MARKERS[slot % len(DERIVED_MARKERS)], color is not None)


def get_policy(name: str, **settings: Any) -> ReplayPolicy:
    """The registered policy ``name`` built with its own ``settings``; clear errors otherwise."""
    cls = policy_class(name)
    accepted = list(_keyword_defaults(cls))
    unknown = sorted(set(settings) - set(accepted))
    if unknown:
        raise PolicyError(
            f"policy={name} got unknown setting(s) {', '.join(unknown)}: expected "
            f"{', '.join(accepted) if accepted else 'no settings'}"
        )
    return cls(**settings)


def register_policy_options() -> None:
    """Offer every known policy without a YAML file in ``ablate.conf`` as a ``policy`` option.

    This is what makes ``policy=<name>`` compose for an installed or imported policy, its
    ``Settings`` typed and checked by Hydra like the built-ins'. The built-ins have their
    ``conf/policy/<name>.yaml`` (extending the same schemas); storing an option of the same name
    beside a file would make Hydra merge the two, with a deprecation warning.
    """
    from importlib import resources

    from hydra.core.config_store import ConfigStore

    shipped = resources.files("ablate.conf").joinpath("policy")
    store = ConfigStore.instance()
    for name in available_policies():
        if not shipped.joinpath(f"{name}.yaml").is_file():
            store.store(group="policy", name=name, node=_REGISTRY[name].Settings(name=name))
