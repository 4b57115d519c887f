"""The post-accumulate-grad hooks a user put on the parameters, called once the
gradient they see is the global batch's.

[Note: post-accumulate-grad hooks]
torch calls a parameter's post-accumulate-grad hooks once autograd has accumulated
its gradient into ``.grad``. That is how an optimizer is stepped in the backward (one
optimizer per parameter, stepped and zeroed from its hook, so that each gradient is
freed as soon as it is used), and FSDP2 keeps the idiom by calling a sharded
parameter's hooks after its reduce-scatter. Here:

- A sharded parameter's gradient is written by the engine (its reduced shard, or
  piece), never by autograd. Its hooks are called by the reducer once its reduce
  group's gradient is in ``.grad``, after the replica stage too; with the replica
  reduction deferred, by the backward that syncs. Autograd would call them too, with
  no gradient, for the shard that anchors its block's node in the graph
  (``UnshardBlock``): so from a forward with grad to its backward's end every
  shard's hooks are held out of its hook dict, and the reducer calls the held ones.
- A whole (replicated) parameter's gradient is accumulated by autograd before it is
  averaged over the ranks, so its hooks would see this rank's part alone and step the
  replicas apart. From a forward with grad to its backward's end they are held out
  of the parameter's hooks (:meth:`UserGradHooks.hold`) and called once the average is
  in ``.grad``, the earlier micro-steps' gradients added back (:meth:`release`).
- A backward that did not go as planned (an exception escaped it) calls nothing
  more once it is settled (:attr:`quiet`: the gradients still in flight are
  dropped); the hooks of the shards whose reductions had completed before have run,
  as a plain model has run those of the gradients it accumulated before the
  exception (which ones differ: the reductions run behind autograd). Nothing is
  called by a backward whose replica reduction is deferred (no ``.grad`` is
  written), nor for a parameter left without a gradient. With
  ``find_unused_parameters`` a parameter no rank used gets zeros reduced, taken back
  to ``None`` once every rank's use is known, which costs a host read: so the shards'
  hooks wait for the backward's end too (``defer``), and there, when any hook is to
  run, the engine settles the use first (the read a step would make; every rank
  must then register the same hooks, as the recipe does). Two forwards with grad
  before one backward (DPO's chosen and rejected) reduce a block's gradients once per
  forward, where autograd accumulates a parameter's once: the shards' hooks then wait
  for the backward's end too (:meth:`UserGradHooks.defer_shards`), and run once.
- While a hook runs, :attr:`running` says so: the communicator's step pre-hook then
  knows that a step inside the backward is the hook's, not a step that did not go as
  planned.

Hooks are told apart from the reducer's own by their handles' ids, never by name.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping

from torch import nn

from isp_comm.errors import few_names

Hook = Callable[[nn.Parameter], None]


def refuse_gradient_hooks(named: Iterable[tuple[str, nn.Parameter]], wrapping: bool) -> None:
    """[Note: gradient hooks on a shard] A hook ``register_hook`` put on a parameter sees
    its gradient as autograd computes it; a sharded parameter's gradient is written by
    the engine, never by autograd, so such a hook would never run (FSDP2 drops it
    alike, without a word). And wrapping replaces each sharded parameter by its shard,
    a new parameter of the same name, so any gradient hook on the parameter before
    (post-accumulate-grad ones too) would never run, nor an optimizer of the whole
    parameter stepped from it. Both are refused, naming the parameters: ``wrapping``
    at the constructor, before anything is sharded; otherwise at a forward with grad,
    for a ``register_hook`` on a shard after wrapping. A post-accumulate-grad hook
    registered after wrapping works (see the note above); a whole parameter's hooks
    work as on DDP's."""
    hooked = [
        name
        for name, p in named
        if p._backward_hooks or (wrapping and _hooks_of(p))  # empty dicts stay once a handle is removed
    ]
    if not hooked:
        return
    listed = few_names(hooked)
    if wrapping:
        raise ValueError(
            f"isp-comm: {listed} hold a gradient hook registered before wrapping, which would never run: wrapping "
            "replaces each sharded parameter by its shard, a new parameter of the same name. Register hooks (and "
            "build optimizers) after wrapping, on model.parameters()"
        )
    raise RuntimeError(
        f"isp-comm: register_hook on {listed} would never run: a sharded parameter's gradient is reduced and "
        "written by isp-comm, not by autograd. Use register_post_accumulate_grad_hook, which runs once the reduced "
        "gradient is in p.grad (modify p.grad there), and remove the register_hook handle"
    )


