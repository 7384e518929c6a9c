"""The roles policies play in the effect definitions (docs/design.md section 5), in one place.

An effect is a paired difference between two arms: the replay effect ``full - none``, the budget
effect ``random(b) - none``, the selection effects ``fisher(b) - random(b)`` and
``fisher(b) - uniform(b)``, and the matched-effective-budget comparison against ``random``'s
budget-response curve. These are properties of the *questions* an ablation asks, not traits of
the policies (a policy of your own may need native routes, but it is never the no-replay
baseline), so they are named constants here rather than flags on the classes. The analysis reads
them from this module only; a policy of your own enters the tables as a treatment beside them.
"""

#: Replays nothing: the baseline of the replay and budget effects, and of the "too restrictive" flag.
NO_REPLAY = "none"
#: Replays everything (R3): the replay effect's treatment and the "too weak" flag's other end.
FULL_REPLAY = "full"
#: The budget-only control: the budget effect's treatment, the first selection baseline, and the
#: policy whose budget-response curve matched-effective-budget comparisons are read from.
BUDGET_CONTROL = "random"
#: The baselines every selection effect is measured against.
SELECTION_BASELINES: tuple[str, ...] = (BUDGET_CONTROL, "uniform")
#: The selection the design's primary selection effects are about.
SELECTION_TREATMENT = "fisher"
#: The order tables and plots list the built-in policies in; others follow by name.
POLICY_ORDER: tuple[str, ...] = (NO_REPLAY, FULL_REPLAY, BUDGET_CONTROL, "uniform", SELECTION_TREATMENT, "mismatch")
