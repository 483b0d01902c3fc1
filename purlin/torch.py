"""``import purlin.torch``: the very module :mod:`purlinc.torch` (imports torch)."""

import sys

import purlinc.torch as _impl

sys.modules[__name__] = _impl
