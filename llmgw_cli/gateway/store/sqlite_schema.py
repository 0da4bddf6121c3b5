"""The SQLite store's schema, one script per version: ``sqlite.py`` runs, in one
transaction, the scripts from the file's version to ``SCHEMA_VERSION`` (statements split at
``;``). Version 1 is the state file of gateways from before the shared store; 3 adds the
key limits (a JSON column, so a new limit needs no migration) and their counters; 4 the
cordoned nodes (``llmgw cordon``)."""

from __future__ import annotations

_SCHEMA_V1 = """
CREATE TABLE IF NOT EXISTS api_keys (
  name TEXT PRIMARY KEY, digest TEXT NOT NULL UNIQUE, models TEXT NOT NULL,
  expires TEXT, created TEXT NOT NULL, revoked INTEGER NOT NULL DEFAULT 0,
  admin INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS usage (
  day TEXT NOT NULL, key TEXT NOT NULL, model TEXT NOT NULL,
  requests INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
  errors INTEGER NOT NULL, latency_ms REAL NOT NULL, PRIMARY KEY (day, key, model));
CREATE TABLE IF NOT EXISTS last_use (replica TEXT PRIMARY KEY, at REAL NOT NULL);
"""

_SCHEMA_V2 = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta VALUES ('keys_version', 0), ('published_version', 0);
CREATE TABLE IF NOT EXISTS usage_batches (id TEXT PRIMARY KEY, at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS usage_batches_at ON usage_batches (at);
CREATE TABLE IF NOT EXISTS members (
  member TEXT PRIMARY KEY, host TEXT NOT NULL, pid INTEGER NOT NULL, seen REAL NOT NULL);
CREATE TABLE IF NOT EXISTS start_requests (
  model TEXT PRIMARY KEY, member TEXT NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS leader (
  id INTEGER PRIMARY KEY CHECK (id = 1), epoch INTEGER NOT NULL, member TEXT NOT NULL,
  since REAL NOT NULL);
INSERT OR IGNORE INTO leader VALUES (1, 0, '', 0);
CREATE TABLE IF NOT EXISTS published (
  id INTEGER PRIMARY KEY CHECK (id = 1), version INTEGER NOT NULL, fence INTEGER NOT NULL,
  leader TEXT NOT NULL, at REAL NOT NULL, body TEXT NOT NULL);
"""

_SCHEMA_V3 = """
ALTER TABLE api_keys ADD COLUMN limits TEXT NOT NULL DEFAULT '{}';
CREATE TABLE IF NOT EXISTS key_counters (
  key TEXT NOT NULL, counter TEXT NOT NULL, win TEXT NOT NULL, used INTEGER NOT NULL,
  granted INTEGER NOT NULL, ends REAL NOT NULL, PRIMARY KEY (key, counter, win));
CREATE INDEX IF NOT EXISTS key_counters_ends ON key_counters (ends);
"""

_SCHEMA_V4 = """
CREATE TABLE IF NOT EXISTS cordons (
  node TEXT PRIMARY KEY, reason TEXT NOT NULL, who TEXT NOT NULL, since REAL NOT NULL,
  draining INTEGER NOT NULL DEFAULT 0);
"""

MIGRATIONS = {
    1: _SCHEMA_V1,
    2: _SCHEMA_V2,
    3: _SCHEMA_V3,
    4: _SCHEMA_V4,
}  # version -> the script that brings the one before to it
