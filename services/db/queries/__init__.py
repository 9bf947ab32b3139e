"""Query functions, one module per aggregate. They take the session keyword-only and never
commit: the caller owns the transaction."""
