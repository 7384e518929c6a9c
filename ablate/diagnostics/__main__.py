"""``python -m ablate.diagnostics``: regenerate schema.json from the schema's Python source."""

from ablate.diagnostics.schema import JSON_SCHEMA_PATH, write_json_schema

write_json_schema()
print(f"wrote {JSON_SCHEMA_PATH}")
