//! Shared helpers for the integration suites: backend factories and fill-pattern checks.
