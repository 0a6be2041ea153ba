"""Typed configuration: defaults < TOML file < environment < command-line flags.

`model` holds the data classes and the loader, `schema` builds them from raw values,
`validate` checks ranges and formats, `shared` is [cache.shared], `model_settings` is
[model."<pattern>"], `units` parses sizes and durations, and `tomltext` edits TOML text
in place."""
