"""Pure parsers of what nodes print: each takes text and returns facts, never raises on
odd output (a parser that cannot tell says "unknown"), and is tested against recorded
real outputs (tests/fixtures)."""
