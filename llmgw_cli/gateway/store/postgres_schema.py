"""The PostgreSQL store's schema, one script per version: ``postgres.py`` runs, in one
transaction under an advisory lock, the scripts from the database's version to
``SCHEMA_VERSION``. It starts at version 2 (the first shared schema; version 1 was SQLite
only); 3 adds the key limits (a JSON column, so a new limit needs no migration) and their
counters; 4 the cordoned nodes (``llmgw cordon``)."""

from __future__ import annotations

from llmgw_cli.gateway.store.values import SCHEMA_VERSION

SCHEMA = {
    2: """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value BIGINT NOT NULL);
INSERT INTO meta VALUES ('keys_version', 0), ('published_version', 0) ON CONFLICT DO NOTHING;
CREATE TABLE IF NOT EXISTS api_keys (
  name TEXT PRIMARY KEY, digest TEXT NOT NULL UNIQUE, models TEXT NOT NULL,
  expires TEXT, created TEXT NOT NULL, revoked BOOLEAN NOT NULL DEFAULT false,
  admin BOOLEAN NOT NULL DEFAULT false);
CREATE TABLE IF NOT EXISTS usage (
  day TEXT NOT NULL, key TEXT NOT NULL, model TEXT NOT NULL,
  requests BIGINT NOT NULL, prompt_tokens BIGINT NOT NULL, completion_tokens BIGINT NOT NULL,
  errors BIGINT NOT NULL, latency_ms DOUBLE PRECISION NOT NULL, PRIMARY KEY (day, key, model));
CREATE TABLE IF NOT EXISTS usage_batches (id TEXT PRIMARY KEY, at DOUBLE PRECISION NOT NULL);
CREATE INDEX IF NOT EXISTS usage_batches_at ON usage_batches (at);
CREATE TABLE IF NOT EXISTS last_use (replica TEXT PRIMARY KEY, at DOUBLE PRECISION NOT NULL);
CREATE TABLE IF NOT EXISTS members (
  member TEXT PRIMARY KEY, host TEXT NOT NULL, pid INTEGER NOT NULL, seen DOUBLE PRECISION NOT NULL);
CREATE TABLE IF NOT EXISTS start_requests (
  model TEXT PRIMARY KEY, member TEXT NOT NULL, at DOUBLE PRECISION NOT NULL);
CREATE TABLE IF NOT EXISTS leader (
  id INTEGER PRIMARY KEY CHECK (id = 1), epoch BIGINT NOT NULL, member TEXT NOT NULL,
  since DOUBLE PRECISION NOT NULL);
INSERT INTO leader VALUES (1, 0, '', 0) ON CONFLICT DO NOTHING;
CREATE TABLE IF NOT EXISTS published (
  id INTEGER PRIMARY KEY CHECK (id = 1), version BIGINT NOT NULL, fence BIGINT NOT NULL,
  leader TEXT NOT NULL, at DOUBLE PRECISION NOT NULL, body TEXT NOT NULL);
""",
    3: """
ALTER TABLE api_keys ADD COLUMN IF NOT EXISTS limits TEXT NOT NULL DEFAULT '{}';
CREATE TABLE IF NOT EXISTS key_counters (
  key TEXT NOT NULL, counter TEXT NOT NULL, win TEXT NOT NULL, used BIGINT NOT NULL,
  granted BIGINT NOT NULL, ends DOUBLE PRECISION NOT NULL, PRIMARY KEY (key, counter, win));
CREATE INDEX IF NOT EXISTS key_counters_ends ON key_counters (ends);
""",
    4: """
CREATE TABLE IF NOT EXISTS cordons (
  node TEXT PRIMARY KEY, reason TEXT NOT NULL, who TEXT NOT NULL, since DOUBLE PRECISION NOT NULL,
  draining BOOLEAN NOT NULL DEFAULT false);
""",
}
assert max(SCHEMA) == SCHEMA_VERSION, "a new schema version needs its PostgreSQL migration"
