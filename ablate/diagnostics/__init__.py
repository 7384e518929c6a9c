"""Diagnostics: the versioned schema, its validator, and the functions that compute the keys."""

from ablate.diagnostics.metrics import (
    expert_load,
    load_metrics,
    mismatch_metrics,
    replay_counts,
    replay_metrics,
    replay_metrics_from_counts,
    route_diagnostics,
    routing_counts,
    routing_metrics,
    routing_metrics_from_counts,
)
from ablate.diagnostics.schema import (
    SCHEMA,
    SCHEMA_VERSION,
    SECTIONS,
    Key,
    SchemaError,
    check_record,
    keys_in,
    to_json_schema,
    validate_record,
)

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "SECTIONS",
    "Key",
    "SchemaError",
    "check_record",
    "expert_load",
    "keys_in",
    "load_metrics",
    "mismatch_metrics",
    "replay_counts",
    "replay_metrics",
    "replay_metrics_from_counts",
    "route_diagnostics",
    "routing_counts",
    "routing_metrics",
    "routing_metrics_from_counts",
    "to_json_schema",
    "validate_record",
]
