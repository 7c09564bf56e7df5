"""An artifact with its call forms (:mod:`~fx_lightning.signature.forms`): each call goes to the form it is (a call
passing ``rev=True`` to the ``rev=True`` form's own artifact), every other call to the artifact itself. Which form
a call is, is read from the call alone (the argument's value, given or left out), never tried. The forms without a
directory are forward's defaults no observed call passed: given explicitly, they are left out of the call."""

from __future__ import annotations

from typing import Any, List

from torch import nn

from fx_lightning.common.calls import Call
from fx_lightning.errors import ExportError
from fx_lightning.signature.forms import MISSING, CallForm

__all__ = ["WithForms"]


class WithForms(nn.Module):
    """``module`` (the artifact behind its interface) and its ``forms``; ``exported``: the artifact of each form with
    a directory, in order, loaded with the artifact (submodules: ``.to()`` moves them, and a form's first call does
    not wait for a load)."""

    def __init__(self, module: nn.Module, forms: List[CallForm], exported: List[nn.Module]) -> None:
        super().__init__()
        self.module = module
        self.forms = list(forms)
        # Worked out once (every call reads them): the defaults to leave out, the last argument first; the exported.
        self._defaults = sorted((f for f in forms if not f.directory), key=lambda f: -f.position)
        self._exported = [f for f in forms if f.directory]
        assert len(exported) == len(self._exported), "one artifact per exported form"
        self.exported = nn.ModuleList(exported)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:  # the artifact's own attributes (its signature, a session) through the wrapper
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None:
                raise
            return getattr(inner, name)

    def form_of(self, call: Call) -> nn.Module:
        """The module that takes ``call``: a form's artifact, else the artifact itself."""
        return next((self.exported[i] for i, form in enumerate(self._exported) if form.takes(call)), self.module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        call = Call(args, kwargs)
        # forward's default given explicitly (rev=False) where no call passed it: left out, the last argument first
        for form in self._defaults:
            if form.given(call) is not MISSING and form.takes(call):
                call = form.without(call)
        module = self.form_of(call)
        if module is not self.module or not self._exported:
            return module(*call.args, **call.kwargs)
        try:
            return module(*call.args, **call.kwargs)
        except ExportError as exc:  # refused for an argument a form takes: say which other calls the export takes
            if not any(f.argument in exc.message for f in self._exported):
                raise
            others = ", ".join(f.label for f in self._exported)
            raise ExportError(f"{exc.message}; the export's call forms take: {others}") from None
