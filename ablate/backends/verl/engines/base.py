"""verl's side of the seam (:mod:`ablate.replay.seams`): its calls framed for the hook, the hook armed in verl's actor.

An engine's seam (:mod:`.megatron`, :mod:`.veomni`) implements :class:`ablate.replay.seams.EngineSeam`;
what is the same for every verl engine is here: the R3 call a verl batch describes
(:func:`r3_call`), one hook call per verl call (:func:`hooked_call`), and the hook installed only
in the process that builds an R3 actor (:func:`arm`). Every name a seam replaces is in
:mod:`..entry_points`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ablate.replay.seams import MICRO_BATCHES_KEY, CallInfo, active_hook, install

#: verl's ``router_replay.mode`` values the hook replays in: R3, and R2 (``replay.source=train``), whose
#: update calls carry the routes the old-log-prob call recorded as ``routed_experts``.
REPLAY_MODES = ("R3", "R2")


def r3_call(data, forward_only: bool, *, num_experts: int, layer_columns) -> CallInfo | None:
    """The R3 call described by verl's batch ``data``, or None when it does not replay routes.

    ``layer_columns`` maps each decoder layer to its route column, given the number of route
    layers (a callable: the seam's own rule).
    """
    from verl.utils import tensordict_utils as tu

    routes = data.get("routed_experts", None)
    if not tu.get_non_tensor_data(data, key="enable_routing_replay", default=False) or routes is None:
        return None
    last = tu.get_non_tensor_data(data, key="update_lr_scheduler", default=None)
    if not forward_only and last is None:
        raise RuntimeError(
            "an R3 update call without verl's update_lr_scheduler flag: ablate's hook needs it to find the last "
            "update of a training step (set by verl 0.9.1's TrainingWorker.train_mini_batch)"
        )
    layers, topk = routes.values().shape[-2:] if routes.is_nested else routes.shape[-2:]
    return CallInfo(
        forward_only=forward_only, last_update=bool(last), num_tokens=data["input_ids"].values().shape[0],
        route_layers=int(layers), topk=int(topk), num_experts=int(num_experts),
        layer_columns=tuple(layer_columns(int(layers))),
    )


def arm(init_point, is_r3_actor: Callable[[Any], bool], make_hook: Callable[[], Any]) -> None:
    """Install ``make_hook()`` once this process builds an engine ``is_r3_actor`` accepts.

    ``init_point`` is the engine's ``__init__`` (:mod:`..entry_points`), wrapped when verl imports
    the engine's module, not before: a process that never builds that engine (the vLLM/SGLang
    servers, the agent-loop workers) never imports Megatron or VeOmni because of ablate.
    """
    from ablate.backends.verl import entry_points as ep
    from ablate.backends.verl.import_hooks import when_imported

    def wrap(module) -> None:
        engine_init = ep.original(init_point)

        def __init__(self, *args, **kwargs):
            engine_init(self, *args, **kwargs)
            if active_hook() is None and is_r3_actor(self):
                install(make_hook())

        ep.replace(init_point, __init__)

    when_imported(init_point.module, wrap)


# -------------------------------------------------------------------------- one verl call
def hooked_call(hook, forward_backward_batch, engine, data, loss_function, forward_only: bool):
    """An engine's ``forward_backward_batch`` as one hook call, the step's keys in its output.

    For ``mismatch``, the step's old-log-prob call runs verl's forward twice: first a native pass
    that replays nothing and records the native routes ``mismatch`` selects on (its output is
    dropped), then the pass whose output verl gets, which replays the mask like every update pass,
    so the PPO ratio starts at 1 as for every other policy. Running ``forward_backward_batch``
    twice is safe in verl 0.9.1's Megatron and VeOmni engines: each only adds idempotent keys to
    ``data``, builds its micro-batches anew in each call, and clears verl's router-replay state at
    the end of each. Every rank runs both passes (:meth:`needs_native_pass` agrees on all), so
    their collectives match.

    On a probed step's old-log-prob call, after the pass verl gets, one more forward-only pass
    runs per probe with the probe's mask (:meth:`probe_runs`, the same on every rank). Each is
    scored against the rollout's log-probs in ``data`` (:func:`..probes.probe_mismatch`) and
    dropped; forward-only, it computes no gradient and feeds no Fisher sum, and verl clears the
    router-replay state after it as after every call.

    The keys go into the output's ``metrics`` as one value each: verl gathers them over data-
    parallel ranks (equal values) and averages each key over the values it received, so the
    trainer logs them unchanged. Only ranks with outputs return metrics; the others only take
    part in the hook's collectives.
    """
    from ablate.backends.verl.probe_passes import probe_mismatch

    info = hook.seam.call_info(engine, data, forward_only)
    if info is None:
        output = forward_backward_batch(engine, data, loss_function, forward_only=forward_only)
        if not forward_only and _is_last_update(data):  # installed, but the step gave the hook nothing to replay
            _add_metrics(output, {MICRO_BATCHES_KEY: 0.0})
        return output
    if hook.needs_native_pass(info):
        _framed(hook, info, forward_backward_batch, engine, data, loss_function, native_pass=True)
    output, metrics = _framed(hook, info, forward_backward_batch, engine, data, loss_function, native_pass=False)
    for run in hook.probe_runs(info):
        probed, counts = _framed(hook, info, forward_backward_batch, engine, data, loss_function, probe=run)
        hook.add_probe(run, counts, probe_mismatch(probed, data, engine.is_mp_src_rank_with_outputs()))
    if metrics:
        _add_metrics(output, metrics)
    return output


def _add_metrics(output, metrics: dict[str, float]) -> None:
    if isinstance(output, dict) and "metrics" in output:
        output["metrics"].update({key: [value] for key, value in metrics.items()})


def _is_last_update(data) -> bool:
    from verl.utils import tensordict_utils as tu

    return bool(tu.get_non_tensor_data(data, key="update_lr_scheduler", default=False))


def _framed(hook, info: CallInfo, forward_backward_batch, engine, data, loss_function, *, native_pass: bool = False,
            probe=None):
    """One run of the engine's ``forward_backward_batch`` between the hook's begin and end of a call."""
    hook.begin_call(info, native_pass=native_pass, probe=probe)
    try:
        output = forward_backward_batch(engine, data, loss_function, forward_only=info.forward_only)
    except BaseException:
        hook.abort_call()
        raise
    finally:
        hook.seam.end_pass()
    return output, hook.end_call()
