"""Device-function calls in Triton's CPU interpreter, made cheap (the interpreter runs the whole CPU suite).

Triton 3.6's interpreter (triton/runtime/interpreter.py) remaps triton.language's builtins to numpy ones with
``_patch_lang``: once per kernel launch, restored when the launch ends, and again on every call of a ``@triton.jit``
device function inside it. The second is the same work each time (it walks the language modules with
inspect.getmembers and wraps every builtin not already wrapped): 1.7 ms a call, 43% of a flash-attention forward
at length 1000 in the interpreter (session 54's profile: 16,946 device calls, 28.9 s of 66 s), where the helpers
(``_dot``, ``cast``, ``rne_bf16``) run once per tile.

:func:`install` wraps ``_patch_lang`` so that within one launch each set of language modules is patched once: a
device function whose modules the launch already patched gets an empty scope (the interpreter drops a device
call's scope unrestored anyway), one that sees another module (``tl.core`` beside ``tl``) patches it as before.
The launch's own scope restores everything when it ends, as before, and forgets what was patched. Nothing else
changes: the same wrapped builtins run the same numpy code. Installed only under the interpreter, on the Triton
whose ``_patch_lang`` has the shape above (another version is left alone).
"""

import inspect


def install() -> bool:
    """Wrap the interpreter's ``_patch_lang`` (idempotent). Returns whether the wrapper is in place."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    if getattr(interp, "_triforge_patch_once", False):
        return True
    original = getattr(interp, "_patch_lang", None)
    if original is None or not hasattr(interp, "_LangPatchScope"):
        return False
    try:
        params = list(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        return False
    if params != ["fn"]:
        return False

    patched: list[set] = []  # the launch in progress: ids of the language modules patched for it (empty: none)

    seen: dict = {}  # fn -> its language modules (a function's globals do not change module between calls here)

    def languages(fn) -> frozenset:
        mods = seen.get(fn)
        if mods is None:
            mods = seen[fn] = frozenset(
                id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and (v is tl or v is tl.core))
        return mods

    class _LaunchScope:
        """The launch's scope: restores its patches, then forgets the launch."""

        def __init__(self, inner):
            self.inner = inner

        def restore(self):
            try:
                self.inner.restore()
            finally:
                patched.clear()

    def patch_lang(fn):
        mods = languages(fn)
        if patched:  # a device function's call inside a launch
            if mods <= patched[0]:
                return interp._LangPatchScope()
            scope = original(fn)
            patched[0].update(mods)
            return scope
        scope = original(fn)  # a launch (GridExecutor.__call__ restores its scope in a finally)
        patched.append(set(mods))
        return _LaunchScope(scope)

    interp._patch_lang = patch_lang
    interp._triforge_patch_once = True
    interp._triforge_original_patch_lang = original
    return True