def _hooks_of(p: nn.Parameter) -> dict[int, Hook] | None:
    """``p``'s post-accumulate-grad hooks by handle id (torch keeps them there), or ``None``."""
    return getattr(p, "_post_accumulate_grad_hooks", None)


class UserGradHooks:
    """The user's post-accumulate-grad hooks of one wrapped model (see the note above)."""

    def __init__(self, defer: bool = False) -> None:
        self._defer = defer
        self._later: dict[nn.Parameter, None] | None = {} if defer else None
        """The shards whose gradients are final, when their hooks wait for :meth:`release` (once each)."""
        self.running = False
        """A user's hook is running (called from the backward, or from its end)."""
        self.quiet = False
        """Set while a backward that did not go as planned is ended: no hook is called."""
        self._held: dict[nn.Parameter, tuple[dict[int, Hook], int | None, bool]] = {}
        """Per parameter: its hook dict set aside ([Note: hooks held aside]), our hook's
        key in it, and whether it is whole (called at :meth:`release`) or a shard
        (called by :meth:`call`)."""

    def call(self, params: Iterable[nn.Parameter]) -> None:
        """Run each of the shards ``params``' hooks: their gradients are final for this backward."""
        if self.quiet:
            return
        if self._later is not None:  # only those with hooks: pending() decides a host read on it
            self._later.update((p, None) for p in params if self._theirs(p))
            return
        for p in params:
            hooks = self._theirs(p)
            if hooks:
                self._run(p, hooks)

    def defer_shards(self) -> None:
        """A second forward with grad before the backward: the shards' hooks wait for
        the backward's end, as with ``find_unused_parameters`` (see the note above)."""
        if self._later is None:
            self._later = {}

    def _run(self, p: nn.Parameter, hooks: list[Hook]) -> None:
        self.running = True
        try:
            for hook in hooks:
                hook(p)
        finally:
            self.running = False

    def hold(self, params: Iterable[nn.Parameter], whole: bool, ours: Mapping[int, int] | None = None) -> None:
        """Take the hooks other than ours (``ours``: parameter id -> our handle's id) out
        of autograd's reach until :meth:`release`: the ``whole`` parameters' until
        their average is in ``.grad``, the shards' for :meth:`call`.

        [Note: hooks held aside] The parameter's hook dict itself is set aside and a
        dict of ours alone put in its place (torch then calls that one): the user's
        handles point at the dict set aside, so a hook removed meanwhile, by the caller
        or by itself (a one-shot hook), stays removed when it comes back."""
        for p in params:
            hooks = _hooks_of(p)
            if not hooks or p in self._held:
                continue
            mine = ours.get(id(p)) if ours else None
            if all(k == mine for k in hooks):
                continue
            kept = OrderedDict((k, h) for k, h in hooks.items() if k == mine)
            p._post_accumulate_grad_hooks = kept  # torch's setter: autograd now calls this one (None would not)
            self._held[p] = (hooks, mine, whole)

    def _theirs(self, p: nn.Parameter) -> list[Hook]:
        """``p``'s user hooks now (held aside or not), as a list: one may remove itself."""
        held = self._held.get(p)
        hooks, mine = (held[0], held[1]) if held is not None else (_hooks_of(p) or {}, None)
        return [h for k, h in hooks.items() if k != mine]

    def pending(self) -> bool:
        """Whether :meth:`release` with ``call`` would run a hook (a parameter without a
        gradient aside)."""
        return bool(self._later) or any(whole for _, _, whole in self._held.values())

    def release(self, call: bool) -> None:
        """Put the held hook dicts back (with any hook registered meanwhile); with
        ``call`` (the backward is over, the averages in ``.grad``) run the deferred
        shards' hooks, then the whole parameters', each parameter's in the order they
        came, for those with a gradient."""
        held, self._held = self._held, {}
        later, self._later = self._later, {} if self._defer else None
        for p, (hooks, mine, _) in held.items():
            now = _hooks_of(p) or {}
            hooks.update((k, h) for k, h in now.items() if k != mine)  # registered while held
            p._post_accumulate_grad_hooks = hooks
        if not call or self.quiet:
            return
        for p in later or ():
            hooks = self._theirs(p)
            if hooks and p.grad is not None:
                self._run(p, hooks)
        for p, (hooks, mine, whole) in held.items():
            theirs = [h for k, h in hooks.items() if k != mine]
            if whole and theirs and p.grad is not None:
                self._run(p, theirs)
