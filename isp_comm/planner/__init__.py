"""Know before you launch, part two: how fast each layout runs, and which to pick.

:mod:`.targets` (published figures of known devices), :mod:`.profile` (what the
step-time model reads; JSON, cached per user), :mod:`.calibrate` (measuring this
machine), :mod:`.ops` (a meta step, operator by operator), :mod:`.step` (the
engine's schedule replayed on a profile), :mod:`.memory` (the forecast on the
profile's device, and whether it fits) and :mod:`.search` (layouts ranked).
``isp-train --plan`` (:mod:`isp_comm.train.plan`) puts them together.
"""
