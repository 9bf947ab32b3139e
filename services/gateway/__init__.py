"""The capture gateway (``ratchet gateway``): an OpenAI-compatible proxy whose calls become traces.

An agent points its OpenAI ``base_url`` at the gateway and uses a loop's gateway key as its
API key. The gateway forwards each call to the loop's serving endpoint (or the upstream the
loop names), asks for the token ids and log-probs of what is sampled (and strips them from
the answer when the agent did not ask), and writes the call to a local spool before the
answer returns. A writer drains the spool into Postgres; the assembler places calls into
sessions there (no replica holds session state) and a closed session becomes a trace.

- :mod:`.app`: the ASGI app (auth, body cap, the routes) and :mod:`.forward` (upstream
  calls, errors in OpenAI's shape, cancellation when the client hangs up) over
  :mod:`.upstream`, the gateway's own HTTP/1.1 client;
- :mod:`.keys`, :mod:`.routing`: a loop by its gateway key, and where its calls go;
- :mod:`.conversation`, :mod:`.streams`, :mod:`.responses`: the wire formats, read into
  ``ratchet.trace/v1`` messages;
- :mod:`.spool`, :mod:`.writer`: the durable local spool and its drain into Postgres;
- :mod:`.sessions`, :mod:`.assembler`, :mod:`.outcomes`, :mod:`.queries`: sessions, the
  traces they become, and outcomes that arrive later.
"""
