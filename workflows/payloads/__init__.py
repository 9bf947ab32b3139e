"""Every workflow's and activity's input and result dataclasses, one module per stage.

One dataclass in, one dataclass out (STYLE habit 1), so fields can be added with defaults
without breaking running histories. Payloads are ids and URIs, never rows or files. These
modules import the standard library, temporalio's converter hook (``workflows.payload``),
the policy classes (pydantic models in ``services.loop.policies``) and the base classes of
curation's results; no database, no torch: workflows import them inside
``imports_passed_through`` and the api imports them to start and signal workflows. They
import nothing else of ``workflows`` (so a workflow and the activities it calls can both
name one payload without a circle), which is why they are a package of their own rather
than each beside the workflow that owns it.
"""
