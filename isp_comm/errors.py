"""Exceptions a user of isp-comm may want to catch."""


class ISPCommTimeout(RuntimeError):
    """A wait on communication outlived its deadline (a peer died or stalled)."""


class HookOrderError(RuntimeError, ValueError):
    """Scheduler hooks were called out of order (e.g. after_backward before backward)."""
