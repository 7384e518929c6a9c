"""The CPU end-to-end tier: verl 0.9.1's real main_ppo run by ``python -m ablate backend=verl_cpu``.

Every test here starts verl, Ray and the Megatron or VeOmni workers; they share one set of assets
(the tiny model, tokenizer and prompts, made once per session) and one store of policy cells per
engine. The two engines' policy multiruns run at the same time: a verl cell's start-up is a chain
of processes that each import verl, mostly one core busy at a time, so a third cell fills what
two leave idle on a 2-core machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cpu_cells import BUDGET, EXAMPLE, POLICIES, PROBE_OVERRIDES, Background

#: the VeOmni engine's policy cells: no replay, every route, and a partial policy.
VEOMNI_POLICIES = ("none", "full", "random")


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Path:
    from ablate.backends.verl.cpu import assets as cpu_assets

    folder = tmp_path_factory.mktemp("verl-cpu-assets")
    cpu_assets.ensure(folder)
    return folder


@pytest.fixture(scope="session")
def multiruns(tmp_path_factory, assets) -> dict[str, tuple[Path, Background]]:
    """Both engines' policy multiruns, started at once: each engine's store and its running command."""
    megatron = tmp_path_factory.mktemp("cpu-policies") / "runs"
    veomni = tmp_path_factory.mktemp("cpu-veomni") / "runs"
    megatron.mkdir()
    veomni.mkdir()
    policies = (*POLICIES, *EXAMPLE)
    return {
        "megatron": (megatron, Background(
            megatron, assets, "-m", f"policy={','.join(policies)}", f"budget={BUDGET}", "seed=0", "sweep=cpu",
            "tracking.mode=offline", *PROBE_OVERRIDES, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2")),
        "veomni": (veomni, Background(
            veomni, assets, "-m", "backend.engine=veomni", f"policy={','.join(VEOMNI_POLICIES)}", f"budget={BUDGET}",
            "seed=0", "sweep=cpu-veomni", "tracking.mode=offline", *PROBE_OVERRIDES)),
    }


@pytest.fixture(scope="session")
def policy_store(multiruns) -> Path:
    """One multirun of the six policies (and the example ``margin``) at budget 0.5, seed 0, into the store's sweep ``cpu``.

    Two cells at a time, with the joblib launcher a user runs: a verl cell's start-up is a chain
    of processes that each import verl, mostly one core busy at a time.

    Every cell also scores the probes ``none``, ``full`` and ``random@0.5`` on each step
    (docs/probes.md): probes do not change training, so the cells' other checks hold as without.
    """
    store, running = multiruns["megatron"]
    policies = (*POLICIES, *EXAMPLE)
    done, seconds = running.wait(timeout=2700)
    print(f"\n{len(policies)} verl CPU cells in one multirun, two at a time: {seconds:.0f} s wall")
    assert done.returncode == 0, (done.stdout[-4000:], done.stderr[-4000:])
    assert f"sweep cpu: {len(policies)} complete, 0 failed, 0 skipped" in done.stdout + done.stderr
    return store


@pytest.fixture(scope="session")
def veomni_store(multiruns) -> tuple[Path, str]:
    """One multirun of ``none``, ``full`` and ``random`` at budget 0.5, seed 0, on verl's VeOmni engine
    (``backend.engine=veomni``), into the store's sweep ``cpu-veomni``; the store and what the run printed.

    One cell at a time (each with two FSDP2 ranks), beside the Megatron multirun, with the same probes.
    """
    store, running = multiruns["veomni"]
    done, seconds = running.wait(timeout=2700)
    print(f"\n{len(VEOMNI_POLICIES)} verl CPU cells on the VeOmni engine in one multirun, beside the Megatron "
          f"one: {seconds:.0f} s wall")
    assert done.returncode == 0, (done.stdout[-4000:], done.stderr[-4000:])
    assert f"sweep cpu-veomni: {len(VEOMNI_POLICIES)} complete, 0 failed, 0 skipped" in done.stdout + done.stderr
    return store, done.stdout + done.stderr
