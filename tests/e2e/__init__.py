"""End-to-end tests: Ratchet as real processes (embedded Postgres, Temporal, api, worker, jobs)."""
