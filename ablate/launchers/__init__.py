"""Launching a sweep's cells so that every launcher keeps the promises of a sweep (``docs/launchers.md``).

Hydra's own launchers give up at the first problem of one job and let no cell record an
interrupt: joblib's pool SIGKILLs every worker when one dies, or when the sweep is interrupted;
the Ray launcher gets its results one by one and raises at the first dead worker; submitit raises
at the first job that did not finish and leaves its jobs running when the sweep stops. ablate's
app therefore selects launchers of its own under their names (``hydra/launcher=joblib``, ``ray``,
``submitit_local``; ``hydra_plugins/ablate_launchers``), each on Hydra's public ``Launcher``
interface and its library's public API, one module per library:

- :mod:`.jobs`: one job, as Hydra's launchers run one, which a stop of the sweep reaches wherever
  it runs; the base of the launchers.
- :mod:`.pool`: local worker processes that know which job each holds (``local``, ``joblib``).
- :mod:`.ray_tasks`: Ray tasks, waited for together, cancelled with ``ray.cancel``.
- :mod:`.submitit_jobs`: submitit's local jobs, a few at a time.
- :mod:`.stopping`: what a sweep does around any launcher (its stop file, waiting for the cells
  still held).

The in-process launcher (Hydra's default) and ``submitit_slurm`` are Hydra's own, called as they are.

This package's ``__init__`` imports nothing: Hydra imports :mod:`.jobs` when it scans its plugins.
"""
