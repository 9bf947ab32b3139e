"""Ratchet's loop dashboard: server-rendered pages that show what the workflows mean.

The Temporal Web UI shows workflow histories; these pages show a loop's stage, its champion,
the live success rate, each cycle's evaluation, the lineage of the serving model and what it
cost. Modules: ``queries`` and ``lineage`` read Postgres (session keyword-only, never commit),
``charts`` draws inline SVG, ``timeline`` turns a cycle into stage steps, ``logs_tail`` reads
a run's log file safely, ``links`` builds Temporal Web UI links, ``pages`` assembles each
page's context and ``render`` owns the Jinja2 environment. The routes live in
``services.api.routes.dashboard``.
"""
