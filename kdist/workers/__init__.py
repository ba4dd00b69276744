"""Processes and workers: which workers take part (`cluster`), starting and
supervising processes (`processes`), one process per replica (`replicas`) and
the stop every worker agrees on (`interrupt`). Imports no framework."""
