"""Diagnostics: the versioned schema, its validator, and the functions that compute the keys."""

from ablate.diagnostics.metrics import (
    ROUTE_COUNTS,
    expert_load,
    load_metrics,
    metrics_from_counts,
    mismatch_metrics,
    replay_metrics,
    route_counts,
    route_diagnostics,
    routing_metrics,
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
    "ROUTE_COUNTS",
    "SCHEMA",
    "SCHEMA_VERSION",
    "SECTIONS",
    "Key",
    "SchemaError",
    "check_record",
    "expert_load",
    "keys_in",
    "load_metrics",
    "metrics_from_counts",
    "mismatch_metrics",
    "replay_metrics",
    "route_counts",
    "route_diagnostics",
    "routing_metrics",
    "to_json_schema",
    "validate_record",
]
