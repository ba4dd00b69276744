"""Whether a step of your own is written for every backend: the building run watches
which framework functions the step's own code calls.

A step runs on TensorFlow, JAX and torch only if its code calls `keras`,
`keras.ops` and kdist's primitives, never a framework itself. While the
building run (`kdist.step.program.Program.build`) calls the step,
`watching` records each call that code outside Keras, kdist, the frameworks,
Python's standard library and installed packages (the step, its helpers, its
layers) makes into
TensorFlow, JAX or torch, with the file and line it comes from. Only calls
it writes count, a framework's class it makes (`tf.GradientTape()`) too: not
the operators (`a + b` runs the framework's own addition), attributes or
other special methods (`__getattr__` of a torch module), nor what Keras'
layers for one framework's code run (`keras.layers.JaxLayer` and `FlaxLayer`
on JAX, `TorchModuleWrapper` on torch: written for that backend alone).
The real steps run unwatched.
"""

import bisect
import contextlib
import dis
import gc
import re
import sys
import types

FRAMEWORKS = ("tensorflow", "jax", "jaxlib", "torch")
_NOT_YOURS = FRAMEWORKS + ("keras", "kdist", "numpy", "ml_dtypes", "optree", "absl")
# An installed library's code (SciPy, einops): what it calls in a framework is its own doing.
_INSTALLED = re.compile(r"[/\\](site|dist)-packages[/\\]")
# Keras' layers that run one framework's code of yours (JaxLayer, FlaxLayer, TorchModuleWrapper).
_WRAPPER_LAYERS = re.compile(r"keras[/\\]src[/\\]utils[/\\](jax_layer|torch_utils)\.py$")


@contextlib.contextmanager
def watching():
    """Yields a list that fills with (function, file, line) of each framework call
    made from your code while the context is open (this thread)."""
    found: list[tuple[str, str, int]] = []
    # Python's collector calls these from whatever frame runs (JAX registers one).
    collector = {getattr(c, "__code__", None) for c in gc.callbacks}
    opcodes: dict = {}  # Per code object: its instructions' (offsets, names).
    in_builtin: set[int] = set()  # Your frames inside a call to a builtin (sum, sorted).

    def called(caller):
        """Whether `caller` stands at a call it wrote (`f(x)`), not at an operator
        (`a + b`, which runs the framework's operator) or an attribute. (Python
        3.11 leaves `f_lasti` inside the call's inline cache: the instruction
        is the last one at or before it.)"""
        code = caller.f_code
        if code not in opcodes:
            instructions = list(dis.get_instructions(code))
            opcodes[code] = ([i.offset for i in instructions], [i.opname for i in instructions])
        offsets, names = opcodes[code]
        index = bisect.bisect_right(offsets, caller.f_lasti) - 1
        return index >= 0 and names[index].startswith(("CALL", "PRECALL"))

    def yours(frame):
        package = frame.f_globals.get("__name__", "").split(".")[0]
        return (package not in _NOT_YOURS and package not in sys.stdlib_module_names
                and not _INSTALLED.search(frame.f_code.co_filename))

    def profile(frame, event, arg):
        if event in ("c_return", "c_exception"):
            in_builtin.discard(id(frame))
            return
        if event == "call":
            if frame.f_code in collector:
                return
            callee, name, caller = frame.f_globals.get("__name__", ""), frame.f_code.co_name, \
                frame.f_back
        elif event == "c_call":
            callee, name, caller = getattr(arg, "__module__", None) or "", \
                getattr(arg, "__name__", "?"), frame
        else:
            return
        if caller is None or not yours(caller):
            return
        if callee.split(".")[0] not in FRAMEWORKS:
            if event == "c_call":  # A builtin may call the framework's operators for you.
                in_builtin.add(id(caller))
            return
        if name == "__init__":  # A framework's class made by your call: `tf.GradientTape()`.
            name = getattr(frame.f_code, "co_qualname", name).removesuffix(".__init__")
        if name.startswith("__") or id(caller) in in_builtin or not called(caller):
            return  # A special method, an operator, or a builtin's doing.
        if _in_wrapper_layer(caller):
            return
        function = (_wrapped(frame) if event == "call" else None) or f"{callee}.{name}"
        found.append((function, caller.f_code.co_filename, caller.f_lineno))

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield found
    finally:
        sys.setprofile(previous)


def _in_wrapper_layer(frame):
    """Whether `frame` runs inside one of Keras' layers for a framework's code."""
    while frame is not None:
        if _WRAPPER_LAYERS.search(frame.f_code.co_filename):
            return True
        frame = frame.f_back
    return False


def _wrapped(frame):
    """The framework's function that the wrapper running in `frame` closes over
    (a decorator's, as JAX's `api_boundary` wraps `jax.value_and_grad`), as
    "module.name"; None where it closes over none."""
    for free in frame.f_code.co_freevars:
        inner = frame.f_locals.get(free)
        module = getattr(inner, "__module__", None) or ""
        if isinstance(inner, types.FunctionType) and module.split(".")[0] in FRAMEWORKS:
            return f"{module}.{inner.__qualname__}"
    return None
